"""Real NIXL, two agents in this process: the destination memory kind the engine passes down
(BackendOwner -> FaultyBackend -> NixlBackend) is the kind of NIXL's remote descriptor list.

There is no GPU here, so the peer registers DRAM: a write described as VRAM must reach NIXL as
a VRAM list and be refused for want of a VRAM registration, and one described as DRAM must land.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvstage.transfer.backends import MemRegion, create_backend
from kvstage.transfer.backends.faults import FaultPlan, FaultyBackend
from kvstage.transfer.engine.backend_owner import BackendOwner

SIZE = 4096


@pytest.fixture
def pair():
    writer, target = create_backend("nixl", "kind-writer"), create_backend("nixl", "kind-target")
    try:
        yield writer, target
    finally:
        writer.close()
        target.close()


def test_dst_kind_is_the_kind_of_the_remote_dlist(pair):
    writer, target = pair
    src_mem, dst_mem = np.arange(SIZE, dtype=np.uint64).view(np.uint8)[:SIZE].copy(), np.zeros(SIZE, np.uint8)
    writer.register([MemRegion(addr=src_mem.ctypes.data, length=SIZE)])
    target.register([MemRegion(addr=dst_mem.ctypes.data, length=SIZE)])
    peer = writer.connect(target.identity())

    built: list[str] = []  # the memory kind of each descriptor list NIXL built, local then remote
    real = writer._agent.get_xfer_descs

    def recording(descs, mem_type=None):
        dlist = real(descs, mem_type)
        built.append(str(dlist.getType()).rsplit(".", 1)[-1])
        return dlist

    writer._agent.get_xfer_descs = recording
    owner = BackendOwner(FaultyBackend(writer, FaultPlan()))
    src = np.array([[src_mem.ctypes.data, SIZE, 0]], dtype=np.uint64)
    dst = np.array([[dst_mem.ctypes.data, SIZE, 0]], dtype=np.uint64)

    def write(kind: str) -> tuple[bool, str | None]:
        done: list = []
        owner.submit_write(peer, src, dst, b"tag", lambda ok, reason: done.append((ok, reason)), dst_kind=kind)
        deadline = time.monotonic() + 20
        while not done and time.monotonic() < deadline:
            owner.step()
            target.progress()
        assert done, f"the {kind} write never finished"
        return done[0]

    ok, reason = write("VRAM")
    assert built == ["DRAM_SEG", "VRAM_SEG"]
    assert not ok and "VRAM" in reason and "not inside memory the peer registered" in reason

    built.clear()
    assert write("DRAM") == (True, None)
    assert built == ["DRAM_SEG", "DRAM_SEG"]
    assert np.array_equal(dst_mem, src_mem)
    owner.close()
