"""The decode side of one room: metadata out, tags in, success only when every byte is in place.

Pure state machine. Once the engine shell has connected the prefill ranks the room needs
(`on_plan`) and the caller gave the destination pages (`init`), the room sends each of them its
metadata. Direct path: tags mark writes landed in the KV pages. Staged path: writers ask for
ring space per chunk; the room splits the chunk into pieces that fit, allocates them from the
shared ring allocator, validates every tag against its allocation, asks for a scatter once all
writers of a piece landed, and frees the region after it.

A failed room keeps every ring region (and, for the direct path, reports its pages not
released) until each writer that knew the room is known to have stopped writing: it said
Quiesced, or it was declared lost.

Control messages may be lost: the room re-sends its metadata until each prefill rank
acknowledged it, re-sends its failure until each writer quiesced, and answers a repeated
WriterDone or AllocRequest with its outcome. Everything it receives is idempotent.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ...staging.pieces import max_piece_pages, plan_pieces
from ...staging.ring import Region, RingAllocator, TooLarge

from ..config import Timeouts
from ..layout import KVLayout
from ..poll import KVPoll
from .actions import (Action, PeerKey, PublishWatermark, Released, RoomTotals, Scatter, ScatterPart, Send,
                      StatusChanged)
from .head_mapping import Assignment, HeadMapping
from .messages import AllocGrant, AllocRequest, Piece, RoomDone, RoomFailed, RoomMeta, WriterDone, encode_pages
from .pool_parts import block_bytes, part_offsets, request_copies, writer_segments
from .tags import Tag, TagKind
from .tracker import ExpectedPiece, Outcome, RoomTracker

TERMINAL = (KVPoll.Success, KVPoll.Failed)


@dataclass(frozen=True)
class RoomPlan:
    """Who writes this decode rank's part of a room, and how (decided when peers connected)."""

    writers: tuple[tuple[PeerKey, Assignment], ...]
    notices: tuple[PeerKey, ...]                  # prefill ranks told about the room, not writing
    staged: bool
    head_page_bytes: int                          # bytes of one head of one page, all layers, K and V
    max_piece_pages: int = 0                      # staged: largest piece (ring and buffers)
    ring_epoch: int = 0
    prefill_tp: int = 0
    decode_tp: int = 0
    ring_size: int = 0                            # staged: the ring and the smallest writer buffer, which
    buffer_bytes: int = 0                         # the last piece's pool bytes must fit besides its pages

    def writer_page_bytes(self, a: Assignment) -> int:
        return self.head_page_bytes * a.num_heads


@dataclass(frozen=True)
class WriterOffer:
    """What a connected prefill rank offers this decode rank (from its HelloAck)."""

    key: PeerKey
    staging: bool
    buffer_bytes: int


def plan_room(layout: KVLayout, mapping: HeadMapping, writers: dict[int, WriterOffer],
              notices: dict[int, PeerKey], *, staging: bool, ring_size: int, ring_align: int,
              piece_cap: int, epoch: int) -> RoomPlan | tuple[str, str]:
    """Decide how a room from this prefill engine moves: the staged path when staging is on here
    (a ring) and at every writer, TP sizes differ and the model is not MLA; direct otherwise.
    Returns the plan, or (failure kind, reason) when a single page can never fit."""
    hpb = layout.num_kv * layout.num_layers * layout.page_size * layout.head_bytes
    assigns = tuple((writers[w].key, mapping.find(w, layout.tp_rank)) for w in sorted(writers))
    staged = (staging and ring_size > 0 and not layout.mla and mapping.prefill_tp != mapping.decode_tp
              and all(o.staging for o in writers.values()))
    mpp = 0
    if staged:
        parts = [hpb * a.num_heads for _, a in assigns]
        buffers = min(o.buffer_bytes for o in writers.values())
        # pieces no larger than piece_cap keep gather, write and scatter of consecutive pieces
        # overlapping; the cap never makes a page impossible, only the buffers and the ring do
        mpp = (max_piece_pages(parts, min(buffers, piece_cap), ring_size, ring_align)
               or max_piece_pages(parts, buffers, ring_size, ring_align))
        if mpp == 0:
            return ("staging", f"one page ({sum(parts)} bytes in the ring, up to {max(parts)} per writer buffer) "
                               f"can never fit the staging ring ({ring_size} bytes) or a prefill worker buffer "
                               f"({buffers} bytes)")
    return RoomPlan(assigns, tuple(notices[n] for n in sorted(notices)), staged, hpb, mpp, epoch,
                    mapping.prefill_tp, mapping.decode_tp, ring_size,
                    min(o.buffer_bytes for o in writers.values()) if writers else 0)


@dataclass(frozen=True, kw_only=True)
class WriterPart:
    """One writer's part of a staged piece in the ring: its KV bytes, then its pool copies."""

    writer: int                  # the writer's prefill TP rank
    offset: int                  # byte offset of the part in the ring
    kv_bytes: int
    copies: tuple = ()           # PoolCopy of each state pool item it carries (the last piece only)


@dataclass(frozen=True, kw_only=True)
class RingSpan:
    """Where a staged write landed: its bytes in the ring."""

    offset: int
    nbytes: int


@dataclass(frozen=True, kw_only=True)
class PageSpan:
    """Where a direct write landed: cache pages, the heads written, pool items, its bytes."""

    pages: np.ndarray
    heads: tuple[int, int]
    copies: tuple
    nbytes: int


@dataclass
class WriterState:
    peer: PeerKey
    assignment: Assignment
    tags: set = field(default_factory=set)        # distinct (chunk, piece) landed
    digests: dict = field(default_factory=dict)   # (chunk, piece) -> the digest its tag carries (verify)
    done_at: float | None = None                  # WriterDone received
    done_writes: int = 0
    stopped: bool = False                         # quiesced or lost: it will not write again...
    quiet_after: float = 0.0                      # ... after this time (a lost writer's last write may stall)


@dataclass
class Allocation:
    chunk: int
    page_start: int
    num_pages: int
    pieces: list[Piece]
    regions: dict[int, Region]                    # piece index -> region, until freed


class DecodeRoom:
    def __init__(self, room: int, session: int, me: int, layout: KVLayout, now: float, timeouts: Timeouts,
                 pools: tuple = ()):
        self.room = room
        self.session = session
        self.me = me
        self.layout = layout
        self.timeouts = timeouts
        self.created = now
        self.state = KVPoll.Bootstrapping
        self.failure: str | None = None
        self.failure_kind: str | None = None
        self.plan: RoomPlan | None = None
        self.dst_pages: np.ndarray | None = None
        self.inited_at: float | None = None
        self.meta_sent = False
        self.writers: dict[int, WriterState] = {}
        self.tracker: RoomTracker | None = None
        self.allocs: dict[int, Allocation] = {}
        self.scattering: dict[tuple[int, int], float] = {}   # piece key -> when asked
        self.released = False
        self.acked: set[int] = set()                         # prefill ranks that acknowledged the metadata
        self._retry_at = 0.0
        self._now = now
        self.prefix = 0                                      # pages of the request held already
        self.bytes_in = 0                                    # bytes of accepted tags (writes that landed)
        self.writes_in = 0
        self.pools = pools                                   # state pool specs
        self.pool_items: dict = {}                           # this request's items of them
        self.pool_copies: dict[int, tuple] = {}              # writer rank -> its PoolCopy's (last page)

    # -- set-up -----------------------------------------------------------------------------
    def on_plan(self, plan: RoomPlan, now: float) -> list[Action]:
        if self.state in TERMINAL or self.plan is not None:
            return []
        self.plan = plan
        self.writers = {p.tp_rank: WriterState(p, a) for p, a in plan.writers}
        out = self._set_state(KVPoll.WaitingForInput)
        return out + self._start(now)

    def on_plan_failed(self, kind: str, reason: str, now: float) -> list[Action]:
        return self.fail(kind, reason, now)

    def init(self, dst_pages: np.ndarray, now: float, prefix_pages: int = 0, pool_items: dict | None = None) -> list[Action]:
        """Destination pages (validated by the caller's handle) for the request's pages past the
        `prefix_pages` this rank already holds (its prefix cache): those are never written."""
        if self.dst_pages is not None:
            raise ValueError(f"room {self.room}: init() called twice")
        self.dst_pages = dst_pages
        self.prefix = prefix_pages
        self.pool_items = pool_items or {}
        self.inited_at = now
        if self.state in TERMINAL:
            return []
        return self._start(now)

    def _start(self, now: float) -> list[Action]:
        if self.plan is None or self.dst_pages is None or self.meta_sent:
            return []
        n = int(self.dst_pages.size)
        p = self.plan
        self.pool_copies = {r: request_copies(writer_segments(self.pools, p.prefill_tp, p.decode_tp, w.assignment), None,
                                              self.pool_items) for r, w in self.writers.items()} if self.pool_items else {}
        self.tracker = RoomTracker(n, {r: self.plan.writer_page_bytes(w.assignment) for r, w in self.writers.items()},
                                   {r: block_bytes(c) for r, c in self.pool_copies.items()})
        self.meta_sent = True
        self._retry_at = now + self.timeouts.heartbeat
        return self._metas(self._all_prefill()) + self._set_state(KVPoll.Transferring)

    def _all_prefill(self) -> list[PeerKey]:
        return [p for p, _ in self.plan.writers] + list(self.plan.notices)

    def _metas(self, peers: list[PeerKey]) -> list[Action]:
        n = int(self.dst_pages.size)
        writers = {p for p, _ in self.plan.writers}
        pages = b"" if self.plan.staged else encode_pages(self.dst_pages)
        return [Send(p, RoomMeta(src=self.me, dst=p.incarnation, room=self.room, session=self.session,
                                 num_pages=self.prefix + n, staged=self.plan.staged and p in writers,
                                 dst_pages=pages if p in writers else b"", prefix_pages=self.prefix,
                                 pool_items={k: encode_pages(v) for k, v in self.pool_items.items()}))
                for p in peers]

    def on_meta_ack(self, peer: PeerKey, session: int) -> None:
        if session == self.session and self.plan is not None and peer in self._all_prefill():
            self.acked.add(peer.tp_rank)

    # -- staged: allocation -----------------------------------------------------------------
    def on_alloc_request(self, peer: PeerKey, req: AllocRequest, ring: RingAllocator, now: float) -> list[Action]:
        w = self._writer(peer)
        if w is None or req.session != self.session:
            return []
        self.acked.add(peer.tp_rank)
        if self.state in TERMINAL:
            return self._outcome(peer)
        if not self.plan.staged:
            return self.fail("protocol", f"{peer} asked for ring space in a direct-path room", now)
        alloc = self.allocs.get(req.chunk)
        if alloc is not None:
            if (alloc.page_start, alloc.num_pages) != (req.page_start, req.num_pages):
                return self.fail("protocol", f"writers disagree on chunk {req.chunk}: pages "
                                             f"[{alloc.page_start}, +{alloc.num_pages}) vs [{req.page_start}, "
                                             f"+{req.num_pages}) from {peer}", now)
            return [self._grant(peer, alloc)]
        if req.num_pages <= 0 or req.page_start < 0 or req.page_start + req.num_pages > self.tracker.num_pages \
                or self.tracker.overlaps_plan(req.page_start, req.num_pages):
            return self.fail("protocol", f"chunk {req.chunk} from {peer} covers pages [{req.page_start}, "
                                         f"+{req.num_pages}) that are outside the room or already planned", now)
        page_bytes = sum(self.plan.writer_page_bytes(w.assignment) for w in self.writers.values())
        fit = ring.pages_fit_now(page_bytes)
        pieces: list[Piece] = []
        regions: dict[int, Region] = {}
        planned = plan_pieces(req.page_start, req.num_pages, self.plan.max_piece_pages, fit)
        final = req.page_start + req.num_pages == self.tracker.num_pages
        extra = sum(self.tracker.final_extra.values()) if final else 0
        if extra:  # the last piece also holds every writer's pool block: it may need fewer pages
            planned = self._fit_pools(planned)
            if not planned:
                return self.fail("staging", f"the state pool items of this request ({extra} bytes with one page) "
                                            f"do not fit the staging ring ({self.plan.ring_size} bytes) or a prefill "
                                            f"worker buffer ({self.plan.buffer_bytes} bytes)", now)
        for i, (start, count) in enumerate(planned):
            last = start + count == self.tracker.num_pages
            region = ring.allocate(count * page_bytes + (extra if last else 0))
            if isinstance(region, TooLarge):  # max_piece_pages makes this impossible
                raise AssertionError(str(region))
            regions[i] = region
            pieces.append(Piece(i, start, count, region.start, region.nbytes))
            self.tracker.expect_piece(req.chunk, i, start, count, region.start, list(self.writers))
        alloc = Allocation(req.chunk, req.page_start, req.num_pages, pieces, regions)
        self.allocs[req.chunk] = alloc
        return [self._grant(peer, alloc)]

    def _fit_pools(self, planned: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Split the last piece so its pages and every writer's pool block fit the ring and each
        writer's part its buffer; [] when not even one page does."""
        start, count = planned[-1]
        extra = self.tracker.final_extra
        wpb = self.tracker.writer_page_bytes
        total = sum(wpb.values())
        fits = [n for n in range(count, 0, -1)
                if n * total + sum(extra.values()) <= self.plan.ring_size
                and all(n * wpb[w] + extra.get(w, 0) <= self.plan.buffer_bytes for w in wpb)]
        if not fits:
            return []
        n = fits[0]
        return planned[:-1] + ([(start, count - n)] if n < count else []) + [(start + count - n, n)]

    def _grant(self, peer: PeerKey, alloc: Allocation) -> Send:
        return Send(peer, AllocGrant(src=self.me, dst=peer.incarnation, room=self.room, session=self.session,
                                     chunk=alloc.chunk, epoch=self.plan.ring_epoch, pieces=list(alloc.pieces)))

    # -- arrivals ---------------------------------------------------------------------------
    def on_tag(self, peer: PeerKey, tag: Tag, now: float) -> tuple[str, list[Action]]:
        """Apply one arrived tag. Returns (verdict, actions): verdict is "ok", "partial" (one
        backend write of a direct write split by memory kind: its bytes count once all landed),
        "duplicate", "stale" (meant for another life of this room or peer: dropped) or "rejected"."""
        w = self._writer(peer)
        if w is None or tag.session != self.session or tag.src != peer.incarnation or self.tracker is None:
            return "stale", []
        self.acked.add(peer.tp_rank)
        if self.state in TERMINAL:
            return "stale", []
        if tag.writer != peer.tp_rank:
            return "rejected", self.fail("protocol", f"tag from {peer} claims writer {tag.writer}", now)
        if self.plan.staged:
            if tag.kind is not TagKind.STAGED or tag.epoch != self.plan.ring_epoch:
                return "rejected", self.fail("protocol", f"tag from {peer} is not a staged tag of ring epoch "
                                                         f"{self.plan.ring_epoch}: {tag}", now)
            arrival = self.tracker.arrive_staged(tag.writer, tag.chunk, tag.piece, tag.page_start, tag.num_pages,
                                                 tag.nbytes, tag.ring_start)
        else:
            if tag.kind is not TagKind.DIRECT or tag.epoch != self.me:
                return "rejected", self.fail("protocol", f"tag from {peer} is not a direct tag for this rank: "
                                                         f"{tag}", now)
            arrival = self.tracker.arrive_direct(tag.writer, tag.chunk, tag.page_start, tag.num_pages, tag.nbytes,
                                                 tag.group, tag.groups)
        if arrival.outcome is Outcome.DUPLICATE:
            return "duplicate", []
        if arrival.outcome is Outcome.PARTIAL:
            self.writes_in += 1
            return "partial", []
        if arrival.outcome is Outcome.REJECTED:
            return "rejected", self.fail("tag_mismatch", f"tag from {peer} rejected: {arrival.reason}", now)
        w.tags.add((tag.chunk, tag.piece))
        w.digests[(tag.chunk, tag.piece)] = tag.digest
        self.bytes_in += tag.nbytes
        self.writes_in += 1
        if arrival.outcome is Outcome.PIECE_LANDED:
            return "ok", [self._scatter(arrival.piece, now)]
        return "ok", self._check_complete(now)

    def _parts(self, chunk: int, index: int, page_start: int, num_pages: int) -> list[WriterPart]:
        """Each writer's part of a staged piece, in writer order."""
        region = self.allocs[chunk].regions[index]
        per_head = num_pages * self.plan.head_page_bytes
        writers = sorted(self.writers.items(), key=lambda rw: rw[1].assignment.writer_index)
        final = page_start + num_pages == self.tracker.num_pages
        copies = [self.pool_copies.get(r, ()) if final else () for r, _ in writers]
        kv = [per_head * w.assignment.num_heads for _, w in writers]
        offsets = part_offsets([n + block_bytes(c) for n, c in zip(kv, copies)])
        return [WriterPart(writer=r, offset=region.offset + off, kv_bytes=n, copies=c)
                for (r, _), off, n, c in zip(writers, offsets, kv, copies)]

    def completes_write(self, tag: Tag) -> bool:
        """Whether the write `tag` belongs to is whole once it lands: always, but for a direct
        write split by memory kind, whose bytes are only all in place with its last group."""
        if tag.groups == 1 or self.tracker is None:
            return True
        return self.tracker.group_completes((tag.writer, tag.chunk, tag.page_start, tag.num_pages), tag.group,
                                            tag.groups)

    def landed_span(self, tag: Tag) -> RingSpan | PageSpan | None:
        """Where the write of an accepted tag landed: in the ring (staged) or in cache pages
        (direct); None when the tag is not this room's."""
        w = self.writers.get(tag.writer)
        if w is None or tag.session != self.session or self.tracker is None or self.state in TERMINAL:
            return None
        if self.plan.staged:
            if tag.chunk not in self.allocs or tag.piece not in self.allocs[tag.chunk].regions:
                return None
            part = next(p for p in self._parts(tag.chunk, tag.piece, tag.page_start, tag.num_pages)
                        if p.writer == tag.writer)
            return RingSpan(offset=part.offset, nbytes=part.kv_bytes + block_bytes(part.copies))
        if tag.page_start < 0 or tag.num_pages <= 0 or tag.page_start + tag.num_pages > self.tracker.num_pages:
            return None
        final = tag.page_start + tag.num_pages == self.tracker.num_pages
        return PageSpan(pages=self.dst_pages[tag.page_start:tag.page_start + tag.num_pages],
                        heads=w.assignment.dst_heads, copies=self.pool_copies.get(tag.writer, ()) if final else (),
                        nbytes=tag.nbytes)

    def _scatter(self, piece: ExpectedPiece, now: float) -> Scatter:
        self.scattering[piece.key] = now
        parts_ = self._parts(piece.chunk, piece.index, piece.page_start, piece.num_pages)
        parts = tuple(ScatterPart(p.offset, p.kv_bytes, self.writers[p.writer].assignment.dst_heads) for p in parts_)
        pools = tuple((p.offset + p.kv_bytes + c.offset, c) for p in parts_ for c in p.copies)
        checks = tuple((p.offset, p.kv_bytes + block_bytes(p.copies), self.writers[p.writer].digests.get(piece.key, 0),
                        p.writer) for p in parts_)
        dst = self.dst_pages[piece.page_start:piece.page_start + piece.num_pages]
        return Scatter(self.room, piece.key, dst, parts, pools, checks)

    def on_scattered(self, key: tuple[int, int], ok: bool, reason: str | None, ring: RingAllocator,
                     now: float, kind: str = "scatter") -> list[Action]:
        if self.scattering.pop(key, None) is None:
            return []
        chunk, index = key
        out: list[Action] = []
        if ok and self.state not in TERMINAL:
            piece = next(p for p in self.tracker.pieces() if p.key == key)
            self.tracker.mark_scattered(piece)
        elif not ok:
            out += self.fail(kind, reason if kind == "corrupt" else
                             f"scatter of chunk {chunk} piece {index} failed: {reason}", now)
        # every writer of the piece landed and the scatter is over: nothing touches the region
        out += self._free(ring, [self.allocs[chunk].regions.pop(index)])
        return out + self._check_complete(now) + self._maybe_release(ring, now)

    def on_writer_done(self, peer: PeerKey, msg: WriterDone, now: float) -> list[Action]:
        w = self._writer(peer)
        if w is None or msg.session != self.session:
            return []
        self.acked.add(peer.tp_rank)
        if self.state in TERMINAL:
            return self._outcome(peer)   # our answer may have been lost: say it again
        if w.done_at is None:
            w.done_at, w.done_writes = now, msg.writes
        return []

    def _outcome(self, peer: PeerKey) -> list[Action]:
        if self.state is KVPoll.Success:
            return [Send(peer, RoomDone(src=self.me, dst=peer.incarnation, room=self.room, session=self.session))]
        return [Send(peer, RoomFailed(src=self.me, dst=peer.incarnation, room=self.room, session=self.session,
                                      kind=self.failure_kind or "failed", reason=self.failure or ""))]

    # -- failures ---------------------------------------------------------------------------
    def on_room_failed(self, peer: PeerKey, session: int, kind: str, reason: str, now: float) -> list[Action]:
        if session != self.session or (self._writer(peer) is None and peer not in (self.plan.notices if self.plan else ())):
            return []
        return self.fail(kind if kind.startswith("remote_") else f"remote_{kind}", f"prefill rank {peer.tp_rank} ({peer.engine_id}): {reason}", now,
                         origin=peer)

    def on_quiesced(self, peer: PeerKey, session: int, ring: RingAllocator | None, now: float) -> list[Action]:
        w = self._writer(peer)
        if w is None or session != self.session:
            return []
        w.stopped = True
        out: list[Action] = []
        if self.state not in TERMINAL:  # it gave up on the room and its failure notice was lost
            out = self.fail("remote_failed", f"prefill rank {peer.tp_rank} ({peer.engine_id}) stopped writing this "
                                             "room", now, origin=peer)
        return out + self._maybe_release(ring, now)

    def on_peer_lost(self, peer: PeerKey, reason: str, ring: RingAllocator | None, now: float,
                     quarantine: float = 0.0) -> list[Action]:
        """`quarantine`: how long a write the lost writer already posted may still land (its
        backend's stall bound); its memory is not reused before."""
        w = self._writer(peer)
        notice = self.plan is not None and peer in self.plan.notices
        if w is None and not notice:
            return []
        if w is not None:
            w.stopped = True  # its lease ran out or its connection closed: it posts no more writes
            w.quiet_after = max(w.quiet_after, now + quarantine)
        out = []
        if w is not None or not self.meta_sent:
            out = self.fail("peer_lost", f"prefill rank {peer.tp_rank} ({peer}) lost: {reason}", now)
        return out + self._maybe_release(ring, now)

    def abort(self, ring: RingAllocator | None, now: float) -> list[Action]:
        return self.fail("aborted", "aborted by the decode caller", now) + self._maybe_release(ring, now)

    def tick(self, ring: RingAllocator | None, now: float) -> list[Action]:
        out = self._retransmit(now)
        if self.state in TERMINAL:
            return out + self._maybe_release(ring, now)
        return out + self._deadlines(now)

    def _retransmit(self, now: float) -> list[Action]:
        """What a lost message would otherwise leave waiting for a deadline."""
        if not self.meta_sent or self.released or now < self._retry_at:
            return []
        self._retry_at = now + self.timeouts.heartbeat
        if self.state is KVPoll.Failed:
            return [self._outcome(w.peer)[0] for w in self.writers.values() if not w.stopped]
        if self.state is KVPoll.Transferring:
            return self._metas([p for p in self._all_prefill() if p.tp_rank not in self.acked])
        return []

    def _deadlines(self, now: float) -> list[Action]:
        t = self.timeouts
        if self.inited_at is not None and now - self.inited_at > t.room:
            return self.fail("timeout", f"room not complete {t.room:g} s after init", now)
        for w in self.writers.values():
            if w.done_at is not None and len(w.tags) < w.done_writes and now - w.done_at > t.arrival:
                return self.fail("timeout", f"prefill rank {w.peer.tp_rank} reported {w.done_writes} writes done "
                                            f"but only {len(w.tags)} notifications arrived within {t.arrival:g} s "
                                            "(lost notification)", now)
        for key, since in self.scattering.items():
            if now - since > t.scatter:
                return self.fail("timeout", f"scatter of chunk {key[0]} piece {key[1]} took over {t.scatter:g} s",
                                 now)
        return []

    def fail(self, kind: str, reason: str, now: float, origin: PeerKey | None = None) -> list[Action]:
        """Fail the room and tell every prefill peer but the one the failure came from."""
        if self.state in TERMINAL:
            return []
        self.failure, self.failure_kind = reason, kind
        out = self._set_state(KVPoll.Failed)
        if self.meta_sent:
            for peer in [p for p, _ in self.plan.writers] + list(self.plan.notices):
                if peer == origin:
                    continue
                out.append(Send(peer, RoomFailed(src=self.me, dst=peer.incarnation, room=self.room,
                                                 session=self.session, kind=kind, reason=reason)))
        return out

    # -- internals --------------------------------------------------------------------------
    def totals(self) -> RoomTotals:
        """Bytes and writes that landed here (each accepted tag is one backend write)."""
        path = "none" if self.plan is None or not self.plan.writers else "staged" if self.plan.staged else "direct"
        return RoomTotals(self.bytes_in, self.writes_in, path)

    def _writer(self, peer: PeerKey) -> WriterState | None:
        w = self.writers.get(peer.tp_rank)
        return w if w is not None and w.peer == peer else None

    def _check_complete(self, now: float) -> list[Action]:
        if self.state in TERMINAL or self.tracker is None or not self.tracker.complete:
            return []
        out: list[Action] = []
        for w in self.writers.values():
            out.append(Send(w.peer, RoomDone(src=self.me, dst=w.peer.incarnation, room=self.room,
                                             session=self.session)))
        return out + self._set_state(KVPoll.Success)

    def _free(self, ring: RingAllocator | None, regions: list[Region]) -> list[Action]:
        moved = False
        for region in regions:
            moved |= ring.free(region) is not None
        return [PublishWatermark()] if moved else []

    def _maybe_release(self, ring: RingAllocator | None, now: float) -> list[Action]:
        self._now = now
        if self.released or self.state not in TERMINAL or self.scattering:
            return []
        if self.state is KVPoll.Failed and self.meta_sent and not all(w.stopped and now >= w.quiet_after
                                                                     for w in self.writers.values()):
            return []
        self.released = True
        leftover = [r for a in self.allocs.values() for r in a.regions.values()]
        for a in self.allocs.values():
            a.regions.clear()
        out = self._free(ring, leftover) if leftover else []
        return out + [StatusChanged(self.state, self.failure, self.failure_kind, released=True), Released()]

    def _set_state(self, state: KVPoll) -> list[Action]:
        if state == self.state or self.state in TERMINAL:
            return []
        self.state = state
        out: list[Action] = [StatusChanged(state, self.failure, self.failure_kind)]
        if state is KVPoll.Success:
            out += self._maybe_release(None, self._now)
        return out
