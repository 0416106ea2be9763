"""The engine's write queue (transfer/engine/write_queue.py) with stand-in parts: the peer's
advertised memory kind on every write it makes (direct, staged, and a decode context parallel
write relayouted through a staging buffer), a write it cannot build failing its op rather than
staying in flight, and the ops an internal error lost completed failed while those it holds are
left to complete."""

from __future__ import annotations

import time
from dataclasses import replace
from types import SimpleNamespace

import numpy as np

from kvstage.transfer.engine.write_queue import WriteQueue
from kvstage.transfer.protocol.actions import PeerKey, WriteOp
from kvstage.transfer.protocol.direct_ranges import CacheGeometry
from kvstage.transfer.protocol.messages import KVMemory, RingInfo


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


def test_after_an_internal_error_the_ops_the_queue_never_took_complete_failed_and_the_others_are_left():
    """Room 7 has four ops: 1 posted direct (its deadline runs), 2 waiting for ring space, 3
    waiting for its layers, and 4, whose PostWrite an input that raised lost. Settling the room
    completes 4 alone, failed with the reason: the room can be released once the others end."""
    done: list = []
    room = SimpleNamespace(state=None, ops={1: None, 2: None, 3: None, 4: None},
                           on_write_done=lambda op_id, ok, reason, now, tags: done.append((op_id, ok, reason)))
    q = _queue(_peer())
    q.book = SimpleNamespace(get={7: room}.get, status={}, apply=lambda room, actions: None)
    now = time.monotonic()
    q.deadlines.start(1, 7, now + 5)
    q.staged.add(11, replace(_op(staged=True), op_id=2), now)
    q.not_ready[3] = replace(_op(staged=False), op_id=3)
    q.settle_lost(7, "internal error in the control thread (x)", now)
    assert done == [(4, False, "internal error in the control thread (x)")]
    q.settle_lost(8, "no such room", now)   # a room already gone: nothing to settle
    assert len(done) == 1


def test_a_staged_piece_that_cannot_be_made_a_job_fails_its_op_and_starts_no_deadline():
    """The staged path's twin of the one above: its tag cannot be encoded (a bug), so the piece
    completes failed with the reason, reaches no worker, and leaves no deadline running."""
    done: list = []
    room = SimpleNamespace(state=None, on_write_done=lambda op_id, ok, reason, now, tags: done.append((op_id, ok, reason)))
    q = _queue(_peer())
    q.book = SimpleNamespace(get={7: room}.get, status={}, apply=lambda room, actions: None)

    def broken(tag):
        raise ValueError("tag too long")

    q.tags = SimpleNamespace(encode=broken)
    q.post(_op(staged=True), time.monotonic())
    assert done == [(1, False, "its write could not be built: ValueError: tag too long")]
    assert q.workers.jobs == [] and q.deadlines.expired(time.monotonic() + 60) == [] and not q.staged.holds(1)
