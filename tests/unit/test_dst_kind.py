"""The peer's advertised memory kind reaches Backend.post_write as `dst_kind` on every path.

NIXL describes the destination of a write with a memory kind; a CPU -> GPU write described as
DRAM is rejected. These tests record what arrives at the Backend interface: from BackendOwner,
FaultyBackend and the transfer workers (staged); the engine's write queue's own tests are in
test_write_queue.py.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from kvstage.staging.buffers import StagingBuffer
from kvstage.staging.workers import WRITE_RANGE_BYTES, GatherJob, TransferWorkers, write_range, write_rows
from kvstage.transfer.backends import ArrivedTag, Backend, Registration, WriteHandle, WriteState
from kvstage.transfer.backends.faults import FaultPlan, FaultyBackend
from kvstage.transfer.engine.backend_owner import BackendOwner

SRC = np.array([[4096, 64, 0]], dtype=np.uint64)
DST = np.array([[8192, 64, 1]], dtype=np.uint64)


class RecordingBackend(Backend):
    """Records each post_write's (peer, dst_kind); every write completes at once."""

    kind = "recording"

    def __init__(self):
        self.posts: list[tuple[str, str | None]] = []

    @property
    def name(self) -> str:
        return "rec"

    def identity(self) -> bytes:
        return b"rec"

    def register(self, regions):
        return Registration(tuple(regions))

    def deregister(self, registration):
        registration.active = False

    def connect(self, peer_identity):
        return "peer"

    def disconnect(self, peer):
        pass

    def post_write(self, peer, src, dst, tag, *, dst_kind=None):
        self.posts.append((peer, dst_kind))
        return WriteHandle(peer=peer, nbytes=int(src[:, 1].sum()), ndesc=len(src), state=WriteState.DONE)

    def poll_write(self, handle):
        return handle.state

    def release_write(self, handle):
        pass

    def drain_tags(self) -> list[ArrivedTag]:
        return []

    def close(self):
        pass


def test_backend_owner_passes_dst_kind_to_the_backend():
    be = RecordingBackend()
    owner = BackendOwner(be)
    done = []
    owner.submit_write("peer", SRC, DST, b"t", lambda ok, reason: done.append(ok), dst_kind="VRAM")
    owner.submit_write("peer", SRC, DST, b"t", lambda ok, reason: done.append(ok))
    deadline = time.monotonic() + 5
    while len(done) < 2 and time.monotonic() < deadline:
        owner.step()
    assert done == [True, True]
    assert be.posts == [("peer", "VRAM"), ("peer", None)]


def test_faulty_backend_passes_dst_kind_through():
    be = RecordingBackend()
    faulty = FaultyBackend(be, FaultPlan())
    faulty.post_write("peer", SRC, DST, b"t", dst_kind="VRAM")
    faulty.post_write("peer", SRC, DST, b"t")
    assert be.posts == [("peer", "VRAM"), ("peer", None)]


def test_transfer_worker_submits_the_ring_kind_of_its_job():
    page_size, heads, head_dim = 2, 2, 4
    k = [torch.arange(4 * page_size * heads * head_dim, dtype=torch.float32).reshape(-1, heads, head_dim)]
    v = [k[0] + 1000]
    nbytes = 2 * page_size * heads * head_dim * 4  # one page of K and of V
    submitted: list[tuple[str, str | None]] = []
    reports: list[tuple[bool, str | None, bytes]] = []
    finished = threading.Event()

    def submit(peer, src, dst, tag, on_done, on_posted=None, *, dst_kind=None, room=None):
        submitted.append((peer, dst_kind))
        on_done(True, None)

    def report(op_id, room, ok, reason, gather_s, tag):
        reports.append((ok, reason, tag))
        finished.set()

    buf = StagingBuffer.host(1 << 16)
    workers = TransferWorkers([buf], k, v, page_size, submit, report)
    try:
        workers.submit(GatherJob(op_id=1, room=7, peer="decode-0", pages=np.array([1]), heads=(0, heads),
                                 nbytes=nbytes, dst_addr=1 << 20, dst_device=3, tag=b"t", dst_kind="VRAM", layers=range(1)))
        assert finished.wait(10), "the worker never reported"
    finally:
        workers.stop()
        buf.close()
    assert reports == [(True, None, b"t")]   # the tag it wrote, for WriterDone to repeat
    assert submitted == [("decode-0", "VRAM")]


def test_a_piece_is_written_in_ranges_of_at_most_the_write_range():
    """A staged piece goes out as ONE write (one tag) whose rows cut it into ranges of at most
    `write_range_bytes`, the same offsets on both sides (staging/workers.py, write_rows)."""
    page_size, heads, head_dim = 2, 2, 4
    k = [torch.arange(4 * page_size * heads * head_dim, dtype=torch.float32).reshape(-1, heads, head_dim)]
    v = [k[0] + 1000]
    nbytes = 3 * 2 * page_size * heads * head_dim * 4   # three pages of K and of V: 384 bytes
    rows: list[tuple[np.ndarray, np.ndarray, bytes]] = []
    finished = threading.Event()

    def submit(peer, src, dst, tag, on_done, on_posted=None, *, dst_kind=None, room=None):
        rows.append((src, dst, tag))
        on_done(True, None)

    buf = StagingBuffer.host(1 << 16)
    workers = TransferWorkers([buf], k, v, page_size, submit, lambda *a: finished.set(), write_range_bytes=160)
    try:
        workers.submit(GatherJob(op_id=1, room=7, peer="decode-0", pages=np.array([0, 3, 1]), heads=(0, heads),
                                 nbytes=nbytes, dst_addr=1 << 20, dst_device=3, tag=b"t", layers=range(1)))
        assert finished.wait(10), "the worker never reported"
    finally:
        workers.stop()
        buf.close()
    [(src, dst, tag)] = rows
    assert tag == b"t"
    assert src[:, 1].tolist() == dst[:, 1].tolist() == [160, 160, 64]
    assert (src[:, 0] - src[0, 0]).tolist() == (dst[:, 0] - (1 << 20)).tolist() == [0, 160, 320]
    assert dst[:, 2].tolist() == [3, 3, 3]
    assert src[0, 0] >= buf.addr and src[-1, 0] + src[-1, 1] <= buf.addr + buf.nbytes


def test_write_rows_cut_a_range_and_refuse_nothing_to_write():
    src, dst = write_rows(1000, 0, 5000, 1, 40, 16)
    assert src.tolist() == [[1000, 16, 0], [1016, 16, 0], [1032, 8, 0]]
    assert dst.tolist() == [[5000, 16, 1], [5016, 16, 1], [5032, 8, 1]]
    assert src.dtype == dst.dtype == np.uint64
    assert write_rows(1000, 0, 5000, 1, 16, 16)[0].tolist() == [[1000, 16, 0]]
    assert write_rows(1000, 0, 5000, 1, 5)[0].tolist() == [[1000, 5, 0]]   # 0, the default: one row
    with pytest.raises(ValueError, match="positive"):
        write_rows(1000, 0, 5000, 1, 0)


def test_the_write_range_follows_the_staging_buffers_memory_kind():
    """VRAM buffers cut a piece's write (WRITE_RANGE_BYTES["VRAM"]); host buffers write it as one
    range; the option overrides both."""
    k = [torch.zeros(8, 2, 4)]
    buf = StagingBuffer.host(1 << 12)
    try:
        for option, want in ((None, WRITE_RANGE_BYTES["DRAM"]), (0, 0), (4096, 4096)):
            workers = TransferWorkers([buf], k, None, 2, None, None, write_range_bytes=option)
            workers.stop()
            assert workers._range == want
        assert write_range(["VRAM"], None) == WRITE_RANGE_BYTES["VRAM"] == 16 << 20
        assert write_range(["VRAM"], 0) == 0
    finally:
        buf.close()
    assert WRITE_RANGE_BYTES["DRAM"] == 0
    with pytest.raises(ValueError, match="write_range_bytes"):
        TransferWorkers([], k, None, 2, None, None, write_range_bytes=-1)
