"""Prefill side: posting writes, holding staged pieces until the decode ring has room, and
the deadlines of writes in flight.

A direct write goes to the backend at once. A staged piece waits in the `StagedQueue` (pure,
protocol/write_queue.py) until the decode rank's watermark frees its ring region, then a
transfer worker gathers it and issues the one backend write (a piece of at most
`inline_gather_kb` whose layers are written: this thread, `TransferWorkers.run_here`). Completions come back as
WriteDone events and go to the room's state machine. When the backend takes a write and when it
completes are stamped on the request's timeline and timed for the per-write histogram. Just
before the backend takes a write, the decode rank is told (`WritePosted`): it polls for the
write's tag only from then on (protocol/quiet.py), and its polling is what lets a NIXL cma write
complete (docs/backends.md).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from ...staging.workers import GatherJob, Report, TransferWorkers
from ..kv_buffers import KVBuffers
from ..layout import KVLayout
from ..poll import KVPoll
from ..protocol.actions import AwaitUnit, WriteOp
from ..protocol.direct_ranges import (
    CacheGeometry,
    DirectRowsCache,
    direct_descriptors,
    pool_descriptor_parts,
    rows_of,
    slot_rows,
    token_rows,
)
from ..protocol.kinds import FailureKind
from ..protocol.messages import KVMemory, WritePosted
from ..protocol.routing import PeerState
from ..protocol.tags import TagCodec
from ..protocol.write_groups import DescriptorPart, WriteGroup, group_parts
from ..protocol.write_queue import Readiness, StagedQueue, WriteDeadlines
from .events import LayersReady, UnitReady, WriteDone
from .interfaces import Counters, Observer, PeerOutbox, PieceCounters, Post, StagedRegions, WritePort, WriteSeals
from .peers import Peer
from .ready_waiter import ReadyJob, ReadyWaiter
from .rooms import PrefillBook

log = logging.getLogger(__name__)


class WriteQueue:
    """The writes of prefill rank `me`'s rooms (`book`) towards its decode peers (`peers`)."""

    def __init__(self, *, me: int, peers: PeerOutbox, book: PrefillBook, write_timeout: float,
                 watermark_timeout: float, stats: PieceCounters, backend: WritePort, staging: StagedRegions,
                 tags: TagCodec, integrity: WriteSeals, observer: Observer, post: Post, geometry: CacheGeometry,
                 layout: KVLayout, buffers: KVBuffers, workers: TransferWorkers | None,
                 waiter: ReadyWaiter | None = None):
        """`write_timeout`, `watermark_timeout`: Timeouts.write and .watermark; `backend` takes
        the writes, `staging` says whether a decode ring's region is free, `integrity` tags and
        seals them, `observer` times them, `post` reports a direct write's completion as a
        WriteDone event; `geometry`, `layout`, `buffers`: this rank's cache, the writes' source.
        `workers`: the transfer workers of a rank with staging buffers, else None; `waiter`: the
        thread that waits on direct writes' readiness objects."""
        self.me, self.peers, self.book, self.stats = me, peers, book, stats
        self.write_s, self.watermark_s = write_timeout, watermark_timeout
        self.backend, self.staging, self.tags, self.integrity = backend, staging, tags, integrity
        self.observer, self.post_event = observer, post
        self.geometry, self.layout, self.buffers = geometry, layout, buffers
        self.workers, self.waiter = workers, waiter
        self.not_ready: dict[int, WriteOp] = {}  # direct writes whose layers the waiter is waiting for
        self.staged = StagedQueue()
        self.deadlines = WriteDeadlines()
        self.posted_at: dict[int, float] = {}   # op id -> when the backend took it (until it completes)
        self.kv_rows = DirectRowsCache()        # per (room, decode peer): a layer-wise chunk's rows

    def post(self, op: WriteOp, now: float) -> None:
        peer = self.peers.get(op.peer.incarnation)
        if peer is None or peer.state != PeerState.CONNECTED:
            return self._finish(op.room, op.op_id, False, "decode peer is not connected", now)
        if not peer.lease.may_write(now):
            return self._finish(op.room, op.op_id, False, "the lease with the decode peer expired", now)
        if op.staged:
            self.staged.add(op.peer.incarnation, op, now)
            self.stats.add("watermark_waits_started")
            return self.dispatch(op.peer.incarnation, now)
        if op.ready:
            assert self.waiter is not None, "a prefill rank has a readiness waiter"
            self.not_ready[op.op_id] = op
            self.deadlines.start(op.op_id, op.room, now + self.write_s)
            op_id, room = op.op_id, op.room
            return self.waiter.submit(ReadyJob(ready=op.ready, event=lambda error: LayersReady(
                op_id=op_id, room=room, error=error)))
        try:   # what the write is made of: where that raises (a bug), the op fails, never stays in flight
            job = self._relayout_job(op, peer) if op.relayout is not None and self.workers is not None else None
            if job is None:
                groups = self._direct_groups(op, peer)
                tags = tuple(self.integrity.direct_tags(op, len(groups)))
        except Exception as exc:  # noqa: BLE001 - its room fails with the reason, the rank goes on
            return self._unbuilt(op, exc, now)
        if job is not None:
            return self._post_relayout(op, job, now)
        self.stats.add("write_requests", len(groups))
        self.stats.add("descriptors", sum(len(g.src) for g in groups))
        self._count(op, sum(len(g.src) for g in groups), writes=len(groups))
        self.deadlines.start(op.op_id, op.room, now + self.write_s)
        room, op_id = op.room, op.op_id

        def posted(group: int) -> None:  # on this thread; the deadline counts from the post, not the queue
            at = self._posted(op_id, room, group)
            self.deadlines.restart(op_id, at + self.write_s)

        done = AllWritesDone(len(groups), lambda ok, reason: self.post_event(
            WriteDone(op_id=op_id, room=room, ok=ok, reason=reason, tags=tags)))
        for i, (g, tag) in enumerate(zip(groups, tags)):
            self.backend.submit_write(peer.backend_name, g.src, g.dst, tag, done.one, functools.partial(posted, i),
                                     dst_kind=g.dst_kind, room=room)
        self.stats.add("bytes_posted", op.nbytes)

    def _unbuilt(self, op: WriteOp, exc: Exception, now: float) -> None:
        """A write that raised while it was being built (a bug): it completes failed, naming the
        exception, rather than stay in flight with its room waiting for it."""
        log.error("room %s: building write %s failed", op.room, op.op_id, exc_info=exc)
        self.stats.count("internal_errors", "write_build")
        self._finish(op.room, op.op_id, False, f"its write could not be built: {type(exc).__name__}: {exc}", now)

    def _relayout_job(self, op: WriteOp, peer: Peer) -> GatherJob | None:
        """A direct DCP write gathered into a staging buffer first (token_mapping.Relayout): the
        job gathering its tokens, and its pool items after them, and writing them as one backend
        write to the decode rank's slot runs, then its pool items; None (the write goes as
        direct runs) where its pool items would need a backend write of their own (another
        memory kind there, or a pool that writes alone). The decode rank sees the same write
        and tag either way; verifying, the tag's digest is that of the gathered bytes, which are
        the direct write's in its order (no second gather on this thread)."""
        moves, kv = op.relayout, _memory(peer)
        assert moves is not None, "a relayout op carries its relayout"
        rows = [slot_rows(self._peer_geometry(peer).of_layers(op.layers), moves.dst_slot, moves.length)]
        if op.pools:
            mems = {m.name: m for m in kv.pools}
            for name, _src, dst in pool_descriptor_parts(self.buffers.pools, kv.pools, op.pools):
                if mems[name].mem_kind != kv.mem_kind or mems[name].own_writes or self.buffers.pools[name].own_writes:
                    return None
                rows.append(dst)
        dst_rows = np.concatenate(rows) if len(rows) > 1 else rows[0]
        if int(dst_rows[:, 1].sum()) != op.nbytes:
            raise ValueError(f"a relayout's rows hold {int(dst_rows[:, 1].sum())} bytes, its write {op.nbytes}")
        op_id, room = op.op_id, op.room

        def posted() -> None:   # on this thread; the deadline counts from the post, not the queue
            self.deadlines.restart(op_id, self._posted(op_id, room) + self.write_s)

        return GatherJob(op_id=op_id, room=room, peer=peer.backend_name, pages=moves.src_slots, page_tokens=1,
                         layers=self.layout.local(op.layers), heads=op.src_heads, nbytes=op.nbytes, dst_addr=0,
                         dst_device=kv.device, dst_rows=dst_rows, tag=self.tags.encode(op.tag),
                         dst_kind=kv.mem_kind, pools=op.pools, on_posted=posted,
                         # verify: the gathered bytes are the write's, in order: sealed as a staged piece's are
                         seal=self.integrity.sealer(op.tag))

    def _post_relayout(self, op: WriteOp, job: GatherJob, now: float) -> None:
        """Count a relayout's write, start its deadline and hand its gather out."""
        assert job.dst_rows is not None, "a relayout lands as rows"
        self._count(op, len(job.dst_rows))
        self.stats.add("write_requests")
        self.stats.add("descriptors", len(job.dst_rows))
        self.stats.add("relayout_writes")
        self.stats.add("bytes_posted", op.nbytes)
        self.deadlines.start(op.op_id, op.room, now + self.write_s)
        self._gather(job)

    def _gather(self, job: GatherJob) -> None:
        """Hand `job` to a transfer worker, or run it here when it is small and its layers are
        written: the hand-off there and back would cost more than the copy."""
        assert self.workers is not None, "a gather on a rank with transfer workers"
        if self.workers.takes_here(job) and self.workers.run_here(job):
            self.stats.count("gathers", "inline")
        else:
            self.stats.count("gathers", "thread")
            self.workers.submit(job)

    def _direct_groups(self, op: WriteOp, peer: Peer) -> list[WriteGroup]:
        """The backend writes of a direct op: its KV ranges and, on the write carrying the last
        page, its pool items, grouped so that no write mixes memory kinds (write_groups.py)."""
        b, kv = self.buffers, _memory(peer)
        dst_pages = op.dst_pages
        assert dst_pages is not None, "a direct write without destination pages"
        src_geo, dst_geo = self.geometry, self._peer_geometry(peer)
        src_layers = self.layout.local(op.layers)
        if op.token_runs is not None:   # decode context parallel: token runs (token_mapping.py)
            src, dst = rows_of(token_rows(src_geo, dst_geo, *op.token_runs), src_geo.of_layers(src_layers),
                               dst_geo.of_layers(op.layers))
        elif op.layers == self.layout.layers:   # every layer: one write per chunk, nothing to share
            src, dst = direct_descriptors(src_geo.of_layers(src_layers), dst_geo.of_layers(op.layers),
                                          op.src_pages, dst_pages, op.src_heads, op.dst_heads)
        else:   # a layer-wise room's write: the chunk's rows are computed once (DirectRowsCache)
            src, dst = self.kv_rows.descriptors(
                op.room, op.peer.incarnation, kv, src=src_geo, dst=dst_geo, src_pages=op.src_pages,
                dst_pages=dst_pages, heads=(op.src_heads, op.dst_heads), src_layers=src_layers, dst_layers=op.layers)
        parts = [DescriptorPart("kv", b.kind, kv.mem_kind, False, src, dst)]
        if op.pools:
            mems = {m.name: m for m in kv.pools}
            for name, s, d in pool_descriptor_parts(b.pools, kv.pools, op.pools):
                pool, mem = b.pools[name], mems[name]
                parts.append(DescriptorPart(name, pool.kind, mem.mem_kind, pool.own_writes or mem.own_writes, s, d))
        return group_parts(parts)

    def _peer_geometry(self, peer: Peer) -> CacheGeometry:
        kv = _memory(peer)
        return CacheGeometry(tuple(kv.k_addrs) + tuple(kv.v_addrs), self.layout.page_size, kv.token_stride,
                             self.layout.head_bytes, kv.device, num_kv=self.layout.num_kv)

    def dispatch(self, peer_inc: int, now: float) -> None:
        """Hand every waiting piece whose ring region is free to a transfer worker."""
        stats = self.stats
        peer = self.peers.get(peer_inc)   # known while it has pieces waiting: a lost peer's are dropped

        def room_live(room_id: int) -> bool:
            room = self.book.get(room_id)
            return room is not None and room.state is not KVPoll.Failed

        def region_free(op: WriteOp) -> bool:
            return self.staging.region_free(peer_inc, op.ring_start + op.writer_offset, op.nbytes)

        for verdict, op, since in self.staged.take_ready(peer_inc, room_live, region_free):
            if verdict == Readiness.CANCEL:
                self._finish(op.room, op.op_id, False, "cancelled: the room failed", now)
                continue
            if since != now:
                stats.add("watermark_waits")
                stats.add("watermark_wait_s", now - since)
            assert self.workers is not None and peer is not None and peer.ring is not None, \
                "a staged piece without transfer workers here or a ring there"
            ring = peer.ring
            try:   # as in post(): a piece that cannot be made into a job fails, never stays in flight
                job = GatherJob(
                    op_id=op.op_id, room=op.room, peer=peer.backend_name, pages=op.src_pages,
                    layers=self.layout.local(op.layers),
                    ready=op.ready, heads=op.src_heads,
                    nbytes=op.nbytes, dst_addr=ring.addr + op.ring_start % ring.size + op.writer_offset,
                    dst_device=ring.device, tag=self.tags.encode(op.tag), dst_kind=ring.mem_kind, pools=op.pools,
                    on_posted=functools.partial(self._posted, op.op_id, op.room),
                    seal=self.integrity.sealer(op.tag))
            except Exception as exc:  # noqa: BLE001 - its room fails with the reason, the rank goes on
                self._unbuilt(op, exc, now)
                continue
            stats.add("write_requests")
            stats.add("descriptors")
            stats.add("staged_writes")
            stats.add("staged_bytes", op.nbytes)
            stats.staged_write((peer_inc, op.room, op.chunk, op.piece))
            self._count(op, 1)
            self.deadlines.start(op.op_id, op.room, now + self.write_s)
            self._gather(job)

    def await_unit(self, a: AwaitUnit) -> None:
        """A batching room's held unit: wait for its layers off this thread (UnitReady comes back)."""
        assert self.waiter is not None, "a prefill rank has a readiness waiter"
        self.waiter.submit(ReadyJob(ready=a.ready, event=lambda error: UnitReady(room=a.room, seq=a.seq, error=error)))

    def layers_ready(self, ev: LayersReady, now: float) -> None:
        """The waiter is done with a direct write's readiness objects: post it, unless its room
        failed meanwhile (or its deadline passed: it was finished then)."""
        op = self.not_ready.pop(ev.op_id, None)
        if op is None:
            return
        self.deadlines.done(op.op_id)
        room = self.book.get(op.room)
        if ev.error is not None:
            return self._finish(op.room, op.op_id, False, ev.error, now)
        if room is None or room.state is KVPoll.Failed:
            return self._finish(op.room, op.op_id, False, "cancelled: the room failed", now)
        self.post(replace(op, ready=()), now)

    def forget_room(self, room_id: int) -> None:
        """A released room: nothing of it is kept (its direct rows, its staged pieces' page lists)."""
        self.kv_rows.forget(room_id)
        if self.workers is not None:
            self.workers.forget_room(room_id)

    def settle_lost(self, room_id: int, reason: str, now: float) -> None:
        """Complete, failed with `reason`, each write op of the room this queue never took (its
        PostWrite lost with an input that raised): nothing else would ever complete it, and the
        room is released only once none is left. Ops it holds (waiting for ring space or their
        layers, with a worker, or posted) complete as they do."""
        room = self.book.get(room_id)
        if room is None:
            return
        for op_id in [o for o in room.ops if o not in self.deadlines and o not in self.not_ready
                      and not self.staged.holds(o)]:
            self._finish(room_id, op_id, False, reason, now)

    def cancel_room(self, room_id: int, now: float) -> None:
        for op in self.staged.cancel_room(room_id):
            self._finish(op.room, op.op_id, False, "cancelled: the room failed", now)

    def peer_lost(self, peer: Peer, reason: str, now: float, clean: bool) -> None:
        for op in self.staged.drop_peer(peer.key.incarnation):
            self._finish(op.room, op.op_id, False, f"decode peer lost: {reason}", now)

    def on_write_done(self, ev: WriteDone, now: float) -> None:
        self.deadlines.done(ev.op_id)
        posted_at = self.posted_at.pop(ev.op_id, None)
        room = self.book.get(ev.room)
        op = room.ops.get(ev.op_id) if room is not None else None
        if ev.ok and op is not None:
            path = "staged" if op.staged else "direct"
            self.stats.add("bytes_sent", op.nbytes)
            self.stats.count("bytes_sent_by_path", path, op.nbytes)
            if posted_at is not None:
                self.observer.write_done(path, now - posted_at)
            status = self.book.status.get(ev.room)
            if status is not None:
                status.timeline.stamp("last_write", now)
        elif not ev.ok:
            self.stats.count("write_failures", "failed")
        self._finish(ev.room, ev.op_id, ev.ok, ev.reason, now, ev.tags)

    def _count(self, op: WriteOp, descriptors: int, writes: int = 1) -> None:
        """The backend writes of `op` (one, or one per pair of memory kinds) with `descriptors`
        ranges in all, by path and for its request."""
        path = "staged" if op.staged else "direct"
        self.stats.count("write_requests_by_path", path, writes)
        self.stats.count("descriptors_by_path", path, descriptors)
        status = self.book.status.get(op.room)
        if status is not None:
            status.descriptors += descriptors

    def _posted(self, op_id: int, room: int, group: int = 0) -> float:
        """On the control thread (the backend's owner), as the backend takes the write (each
        backend write of a direct write split by memory kind: `group`)."""
        now = time.monotonic()
        self.posted_at.setdefault(op_id, now)
        status = self.book.status.get(room)
        if status is not None:
            status.timeline.stamp("first_write", now)
        self._announce(op_id, room, group)
        return now

    def _announce(self, op_id: int, room_id: int, group: int = 0) -> None:
        """Tell the decode rank a write towards it is on its way, so it polls for its tag."""
        room = self.book.get(room_id)
        op = room.ops.get(op_id) if room is not None else None
        if op is None:
            return
        tag = op.tag
        self.peers.send(op.peer, WritePosted(src=self.me, dst=op.peer.incarnation, room=room_id,
                                             session=tag.session, chunk=tag.chunk, piece=tag.piece, group=group))
        self.stats.add("writes_announced")

    def tick(self, now: float) -> None:
        write_s, watermark_s = self.write_s, self.watermark_s
        for op_id, room_id in self.deadlines.expired(now):
            waiting = self.not_ready.pop(op_id, None)
            if waiting is not None:   # nothing was posted: the room may let go of it now
                self._finish(room_id, op_id, False, f"its layers were not ready within {write_s:g} s", now)
            self.book.fail(room_id, FailureKind.TIMEOUT, f"a write did not complete within {write_s:g} s", now)
        for op in self.staged.expire(now, watermark_s):
            self._finish(op.room, op.op_id, False, f"the decode ring stayed full for {watermark_s:g} s", now)

    def _finish(self, room_id: int, op_id: int, ok: bool, reason: str | None, now: float,
                tags: tuple[bytes, ...] = ()) -> None:
        room = self.book.get(room_id)
        if room is not None:
            self.book.apply(room, room.on_write_done(op_id, ok, reason, now, tags))


def _memory(peer: Peer) -> KVMemory:
    """A decode peer's KV memory: every decode rank's Hello carries it."""
    assert peer.kv is not None, f"decode peer {peer.key} without its KV memory"
    return peer.kv


def gather_report(stats: Counters, post: Post) -> Report:
    """How the transfer workers report a staged write, from their threads: its gather time
    counted, then a WriteDone event to the control thread."""
    def report(op_id: int, room: int, ok: bool, reason: str | None, gather_s: float, tag: bytes) -> None:
        stats.add("gather_s", gather_s)
        post(WriteDone(op_id=op_id, room=room, ok=ok, reason=reason, tags=(tag,) if tag else ()))
    return report


class AllWritesDone:
    """The completion of a logical write posted as several backend writes: `done(ok, reason)`
    once every one completed, ok only if all were (the first failure's reason). Its `one` is
    each backend write's on_done; they all run on the backend's owning thread, one at a time."""

    def __init__(self, count: int, done: Callable[[bool, str | None], None]):
        self._left, self._done = count, done
        self._failure: str | None = None
        self._failed = False

    def one(self, ok: bool, reason: str | None) -> None:
        if not ok and not self._failed:
            self._failed, self._failure = True, reason
        self._left -= 1
        if self._left == 0:
            self._done(not self._failed, self._failure)
