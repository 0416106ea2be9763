"""The decode side of one room: metadata out, tags in, success only when every byte is in place.

Pure state machine. Once the engine shell has connected the prefill ranks the room needs
(`on_plan`) and the caller gave the destination pages (`init`), the room sends each of them its
metadata. Direct path: tags mark writes landed in the KV pages. Staged path: writers ask for
ring space per chunk; the room splits the chunk into pieces that fit, allocates them from the
shared ring allocator, validates every tag against its allocation, asks for a scatter once all
writers of a piece landed, and frees the region after it.

Ring credits (transfer/protocol/credits.py): a single-writer piece may also arrive unplanned, written
into a credit its writer holds (`on_credit_tag`, a CREDIT tag). The shell first claims its
place from the ring's CreditLedger; the room checks the piece against its own plan (its
writer is the only writer of those layers, its pages inside the room and planned by no other
piece, its bytes what that writer writes there), scatters it like a granted piece, and hands
its place back to the ledger afterwards (`ReleaseCredit`) instead of freeing it in the ring:
the credit holds the region. A claim the ledger refused (outside a credit, overlapping another
write, after the credit came back) fails this room only; its bytes are never scattered.

A failed room keeps every ring region (and, for the direct path, reports its pages not
released) until each writer that knew the room is known to have stopped writing: it said
Quiesced, or it was declared lost.

Control messages may be lost: the room re-sends its metadata until each prefill rank
acknowledged it, re-sends its failure until each writer quiesced, and answers a repeated
WriterDone or AllocRequest with its outcome. Everything it receives is idempotent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import numpy as np

from ...draft_kv import draft_pool_name, request_draft_items
from ...layout import KVLayout
from ...poll import KVPoll
from ...pool_spec import PoolSpec
from ...timeouts import Timeouts
from .. import credits as credit_rules
from ..actions import (
    DecodeAction,
    PartCheck,
    PeerKey,
    PoolPlacement,
    PrepareScatter,
    PublishWatermark,
    ReleaseCredit,
    RoomTotals,
    Scatter,
    ScatterPart,
    Send,
)
from ..credits import CreditSpan
from ..head_mapping import Assignment
from ..kinds import FailureKind, StrKind, TransferPath, remote_kind
from ..lifecycle import DECODE_TRANSITIONS, RoomEvent
from ..messages import AllocGrant, AllocRequest, Piece, RoomDone, RoomMeta, WriterDone, encode_pages
from ..page_shards import pool_assignment
from ..pool_parts import PoolCopy, block_bytes, carried_pools, part_offsets, request_copies, writer_segments
from ..ring import Region, RingAllocator
from ..room_base import RoomBase
from ..room_uses import repeats_outcome
from ..tags import Tag, TagKind
from ..token_mapping import first_slots, local_pages, local_tokens
from .chunk_pieces import PiecesRefused, chunk_pieces
from .credits import Claim
from .plan import PlanRefused, RoomPlan, WriterOffer, plan_room
from .tracker import ExpectedPiece, Outcome, RoomTracker

__all__ = ["DecodeRoom", "PageSpan", "PlanRefused", "RingSpan", "RoomPlan", "TagResult", "TagVerdict", "WriterOffer",
           "WriterPart", "plan_room"]


@dataclass(frozen=True, kw_only=True)
class WriterPart:
    """One writer's part of a staged piece's ring region: its KV bytes, then (the last piece)
    its pool copies."""

    rank: int
    ring_offset: int
    kv_bytes: int
    copies: tuple[PoolCopy, ...]

    @property
    def nbytes(self) -> int:
        return self.kv_bytes + block_bytes(self.copies)


@dataclass(frozen=True)
class RingSpan:
    """Staged: a writer's part landed in the ring at `offset`."""

    offset: int
    nbytes: int


@dataclass(frozen=True, kw_only=True)
class PageSpan:
    """Direct: a write landed in these destination pages, layers and heads (and pool items)."""

    pages: np.ndarray
    layers: range
    heads: tuple[int, int]
    copies: tuple[PoolCopy, ...]
    nbytes: int
    page_tokens: int | None = None   # tokens an entry of `pages` holds: None, the page size; 1 when `pages` are
                                     # pool slots (decode context parallel: this rank's tokens, in order)


class TagVerdict(StrKind):
    """What one arrived tag did to its room (the engine counts all but OK and PARTIAL as dropped)."""

    OK = "ok"                    # a write landed and counts
    PARTIAL = "partial"          # one backend write of a direct write split by memory kind: its
                                 # bytes count once all landed
    DUPLICATE = "duplicate"
    STALE = "stale"              # meant for another life of this room or peer: dropped
    REJECTED = "rejected"        # disagrees with the room's plan: the room fails


@dataclass(frozen=True)
class TagResult:
    verdict: TagVerdict
    actions: list[DecodeAction]


@dataclass(kw_only=True, slots=True)
class WriterState:
    peer: PeerKey
    assignment: Assignment
    landed_writes: int = 0                        # distinct (chunk, piece) writes landed (the room's `landed`)
    done_at: float | None = None                  # WriterDone received
    done_writes: int = 0
    stopped: bool = False                         # quiesced or lost: it will not write again...
    quiet_after: float = 0.0                      # ... after this time (a lost writer's last write may stall)


def landed_key(rank: int, chunk: int, piece: int) -> int:
    """One int for a writer's (chunk, piece): the room's `landed` map's key (a tuple costs more).
    The rank in the low bits: chunk 0's piece 0 (a whole request in one piece) is the rank
    itself, a small int CPython caches (no bytes of its own); the rest fit 28 or 32 bytes."""
    assert 0 <= chunk < 1 << 24 and 0 <= piece < 1 << 24 and 0 <= rank < 1 << 16, (rank, chunk, piece)
    return (chunk << 24 | piece) << 16 | rank


@dataclass(kw_only=True, slots=True)
class Allocation:
    """A chunk's ring space: its pages and layers, and its pieces' regions until freed. The
    pieces themselves (their pages, ring start and bytes, for a repeated grant) are the
    tracker's (DecodeRoom._grant), not kept twice."""

    chunk: int
    page_start: int
    num_pages: int
    layers: range
    regions: dict[int, Region]                    # piece index -> region, until freed


@dataclass(frozen=True, kw_only=True)
class CreditPiece:
    """A single-writer piece its writer wrote into one of its ring credits: where, and whose."""

    peer: PeerKey
    span: CreditSpan
    region: Region
    layers: range


def _layers(tag: Tag) -> range:
    return range(tag.layer_start, tag.layer_start + tag.num_layers)


class DecodeRoom(RoomBase[DecodeAction]):
    TRANSITIONS = DECODE_TRANSITIONS
    PEER_SIDE = "prefill"

    def __init__(self, *, room: int, session: int, me: int, layout: KVLayout, now: float, timeouts: Timeouts,
                 pools: tuple[PoolSpec, ...] = ()):
        super().__init__(room=room, me=me, layout=layout, now=now, timeouts=timeouts, pools=pools)
        self.session = session
        self.plan: RoomPlan | None = None
        self.dst_pages: np.ndarray | None = None
        self.inited_at: float | None = None
        self.meta_sent = False
        self.writers: dict[int, WriterState] = {}
        self.tracker: RoomTracker | None = None
        self.allocs: dict[int, Allocation] = {}
        self.credit_pieces: dict[tuple[int, int], CreditPiece] = {}   # (chunk, piece) -> until scattered
        self.scattering: dict[tuple[int, int], float] = {}   # piece key -> when asked
        # every writer's distinct (chunk, piece) writes landed -> its tag's digest (0 without verify):
        # one map for the room, keyed by landed_key, rather than one per writer (docs/scale.md)
        self.landed: dict[int, int] = {}
        self.acked = 0                                       # prefill ranks that acknowledged the metadata (bit r: rank r)
        self._retry_at = 0.0
        self.prefix = 0                                      # pages of the request held already
        self.bytes_in = 0                                    # bytes of accepted tags (writes that landed)
        self.writes_in = 0
        self.pool_items: dict[str, np.ndarray] = {}          # this request's items of the state pools
        self.pool_copies: dict[int, tuple[PoolCopy, ...]] = {}  # writer rank -> its pool copies (last page)
        self.num_tokens: int | None = None                   # the request's tokens (decode context parallel)

    # What on_plan and init give, for the inputs that only come after them.
    @property
    def _plan(self) -> RoomPlan:
        assert self.plan is not None, "the room is not planned yet"
        return self.plan

    @property
    def _tracker(self) -> RoomTracker:
        assert self.tracker is not None, "the room has no destination pages yet"
        return self.tracker

    @property
    def _dst(self) -> np.ndarray:
        assert self.dst_pages is not None, "the room has no destination pages yet"
        return self.dst_pages

    # -- set-up -----------------------------------------------------------------------------
    def on_plan(self, plan: RoomPlan, now: float) -> list[DecodeAction]:
        if self.ended or self.plan is not None:
            return []
        self.plan = plan
        self.writers = {p.tp_rank: WriterState(peer=p, assignment=a) for p, a in plan.writers}
        out = self._move(RoomEvent.PLANNED, now)
        return out + self._start(now)

    def on_plan_failed(self, kind: str, reason: str, now: float) -> list[DecodeAction]:
        return self.fail(kind, reason, now)

    def init(self, dst_pages: np.ndarray, now: float, prefix_pages: int = 0,
             pool_items: dict[str, np.ndarray] | None = None, num_tokens: int | None = None) -> list[DecodeAction]:
        """Destination pages (validated by the caller's handle) for the request's pages past the
        `prefix_pages` this rank already holds (its prefix cache): those are never written.
        With decode context parallel (KVLayout.dcp_size > 1) the pages are this rank's local
        pages (its share of the request's virtual pages, token_mapping.py) and `num_tokens`, the
        request's token count, is needed: this rank expects exactly its tokens."""
        if self.dst_pages is not None:
            raise ValueError(f"room {self.room}: init() called twice")
        self.num_tokens = num_tokens
        self.dst_pages = dst_pages
        self.prefix = prefix_pages
        self.pool_items = pool_items or {}
        self.inited_at = now
        if self.ended:
            return []
        return self._start(now)

    def _start(self, now: float) -> list[DecodeAction]:
        if self.plan is None or self.dst_pages is None or self.meta_sent:
            return []
        n = int(self._dst.size)
        p = self.plan = self.plan.for_pages(self._dst, self.layout.page_size, self.layout.num_kv)  # the path, per request
        entries = p.num_layers or self.layout.num_entries   # the prefill's: a decode's extra draft entries stay unwritten
        held = range(entries)
        if self.layout.pp_size > 1:   # a decode PP stage's own layers, its draft entries as far as the prefill writes
            held = range(self.layout.layers.start, max(w.stop for w in p.writer_layers.values()))
        end = held.stop
        if p.draft_pools:   # the prefill's draft entries of their own geometry: pools of the pages' token slots
            self.pool_items = {**self.pool_items, **request_draft_items(
                [draft_pool_name(i) for i in range(p.draft_pools)], self._dst, self.layout.page_size)}
        # the pools move with the last layer each writer writes here (pool_parts.carried_pools):
        # the pools of its layers, and with this rank's last entry (a PP prefill's last stage; to
        # a decode PP stage, the prefill stage holding that stage's last layer) the pools of none
        self.pool_copies = {}
        for r in self.writers if self.pool_items else ():
            mine = p.writer_layers.get(r, range(entries))
            mine = range(max(mine.start, held.start), min(mine.stop, held.stop))
            copies = request_copies(writer_segments(carried_pools(self.pools, mine, mine.stop == end), p.prefill_tp,
                                                    p.decode_tp, pool_assignment(self.writers[r].assignment,
                                                                                 p.page_shards)), None, self.pool_items)
            if copies:
                self.pool_copies[r] = copies
        token_bytes = None
        if self.layout.dcp_size > 1:
            dcp = self._dcp_bytes(p, n)
            if isinstance(dcp, str):
                return self.fail(FailureKind.LAYOUT, dcp, now)
            token_bytes = dcp
        # the plan's writers' bytes and ranks: one map and tuple for every room of the plan
        self.tracker = RoomTracker(n, p.writer_bytes, {r: block_bytes(c) for r, c in self.pool_copies.items()},
                                   num_layers=entries, writer_layers=p.writer_layers,
                                   held=held if self.layout.pp_size > 1 else None,
                                   writers=p.writer_ranks, token_bytes=token_bytes, shared=p.page_shards > 1)
        self.meta_sent = True
        self._retry_at = now + self.timeouts.heartbeat
        out = self._metas(self._all_prefill()) + self._move(RoomEvent.METADATA_OUT, now)
        if p.staged:   # its pieces will be scattered into these pages: they may be made ready now
            out.append(PrepareScatter(self.room, self._dst))
        return out + (self._check_complete(now) if token_bytes is not None else [])

    def _dcp_bytes(self, p: RoomPlan, n: int) -> dict[int, int] | str:
        """Decode context parallel: each writer's exact bytes (this rank's tokens of the
        request past the prefix, token_mapping.local_tokens), or why the room cannot move."""
        lay, dcp = self.layout, self.layout.dcp()
        where = f"decode DCP rank {lay.dcp_rank} of {lay.dcp_size} (page_size {lay.page_size}, MLA)"
        if self.num_tokens is None:
            return f"{where}: a decode context parallel room needs the request's token count (init(num_tokens=...))"
        want = local_pages(dcp, self.num_tokens)
        if self.prefix + n != want:
            return (f"{where}: {self.num_tokens} tokens take {want} pages on every DCP rank, this rank was given "
                    f"{self.prefix} prefix pages and {n} more")
        if p.staged or p.draft_pools:
            return f"{where}: decode context parallel moves the KV and the pool items direct (no staging or draft)"
        tokens = local_tokens(dcp, lay.dcp_rank, self.num_tokens, self.prefix * lay.page_size * lay.dcp_size)
        return {w: tokens * b // lay.page_size for w, b in p.writer_bytes.items()}

    def _all_prefill(self) -> list[PeerKey]:
        return [p for p, _ in self._plan.writers] + list(self._plan.notices)

    def _metas(self, peers: list[PeerKey]) -> list[DecodeAction]:
        n = int(self._dst.size)
        writers = {p for p, _ in self._plan.writers}
        pages = b"" if self._plan.staged else encode_pages(self._dst)
        return [Send(p, RoomMeta(src=self.me, dst=p.incarnation, room=self.room, session=self.session,
                                 num_pages=self.prefix + n, staged=self._plan.staged and p in writers,
                                 dst_pages=pages if p in writers else b"", prefix_pages=self.prefix,
                                 pool_items={k: encode_pages(v) for k, v in self.pool_items.items()}))
                for p in peers]

    def on_meta_ack(self, peer: PeerKey, session: int) -> None:
        if session == self.session and self.plan is not None and peer in self._all_prefill():
            self.acked |= 1 << peer.tp_rank

    # -- staged: allocation -----------------------------------------------------------------
    def on_alloc_request(self, peer: PeerKey, req: AllocRequest, ring: RingAllocator, now: float) -> list[DecodeAction]:
        w = self._writer(peer)
        if w is None or req.session != self.session:
            return []
        self.acked |= 1 << peer.tp_rank
        if self.ended:
            return self._outcome(peer)
        if not self._plan.staged:
            return self.fail(FailureKind.PROTOCOL, f"{peer} asked for ring space in a direct-path room", now)
        layers = range(req.layer_start, req.layer_start + req.num_layers)
        if self.tracker is not None and layers == self.tracker.all_layers:
            layers = self.tracker.all_layers   # one range for the room's every-layer chunks and pieces
        alloc = self.allocs.get(req.chunk)
        if alloc is not None:
            if (alloc.page_start, alloc.num_pages, alloc.layers) != (req.page_start, req.num_pages, layers):
                return self.fail(FailureKind.PROTOCOL, f"writers disagree on chunk {req.chunk}: pages "
                                             f"[{alloc.page_start}, +{alloc.num_pages}) of layers {alloc.layers} vs "
                                             f"[{req.page_start}, +{req.num_pages}) of layers {layers} from {peer}",
                                 now)
            return [self._grant(peer, alloc)]
        t = self._tracker
        if any(c == req.chunk for c, _ in self.credit_pieces) or any(p.chunk == req.chunk for p in t.pieces()):
            return self.fail(FailureKind.PROTOCOL, f"{peer} asked for ring space for chunk {req.chunk}, which it "
                                                   "wrote into its ring credits", now)
        if req.num_pages <= 0 or req.page_start < 0 or req.page_start + req.num_pages > t.num_pages \
                or not t.layers_ok(layers) or t.overlaps_plan(req.page_start, req.num_pages, layers) \
                or peer.tp_rank not in t.writers_of(layers):
            return self.fail(FailureKind.PROTOCOL, f"chunk {req.chunk} from {peer} covers pages [{req.page_start}, "
                                         f"+{req.num_pages}) of layers [{layers.start}, {layers.stop}) that are "
                                         f"outside the room or its PP stage, or already planned", now)
        planned = chunk_pieces(t, self._plan, ring, page_start=req.page_start, num_pages=req.num_pages, layers=layers)
        if isinstance(planned, PiecesRefused):
            return self.fail(FailureKind.STAGING, planned.reason, now)
        writers = t.writers_of(layers)
        regions = {i: p.region for i, p in enumerate(planned)}
        for i, p in enumerate(planned):
            t.expect_piece(req.chunk, i, p.page_start, p.num_pages, p.region.start, writers, layers,
                           region_nbytes=p.region.nbytes)
        alloc = Allocation(chunk=req.chunk, page_start=req.page_start, num_pages=req.num_pages, layers=layers,
                           regions=regions)
        self.allocs[req.chunk] = alloc
        return [self._grant(peer, alloc)]

    def _grant(self, peer: PeerKey, alloc: Allocation) -> Send:
        """The chunk's grant, the same every time it is asked for: its pieces in index order."""
        pieces = [Piece(p.index, p.page_start, p.num_pages, p.ring_start, p.region_nbytes)
                  for p in self._tracker.pieces() if p.chunk == alloc.chunk]
        return Send(peer, AllocGrant(src=self.me, dst=peer.incarnation, room=self.room, session=self.session,
                                     chunk=alloc.chunk, epoch=self._plan.ring_epoch, pieces=pieces))

    # -- arrivals ---------------------------------------------------------------------------
    def on_tag(self, peer: PeerKey, tag: Tag, now: float) -> TagResult:
        """Apply one arrived tag."""
        verdict, actions = self._on_tag(peer, tag, now)
        return TagResult(verdict, actions)

    def _on_tag(self, peer: PeerKey, tag: Tag, now: float) -> tuple[TagVerdict, list[DecodeAction]]:
        w = self._writer(peer)
        if w is None or tag.session != self.session or tag.src != peer.incarnation or self.tracker is None:
            return TagVerdict.STALE, []
        self.acked |= 1 << peer.tp_rank
        if self.ended:
            return TagVerdict.STALE, []
        if tag.writer != peer.tp_rank:
            return TagVerdict.REJECTED, self.fail(FailureKind.PROTOCOL, f"tag from {peer} claims writer {tag.writer}", now)
        if self._plan.staged:
            if tag.kind is not TagKind.STAGED or tag.epoch != self._plan.ring_epoch:
                return TagVerdict.REJECTED, self.fail(FailureKind.PROTOCOL, f"tag from {peer} is not a staged tag of ring epoch "
                                                         f"{self._plan.ring_epoch}: {tag}", now)
            arrival = self._tracker.arrive_staged(tag.writer, tag.chunk, tag.piece, tag.page_start, tag.num_pages,
                                                 tag.nbytes, tag.ring_start, _layers(tag))
        else:
            if tag.kind is not TagKind.DIRECT or tag.epoch != self.me:
                return TagVerdict.REJECTED, self.fail(FailureKind.PROTOCOL, f"tag from {peer} is not a direct tag for this rank: "
                                                         f"{tag}", now)
            arrival = self._tracker.arrive_direct(tag.writer, tag.chunk, tag.page_start, tag.num_pages, tag.nbytes,
                                                 tag.group, tag.groups, _layers(tag), tag.pages_mask)
        if arrival.outcome is Outcome.DUPLICATE:
            return TagVerdict.DUPLICATE, []
        if arrival.outcome is Outcome.PARTIAL:
            self.writes_in += 1
            return TagVerdict.PARTIAL, []
        if arrival.outcome is Outcome.REJECTED:
            return TagVerdict.REJECTED, self.fail(FailureKind.TAG_MISMATCH, f"tag from {peer} rejected: {arrival.reason}", now)
        self._land(w, tag)
        self.bytes_in += tag.nbytes
        self.writes_in += 1
        if arrival.outcome is Outcome.PIECE_LANDED:
            assert arrival.piece is not None
            return TagVerdict.OK, [self._scatter(arrival.piece, now)]
        return TagVerdict.OK, self._check_complete(now)

    def on_credit_tag(self, peer: PeerKey, tag: Tag, claim: Claim, ring_size: int, now: float) -> TagResult:
        """Apply a CREDIT tag whose place the ring's CreditLedger judged (`claim`, for this
        peer, the tag's ring_start and nbytes). An OK claim the room does not keep is handed back
        at once (ReleaseCredit); one it keeps is handed back after its scatter."""
        verdict, actions, kept = self._on_credit_tag(peer, tag, claim, ring_size, now)
        if claim.verdict is credit_rules.ClaimVerdict.OK and not kept:
            assert claim.span is not None
            actions = [ReleaseCredit(peer, claim.span), *actions]
        return TagResult(verdict, actions)

    def _on_credit_tag(self, peer: PeerKey, tag: Tag, claim: Claim, ring_size: int,
                       now: float) -> tuple[TagVerdict, list[DecodeAction], bool]:
        w = self._writer(peer)
        if w is None or tag.session != self.session or tag.src != peer.incarnation or self.tracker is None:
            return TagVerdict.STALE, [], False
        self.acked |= 1 << peer.tp_rank
        if self.ended:
            return TagVerdict.STALE, [], False
        if (tag.chunk, tag.piece) in self.credit_pieces or landed_key(w.peer.tp_rank, tag.chunk, tag.piece) in self.landed:
            return TagVerdict.DUPLICATE, [], False
        if claim.verdict is credit_rules.ClaimVerdict.DUPLICATE:
            return TagVerdict.DUPLICATE, [], False
        if claim.verdict is not credit_rules.ClaimVerdict.OK:
            return TagVerdict.REJECTED, self.fail(FailureKind.PROTOCOL, f"ring credit ({claim.verdict}): "
                                                  f"{claim.reason}", now), False
        why = self._credit_piece_refused(peer, tag)
        if why is not None:
            return TagVerdict.REJECTED, self.fail(FailureKind.PROTOCOL, why, now), False
        t, layers = self._tracker, _layers(tag)
        assert claim.span is not None
        region = Region(tag.ring_start, tag.nbytes, ring_size)
        t.expect_piece(tag.chunk, tag.piece, tag.page_start, tag.num_pages, tag.ring_start, [tag.writer], layers)
        arrival = t.arrive_staged(tag.writer, tag.chunk, tag.piece, tag.page_start, tag.num_pages, tag.nbytes,
                                  tag.ring_start, layers)
        assert arrival.outcome is Outcome.PIECE_LANDED and arrival.piece is not None, arrival
        self.credit_pieces[(tag.chunk, tag.piece)] = CreditPiece(peer=peer, span=claim.span, region=region,
                                                                 layers=layers)
        self._land(w, tag)
        self.bytes_in += tag.nbytes
        self.writes_in += 1
        return TagVerdict.OK, [self._scatter(arrival.piece, now)], True

    def _credit_piece_refused(self, peer: PeerKey, tag: Tag) -> str | None:
        """Why a piece written into a credit cannot be this room's (None: it can)."""
        t, layers = self._tracker, _layers(tag)
        where = (f"credit piece (chunk {tag.chunk} piece {tag.piece}: pages [{tag.page_start}, +{tag.num_pages}) of "
                 f"layers [{layers.start}, {layers.stop}), {tag.nbytes} bytes) from {peer}")
        if not self._plan.staged or tag.epoch != self._plan.ring_epoch:
            return f"{where} is not for ring epoch {self._plan.ring_epoch} of a staged room"
        if tag.num_pages <= 0 or tag.page_start < 0 or tag.page_start + tag.num_pages > t.num_pages \
                or not t.layers_ok(layers):
            return f"{where} lies outside the room"
        if t.writers_of(layers) != [tag.writer]:
            return f"{where}: those layers have writers {t.writers_of(layers)}, a credit piece has exactly one"
        if t.overlaps_plan(tag.page_start, tag.num_pages, layers) or (tag.chunk, tag.piece) in \
                {p.key for p in t.pieces()}:
            return f"{where} covers pages another piece of the room holds"
        want = t.bytes_of(tag.writer, tag.num_pages, layers) + (
            t.final_extra.get(tag.writer, 0) if t.final(tag.page_start, tag.num_pages, layers, writer=tag.writer) else 0)
        if tag.nbytes != want:
            return f"{where} does not hold the {want} bytes its writer writes there"
        return None

    def _piece_place(self, chunk: int, index: int) -> tuple[Region, range]:
        """A piece's ring region and its layers: granted, or written into a credit."""
        credit = self.credit_pieces.get((chunk, index))
        if credit is not None:
            return credit.region, credit.layers
        alloc = self.allocs[chunk]
        return alloc.regions[index], alloc.layers

    def _parts(self, chunk: int, index: int, page_start: int, num_pages: int) -> list[WriterPart]:
        """Each writer's part of a piece's ring region, in writer order."""
        region, layers = self._piece_place(chunk, index)
        per_head = num_pages * self._plan.head_page_bytes * len(layers) // self._tracker.num_layers
        held = set(self._tracker.writers_of(layers))   # PP: the stage's writers only
        writers = sorted(((r, w) for r, w in self.writers.items() if r in held),
                         key=lambda rw: rw[1].assignment.writer_index)
        copies = [self.pool_copies.get(r, ()) if self._tracker.final(page_start, num_pages, layers, writer=r) else ()
                  for r, _ in writers]
        kv = [per_head * w.assignment.num_heads for _, w in writers]
        offsets = part_offsets([n + block_bytes(c) for n, c in zip(kv, copies)])
        return [WriterPart(rank=r, ring_offset=region.offset + off, kv_bytes=n, copies=c)
                for (r, _), off, n, c in zip(writers, offsets, kv, copies)]

    def _land(self, w: WriterState, tag: Tag) -> None:
        key = landed_key(w.peer.tp_rank, tag.chunk, tag.piece)
        if key not in self.landed:
            w.landed_writes += 1
        self.landed[key] = tag.digest

    def holds_tag(self, peer: PeerKey, tag: Tag) -> bool:
        """Whether the whole write `tag` names already landed from `peer` (its tag came before):
        another copy of it (WriterDone repeats every tag) changes nothing."""
        w = self._writer(peer)
        return w is not None and tag.session == self.session and landed_key(w.peer.tp_rank, tag.chunk, tag.piece) in self.landed

    def completes_write(self, tag: Tag) -> bool:
        """Whether the write `tag` belongs to is whole once it lands: always, but for a direct
        write split by memory kind, whose bytes are only all in place with its last group."""
        if tag.groups == 1 or self.tracker is None:
            return True
        return self._tracker.group_completes((tag.writer, tag.chunk, tag.page_start, tag.num_pages), tag.group,
                                            tag.groups)

    def landed_span(self, tag: Tag) -> RingSpan | PageSpan | None:
        """Where the write of an accepted tag landed; None when the tag is not this room's."""
        w = self.writers.get(tag.writer)
        if w is None or tag.session != self.session or self.tracker is None or self.ended:
            return None
        if self._plan.staged:
            if (tag.chunk, tag.piece) not in self.credit_pieces and (
                    tag.chunk not in self.allocs or tag.piece not in self.allocs[tag.chunk].regions):
                return None
            part = next(p for p in self._parts(tag.chunk, tag.piece, tag.page_start, tag.num_pages)
                        if p.rank == tag.writer)
            return RingSpan(part.ring_offset, part.nbytes)
        layers = _layers(tag)
        if tag.page_start < 0 or tag.num_pages <= 0 or tag.page_start + tag.num_pages > self._tracker.num_pages \
                or not self._tracker.layers_ok(layers):
            return None
        mask = self._tracker.page_mask(tag.pages_mask, tag.num_pages)
        if isinstance(mask, str):
            return None
        final = self._tracker.final(tag.page_start, tag.num_pages, layers, mask, tag.writer)
        copies = self.pool_copies.get(tag.writer, ()) if final else ()
        if self.layout.dcp_size > 1:   # every write holds all of this rank's tokens of its layers
            lay, n = self.layout, self.num_tokens or 0
            tokens = local_tokens(lay.dcp(), lay.dcp_rank, n, self.prefix * lay.page_size * lay.dcp_size)
            return PageSpan(pages=first_slots(self._dst, tokens, lay.page_size), layers=layers,
                            heads=w.assignment.dst_heads, copies=copies, nbytes=tag.nbytes, page_tokens=1)
        pages = self._dst[tag.page_start:tag.page_start + tag.num_pages]
        return PageSpan(pages=pages if mask is None else pages[mask], layers=layers,
                        heads=w.assignment.dst_heads, copies=copies, nbytes=tag.nbytes)

    def _scatter(self, piece: ExpectedPiece, now: float) -> Scatter:
        self.scattering[piece.key] = now
        parts_ = self._parts(piece.chunk, piece.index, piece.page_start, piece.num_pages)
        parts = tuple(ScatterPart(p.ring_offset, p.kv_bytes, self.writers[p.rank].assignment.dst_heads) for p in parts_)
        pools = tuple(PoolPlacement(p.ring_offset + p.kv_bytes + c.offset, c) for p in parts_ for c in p.copies)
        checks = tuple(PartCheck(ring_offset=p.ring_offset, nbytes=p.nbytes,
                                 digest=self.landed.get(landed_key(p.rank, *piece.key), 0), writer=p.rank) for p in parts_)
        dst = self._dst[piece.page_start:piece.page_start + piece.num_pages]
        return Scatter(room=self.room, key=piece.key, dst_pages=dst, parts=parts, layers=piece.layers, pools=pools,
                       checks=checks)

    def on_scattered(self, key: tuple[int, int], ok: bool, reason: str | None, ring: RingAllocator,
                     now: float, kind: str = FailureKind.SCATTER) -> list[DecodeAction]:
        if self.scattering.pop(key, None) is None:
            return []
        chunk, index = key
        out: list[DecodeAction] = []
        if ok and not self.ended:
            piece = next(p for p in self._tracker.pieces() if p.key == key)
            self._tracker.mark_scattered(piece)
        elif not ok:
            out += self.fail(kind, cast(str, reason) if kind == FailureKind.CORRUPT else
                             f"scatter of chunk {chunk} piece {index} failed: {reason}", now)
        # every writer of the piece landed and the scatter is over: nothing touches the region
        credit = self.credit_pieces.pop(key, None)
        if credit is not None:
            out.append(ReleaseCredit(credit.peer, credit.span))   # the credit holds the region
        else:
            out += self._free(ring, [self.allocs[chunk].regions.pop(index)])
        return out + self._check_complete(now) + self._maybe_release(ring, now)

    def on_writer_done(self, peer: PeerKey, msg: WriterDone, now: float) -> list[DecodeAction]:
        w = self._writer(peer)
        if w is None or msg.session != self.session:
            return []
        self.acked |= 1 << peer.tp_rank
        if self.ended:   # asked again: our answer may have been lost (room_uses.repeats_outcome)
            assert self.ended_at is not None, "an ended room knows when it ended"
            return self._outcome(peer) if repeats_outcome(ended_at=self.ended_at, now=now,
                                                          retry=self.timeouts.heartbeat) else []
        if w.done_at is None:
            w.done_at, w.done_writes = now, msg.writes
        return []

    def _outcome(self, peer: PeerKey) -> list[DecodeAction]:
        if self.state is KVPoll.Success:
            return [Send(peer, RoomDone(src=self.me, dst=peer.incarnation, room=self.room, session=self.session))]
        return [Send(peer, self._failed_msg(peer, self.session))]

    # -- failures ---------------------------------------------------------------------------
    def on_room_failed(self, peer: PeerKey, session: int, kind: str, reason: str, now: float) -> list[DecodeAction]:
        if session != self.session or (self._writer(peer) is None and peer not in (self._plan.notices if self.plan else ())):
            return []
        return self._fail_remote(peer, kind, reason, now)

    def on_quiesced(self, peer: PeerKey, session: int, ring: RingAllocator | None, now: float) -> list[DecodeAction]:
        w = self._writer(peer)
        if w is None or session != self.session:
            return []
        w.stopped = True
        out: list[DecodeAction] = []
        if not self.ended:  # it gave up on the room and its failure notice was lost
            out = self.fail(remote_kind("failed"), f"prefill rank {peer.tp_rank} ({peer.engine_id}) stopped writing this "
                                                   "room", now, origin=peer)
        return out + self._maybe_release(ring, now)

    def on_peer_lost(self, peer: PeerKey, reason: str, ring: RingAllocator | None, now: float,
                     quarantine: float = 0.0) -> list[DecodeAction]:
        """`quarantine`: how long a write the lost writer already posted may still land (its
        backend's stall bound); its memory is not reused before."""
        w = self._writer(peer)
        notice = self.plan is not None and peer in self._plan.notices
        if w is None and not notice:
            return []
        if w is not None:
            w.stopped = True  # its lease ran out or its connection closed: it posts no more writes
            w.quiet_after = max(w.quiet_after, now + quarantine)
        out = []
        if w is not None or not self.meta_sent:
            out = self.fail(FailureKind.PEER_LOST, f"prefill rank {peer.tp_rank} ({peer}) lost: {reason}", now)
        return out + self._maybe_release(ring, now)

    def abort(self, ring: RingAllocator | None, now: float) -> list[DecodeAction]:
        return self.fail(FailureKind.ABORTED, "aborted by the decode caller", now) + self._maybe_release(ring, now)

    def tick(self, ring: RingAllocator | None, now: float) -> list[DecodeAction]:
        out = self._retransmit(now)
        if self.ended:
            return out + self._maybe_release(ring, now)
        return out + self._deadlines(now)

    def _retransmit(self, now: float) -> list[DecodeAction]:
        """What a lost message would otherwise leave waiting for a deadline."""
        if not self.meta_sent or self.released or now < self._retry_at:
            return []
        self._retry_at = now + self.timeouts.heartbeat
        if self.state is KVPoll.Failed:
            return [self._outcome(w.peer)[0] for w in self.writers.values() if not w.stopped]
        if self.state is KVPoll.Transferring:
            return self._metas([p for p in self._all_prefill() if not self.acked >> p.tp_rank & 1])
        return []

    def _deadlines(self, now: float) -> list[DecodeAction]:
        t = self.timeouts
        if self.inited_at is not None and now - self.inited_at > t.room:
            return self.fail(FailureKind.TIMEOUT, f"room not complete {t.room:g} s after init", now)
        for w in self.writers.values():
            if w.done_at is not None and w.landed_writes < w.done_writes and now - w.done_at > t.arrival:
                return self.fail(FailureKind.TIMEOUT, f"prefill rank {w.peer.tp_rank} reported {w.done_writes} writes done "
                                            f"but only {w.landed_writes} notifications arrived within {t.arrival:g} s "
                                            "(lost notification)", now)
        for key, since in self.scattering.items():
            if now - since > t.scatter:
                return self.fail(FailureKind.TIMEOUT, f"scatter of chunk {key[0]} piece {key[1]} took over {t.scatter:g} s",
                                 now)
        return []

    def _told_of_failure(self) -> list[tuple[PeerKey, int]]:
        """Every prefill rank the room's plan names, once it has one: also when the room fails
        before its metadata went out (at init, or aborted before it), so a sender waiting for
        that metadata fails too instead of waiting for it (a prefill rank that has no sender for
        the room yet parks the failure, room_uses.py)."""
        return [(peer, self.session) for peer in self._all_prefill()] if self.plan is not None else []

    # -- internals --------------------------------------------------------------------------
    def totals(self) -> RoomTotals:
        """Bytes and writes that landed here (each accepted tag is one backend write)."""
        path = (TransferPath.NONE if self.plan is None or not self._plan.writers
                else TransferPath.STAGED if self._plan.staged else TransferPath.DIRECT)
        choice = self.plan.choice if self.plan is not None else None
        return RoomTotals(self.bytes_in, self.writes_in, path, predicted_s=choice.predicted_s if choice else None,
                          path_reason=str(choice.reason) if choice else "")

    def _writer(self, peer: PeerKey) -> WriterState | None:
        w = self.writers.get(peer.tp_rank)
        return w if w is not None and w.peer == peer else None

    def _check_complete(self, now: float) -> list[DecodeAction]:
        if self.ended or self.tracker is None or not self._tracker.complete:
            return []
        out: list[DecodeAction] = []
        for w in self.writers.values():
            out.append(Send(w.peer, RoomDone(src=self.me, dst=w.peer.incarnation, room=self.room,
                                             session=self.session)))
        return out + self._move(RoomEvent.SUCCEED, now)

    def _free(self, ring: RingAllocator | None, regions: list[Region]) -> list[DecodeAction]:
        moved = False
        for region in regions:
            assert ring is not None, "ring regions are only held with a ring"
            moved |= ring.free(region) is not None
        return [PublishWatermark()] if moved else []

    def _maybe_release(self, ring: RingAllocator | None, now: float) -> list[DecodeAction]:
        if self.released or not self.ended or self.scattering:
            return []
        if self.state is KVPoll.Failed and self.meta_sent and not all(w.stopped and now >= w.quiet_after
                                                                     for w in self.writers.values()):
            return []
        leftover = [r for a in self.allocs.values() for r in a.regions.values()]
        for a in self.allocs.values():
            a.regions.clear()
        out: list[DecodeAction] = [ReleaseCredit(c.peer, c.span) for c in self.credit_pieces.values()]
        self.credit_pieces.clear()
        out += self._free(ring, leftover) if leftover else []
        return out + self._release()

    def _entered(self, state: KVPoll, now: float) -> list[DecodeAction]:
        return self._maybe_release(None, now) if state is KVPoll.Success else []
