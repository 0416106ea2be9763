"""The peer's advertised memory kind reaches Backend.post_write as `dst_kind` on every path.

NIXL describes the destination of a write with a memory kind; a CPU -> GPU write described as
DRAM is rejected. These tests record what arrives at the Backend interface: from BackendOwner,
FaultyBackend, the transfer workers (staged) and the engine's write queue (direct, staged, and a
decode context parallel write relayouted through a staging buffer); and a write the queue cannot
build fails its op rather than staying in flight.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvstage.staging.buffers import StagingBuffer
from kvstage.staging.workers import WRITE_RANGE_BYTES, GatherJob, TransferWorkers, write_range, write_rows
from kvstage.transfer.backends import ArrivedTag, Backend, Registration, WriteHandle, WriteState
from kvstage.transfer.backends.faults import FaultPlan, FaultyBackend
from kvstage.transfer.engine.backend_owner import BackendOwner
from kvstage.transfer.engine.write_queue import WriteQueue
from kvstage.transfer.protocol.actions import PeerKey, WriteOp
from kvstage.transfer.protocol.direct_ranges import CacheGeometry
from kvstage.transfer.protocol.messages import KVMemory, RingInfo

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


# ------------------------------------------------------------------ the engine's write queue, stand-in parts
class RecordingOwner:
    """Stands in for BackendOwner at the write queue: records submit_write's dst_kind."""

    def __init__(self):
        self.kinds: list[str | None] = []

    def submit_write(self, peer, src, dst, tag, on_done, on_posted=None, *, dst_kind=None, room=None):
        self.kinds.append(dst_kind)


class Stats:
    def add(self, *a):
        pass

    def count(self, *a):
        pass

    def staged_write(self, *a):
        pass


def _op(staged: bool) -> WriteOp:
    return WriteOp(op_id=1, room=7, peer=PeerKey("decode", 0, 11), staged=staged, chunk=0, piece=0,
                   src_pages=np.array([0]), dst_pages=None if staged else np.array([1]), src_heads=(0, 1),
                   dst_heads=(0, 1), nbytes=64, tag=b"tag", ring_start=0 if staged else -1, layers=range(1))


def _queue(peer) -> WriteQueue:
    geo = CacheGeometry((1 << 20, 1 << 21), page_size=2, token_stride=16, head_bytes=16, num_kv=2)
    book = SimpleNamespace(get={7: SimpleNamespace(state=None)}.get, status={})
    workers = SimpleNamespace(jobs=[], takes_here=lambda job: False)   # every piece to a worker
    workers.submit = workers.jobs.append
    return WriteQueue(
        me=1, peers={11: peer}, book=book, write_timeout=5.0, watermark_timeout=5.0, stats=Stats(),
        backend=RecordingOwner(), staging=SimpleNamespace(region_free=lambda inc, start, n: True),
        tags=SimpleNamespace(encode=lambda tag: tag),
        integrity=SimpleNamespace(direct_tags=lambda op, groups=1: [op.tag] * groups, sealer=lambda tag: None),
        observer=None, post=lambda ev: None, geometry=geo,
        layout=SimpleNamespace(page_size=2, head_bytes=16, num_kv=2, layers=range(1), local=lambda layers: layers),
        buffers=SimpleNamespace(kind="DRAM", pools={}), workers=workers)


def _peer():
    kv = KVMemory(k_addrs=[1 << 22], v_addrs=[1 << 23], num_pages=4, page_stride=32, token_stride=16,
                  mem_kind="VRAM", device=1)
    ring = RingInfo(addr=1 << 24, size=1 << 16, epoch=11, mem_kind="VRAM", device=1)
    return SimpleNamespace(state="connected", lease=SimpleNamespace(may_write=lambda now: True),
                           backend_name="decode-0", kv=kv, ring=ring)


def test_direct_write_carries_the_peer_kv_mem_kind():
    q = _queue(_peer())
    q.post(_op(staged=False), time.monotonic())
    assert q.backend.kinds == ["VRAM"]


def test_staged_job_carries_the_peer_ring_mem_kind():
    q = _queue(_peer())
    q.post(_op(staged=True), time.monotonic())
    assert [(j.peer, j.dst_device, j.dst_kind) for j in q.workers.jobs] == [("decode-0", 1, "VRAM")]


def test_a_relayout_job_gathers_pool_slots_and_lands_as_the_peers_slot_runs_in_its_kv_mem_kind():
    """A DCP write with a relayout (token_mapping.Relayout): prefill slots 0, 2, 4 gathered at
    page size 1 and landed as decode slots 1..3 of K then V (one run, 48 bytes a tensor), in the
    peer's KV memory kind, with the tag integrity gives the direct write."""
    from kvstage.transfer.protocol.token_mapping import Relayout

    q = _queue(_peer())
    moves = Relayout(src_slots=np.array([0, 2, 4]), dst_slot=np.array([1]), length=np.array([3]))
    q.post(replace(_op(staged=False), nbytes=96, relayout=moves, token_runs=(np.array([0, 2, 4]), np.array([1, 2, 3]),
                                                                            np.ones(3, dtype=np.int64))),
           time.monotonic())
    (job,) = q.workers.jobs
    assert q.backend.kinds == []   # nothing written from the cache itself
    assert (job.page_tokens, [int(s) for s in job.pages], job.nbytes, job.dst_kind, job.tag) == (1, [0, 2, 4], 96,
                                                                                                  "VRAM", b"tag")
    assert job.dst_rows.tolist() == [[(1 << 22) + 16, 48, 1], [(1 << 23) + 16, 48, 1]]


def test_a_write_that_cannot_be_built_fails_its_op_with_the_reason_and_is_never_posted():
    """A bug while building a direct write (here: its tags) must not leave the op in flight, where
    its room would wait for it forever and never be released: the op completes failed, naming
    the exception."""
    done: list = []
    room = SimpleNamespace(state=None, on_write_done=lambda op_id, ok, reason, now, tags: done.append((op_id, ok, reason)))
    q = _queue(_peer())
    q.book = SimpleNamespace(get={7: room}.get, status={}, apply=lambda room, actions: None)

    def broken(op, groups=1):
        raise ValueError("gather: out has 96 bytes, the region needs 256")

    q.integrity = SimpleNamespace(direct_tags=broken)
    q.post(_op(staged=False), time.monotonic())
    assert done == [(1, False, "its write could not be built: ValueError: gather: out has 96 bytes, the region "
                               "needs 256")]
    assert q.backend.kinds == [] and q.deadlines.expired(time.monotonic() + 60) == []
