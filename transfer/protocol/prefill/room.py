"""The prefill side of one room: chunks in, writes out, success only when the decode confirms.

Pure state machine. The room learns which decode ranks it serves from the first room
metadata it receives (which names the decode TP size, hence the head mapping), writes each
chunk to each of them (direct: one write per chunk; staged: one write per granted piece),
reports its writes done, and succeeds when every decode rank it writes confirmed the room.
A rank that holds only replicas nobody needs hears from one decode rank and succeeds once
its input is complete, without writing.

On failure it tells its decode peers, stops issuing writes, and once nothing of its is in
flight any more says so (Quiesced), so the decode side can reuse the memory.

Control messages may be lost: it re-sends an AllocRequest until the grant arrives and its
WriterDone until the decode side confirms; duplicates it receives are ignored.

Ring credits (prefill/credits.py): a staged chunk towards a decode rank that gave this rank
credits, of which this rank is the only writer, is cut into pieces here and the first of them
that fit the credits are written into them at once, without asking for ring space; the rest
of the chunk (all of it when not even its first piece fits) goes the grant path, its
remainder under a chunk number of its own (credits.py: remainder_number).

Room ids are reused: a failure or metadata is bound to engine + session + use (see
docs/protocol.md and room_uses.py); one of an earlier use of the id, or of another engine or
session than the flow it would hit, is dropped.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import replace

import msgspec
import numpy as np

from ...draft_kv import is_draft_pool, request_draft_items
from ...layout import KVLayout
from ...poll import KVPoll
from ...pool_spec import PoolSpec
from ...timeouts import Timeouts
from ..actions import DecodePrefix, Dropped, PeerKey, PostWrite, PrefillAction, RoomTotals, Send, SettleCredits, WriteOp
from ..direct_ranges import direct_nbytes
from ..head_mapping import Assignment, HeadMapping, compute_assignments
from ..kinds import FailureKind, TransferPath
from ..lifecycle import PREFILL_TRANSITIONS, RoomEvent
from ..messages import AllocGrant, AllocRequest, Piece, Quiesced, RoomFailed, RoomMeta, TagsAgain, WriterDone
from ..page_shards import ShardSide, pairing_problem, pool_assignment
from ..pool_parts import block_bytes, carried_pools, counts_mismatch, final_part, request_copies, writer_segments
from ..room_base import RoomBase
from ..room_uses import NO_EARLIER_USES, Bound, EarlierUses, RoomUse, failure_use, meta_use
from ..stage_mapping import DecodeStage, decode_coverage, flow_layers, uncovered
from ..tags import TagKind, make_tag
from ..token_mapping import DCPLayout, PairTokens, Relayout, build_pair, engine_refusal, local_pages, worth_relayout
from .chunk_writes import DEFAULT_LIMITS, ChunkWrites, WriteLimits, direct_writes, granted_writes
from .credits import CreditPurses, chunk_number, cut_pieces, remainder_number
from .flow_timers import due_again, overdue
from .flows import (
    CONFIRMED_STATES,
    NO_ENTRIES,
    UNCHECKED_STATES,
    Chunk,
    Flow,
    FlowEvent,
    FlowState,
    own_dict,
    past_prefix,
)
from .layer_sends import PER_CHUNK, LayerGrouper, LayerGrouping, SendLedger, Unit, check_late_items, check_page_count
from .write_batching import UnitBatcher, plan_units


class PrefillRoom(RoomBase[PrefillAction]):
    """Memory (a rank holds one per request in flight): besides the class attributes
    (room_base.py), the maps most rooms leave empty (parked failures, pool items, each flow's
    per-chunk maps, flows.py) are the shared read-only NO_ENTRIES until written, the decode
    ranks expected a tuple, and a room id's first use shares NO_EARLIER_USES."""

    TRANSITIONS = PREFILL_TRANSITIONS
    PEER_SIDE = "decode"
    failed_by: tuple[int, int] | None = None   # (incarnation, session) that failed us; an instance attribute once set
    # decode PP (stage_mapping.py), instance attributes once set (a room stays under 30 of them,
    # room_base.py): decode engine rank -> its stage, and whether those cover this rank's layers
    decode_stages: dict[int, DecodeStage] | None = None
    covered: bool = True
    # failures parked before this sender existed, (decode rank, session) -> (kind, reason): the
    # shared empty map until one is parked, then a dict of the instance's own (flows.own_dict)
    early: Mapping[tuple[PeerKey, int], tuple[str, str]] = NO_ENTRIES

    def __init__(self, *, room: int, num_pages: int | None, layout: KVLayout, me: int, now: float,
                 timeouts: Timeouts, op_ids: itertools.count[int] | None = None, limits: WriteLimits = DEFAULT_LIMITS,
                 stale: EarlierUses | None = None, pools: tuple[PoolSpec, ...] = (),
                 pool_items: dict[str, np.ndarray] | None = None, grouping: LayerGrouping = PER_CHUNK,
                 credits: CreditPurses | None = None, num_tokens: int | None = None):
        """`num_pages` None: the page count comes later, with init() (serving engines create the
        sender when the request arrives, before they know it). `pools`: the state pools' specs;
        `pool_items`: this request's items of them (validated by the caller's handle).
        `credits`: the ring credits decode peers gave this rank (None: every staged chunk asks).
        `num_tokens`: the request's token count (needed when either side has decode context
        parallel; may come with init() instead). `limits`: what one write may hold (the rank's,
        shared by its rooms)."""
        if num_pages is not None and num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        super().__init__(room=room, me=me, layout=layout, now=now, timeouts=timeouts, pools=pools)
        self.num_pages = num_pages
        self._op_ids = op_ids or itertools.count(1)
        self.limits = limits
        self.grouping = grouping
        self.ledger = SendLedger(room=room, stage=layout.layers)   # what the caller sent, per layer
        self.grouper: LayerGrouper | None = None                    # sends -> write units, from the first send
        self.batcher: UnitBatcher | None = None                     # units -> chunks, batching (write_batching.py)
        if num_pages is not None:
            self.ledger.set_page_count(num_pages)
        self.chunks: list[Chunk] = []       # as given: request page numbers
        self.prefix: int | None = None      # pages the decode side already holds (from its metadata)
        self.sendable: list[Chunk] = []     # the chunks' pages past the prefix, numbered from the prefix
        self._synced = 0                    # chunks already turned into sendable ones
        self.last = False
        self.mapping: HeadMapping | None = None
        self.decode_engine: str | None = None
        self.expected: tuple[int, ...] = ()   # decode engine ranks this rank hears from (sorted), once known
        self.flows: dict[int, Flow] = {}
        self.ops: dict[int, WriteOp] = {}
        self.stale = stale if stale is not None else NO_EARLIER_USES   # sessions of earlier uses of this id
        self.pool_items: Mapping[str, np.ndarray] = pool_items or NO_ENTRIES   # no pools: the shared empty map
        self.credits = credits
        self.num_tokens = num_tokens
        self.dcp: DCPLayout | None = None   # the decode engine's DCP group, when either side has DCP > 1

    # -- inputs -----------------------------------------------------------------------------
    def init(self, num_pages: int, now: float, pool_items: dict[str, np.ndarray] | None = None,
             num_tokens: int | None = None) -> list[PrefillAction]:
        """The page count (and the token count, decode context parallel), for a sender created
        without one. Raises ValueError on bad input, unchanged. Metadata that came first is
        checked against it now."""
        self.num_pages = check_page_count(self.room, self.num_pages, num_pages)
        if num_tokens is not None:
            self.num_tokens = num_tokens
        self.ledger.set_page_count(num_pages)
        self.pool_items = pool_items or NO_ENTRIES
        if self.ended:
            return []
        for flow in list(self.flows.values()):
            if flow.state in UNCHECKED_STATES:
                assert flow.meta is not None, "a flow waiting for its check holds its metadata"
                out = self._check_meta(flow, flow.meta, now)
                if out:
                    return out
        return self._pump(now)

    @property
    def pages_given(self) -> int:
        """Positions every layer was sent."""
        return self.ledger.sent_everywhere

    def add_chunk(self, pages: np.ndarray, last: bool | None, now: float, layers: range | None = None,
                  ready: tuple[object, ...] = (), pool_items: dict[str, np.ndarray] | None = None) -> list[PrefillAction]:
        """The next pages of the request for `layers` (None: every layer of this rank), in
        order; `last` None: the request's input is complete when every (page, layer) was sent.
        `pool_items`: items of pools init() did not name, with the last send only. Raises
        ValueError on bad input, unchanged (layer_sends.py, check_late_items)."""
        step = self.ledger.check(pages, layers, last)
        check_late_items(self.room, self.pool_items, pool_items, step.last)
        self.ledger.record(step, pages)
        self.last = step.last
        if pool_items:
            self.pool_items = {**self.pool_items, **pool_items}
        self._add_draft_items()
        if self.grouper is None:   # at the first send, once the path is known (write_batching.py)
            assert self.num_pages is not None, "the ledger refuses a send before the page count"
            self.grouper, self.batcher = plan_units(
                self.grouping, room=self.room, stage=self.layout.layers, num_tokens=self.num_pages * self.layout.page_size,
                direct_only=self._all_metas() and not any(f.staged for f in self.flows.values()
                                                          if f.assignment is not None), unit_ids=self._op_ids)
        units = self.grouper.add(step, pages, ready)
        if self.ended:
            return []  # input still accounted for, nothing more is written
        waits: list[PrefillAction] = []
        for u in units:
            if self.batcher is None:
                self._add_unit(u)
            elif (wait := self.batcher.add(u, now)) is not None:
                waits.append(wait)
        if self.last:   # every pool's items are known now: the counts each decode rank expects must match
            for flow in list(self.flows.values()):
                if flow.pool_dst is not None and flow.assignment is not None and self._gets_pools(flow):
                    mismatch = self._counts_mismatch(flow, {k: v.size for k, v in flow.pool_dst.items()})
                    if mismatch:
                        return self.fail(FailureKind.POOL, f"decode rank {flow.peer.tp_rank}: {mismatch}", now)
        out = self._move(RoomEvent.INPUT, now) if self._all_metas() else []
        return waits + out + self._pump(now)

    def _add_unit(self, u: Unit) -> None:
        self.chunks.append(Chunk(index=len(self.chunks), page_start=u.page_start, pages=u.pages, layers=u.layers,
                                 ready=u.ready))

    def on_unit_ready(self, seq: int, error: str | None, now: float) -> list[PrefillAction]:
        """The shell waited for a held unit's readiness objects (AwaitUnit); `error`: why that
        failed."""
        if self.ended or self.batcher is None or not self.batcher.unit_ready(seq):
            return []
        if error is not None:
            return self.fail(FailureKind.WRITE, error, now)   # the waiter's text: what synchronize() raised
        return self._pump(now)

    def meta_use(self, peer: PeerKey, session: int) -> RoomUse:
        """Which use of the room id metadata from `peer` with `session` belongs to (room_uses.py)."""
        return meta_use(self.stale, self._bound(peer), self.failed_by, peer, session)

    def _bound(self, peer: PeerKey) -> Bound | None:
        flow = self.flows.get(peer.tp_rank)
        return None if flow is None else Bound(flow.peer, flow.session)

    def add_meta(self, peer: PeerKey, decode_tp: int, meta: RoomMeta, now: float,
                 stage: DecodeStage | None = None, dcp: DCPLayout | None = None) -> list[PrefillAction]:
        """Metadata from decode rank `peer` (its engine rank in `peer.tp_rank`) of TP size
        `decode_tp` (one stage's); `stage`: its PP stage (None: no PP there, every layer); `dcp`:
        its DCP group (None: no DCP there). A DCP pairing the engine cannot move
        (token_mapping.engine_refusal) fails the room here and at the decode rank, with the reason."""
        if self.ended:
            if self.state is KVPoll.Failed:
                # never wrote to a peer it had not heard from: it may reuse its memory at once
                return [Send(peer, self._failed_msg(peer, meta.session)),
                        Send(peer, Quiesced(src=self.me, dst=peer.incarnation, room=self.room, session=meta.session))]
            return []
        if self.layout.dcp_size > 1 or (dcp is not None and dcp.dcp_size > 1):   # DCP 1 both sides: nothing to judge
            theirs = dcp or DCPLayout(dcp_size=1, page_size=self.layout.page_size, mla=self.layout.mla)
            refusal = engine_refusal(self.layout.dcp(), theirs)
            if refusal is not None:
                return self._refuse(peer, meta, refusal, now)
            self.dcp = theirs
        if self.layout.page_shards > 1:   # sharded pages: only the pairings page_shards.py serves
            lay = self.layout
            refusal = pairing_problem(
                ShardSide(tp_size=lay.tp_size, mla=lay.mla, page_shards=lay.page_shards),
                ShardSide(tp_size=decode_tp, mla=lay.mla, pp_size=stage.pp_size if stage else 1,
                          dcp_size=dcp.dcp_size if dcp else 1))
            if refusal is not None:
                return self._refuse(peer, meta, refusal, now)
        if self.decode_engine is not None and peer.engine_id != self.decode_engine:
            return [Send(peer, RoomFailed(src=self.me, dst=peer.incarnation, room=self.room, session=meta.session,
                                          kind=FailureKind.PROTOCOL, reason=f"room {self.room} is already bound to "
                                                                  f"decode engine {self.decode_engine}"))]
        if self.mapping is None:
            self.mapping = compute_assignments(self.layout.tp_size, decode_tp, self.layout.total_kv_heads,
                                               self.layout.mla, self.layout.page_shards)
            self.decode_engine = peer.engine_id
            self.expected = tuple(sorted(set(self._mapping.decode_peers_of(self.layout.tp_rank))))
        if self.decode_stages if stage is None else (self.flows and not self.decode_stages):
            return self._unpairable(peer, meta, f"decode rank {peer.tp_rank} has {stage.text() if stage else 'no PP'} "
                                              f"and others of its engine {'have no PP' if stage else 'have PP'}", now)
        if stage is not None and peer.tp_rank not in self.flows:
            cov = decode_coverage(self.layout.layers, self._mapping.decode_peers_of(self.layout.tp_rank), decode_tp,
                                  {**(self.decode_stages or {}), peer.tp_rank: stage}, self.layout.num_entries)
            if cov.error:
                return self._unpairable(peer, meta, cov.error, now)
            self.decode_stages = {**(self.decode_stages or {}), peer.tp_rank: stage}
            self.expected, self.covered = tuple(sorted(cov.expected)), cov.complete
        if peer.tp_rank not in self.expected:
            return [Send(peer, RoomFailed(src=self.me, dst=peer.incarnation, room=self.room, session=meta.session,
                                          kind=FailureKind.PROTOCOL, reason=f"prefill rank {self.layout.tp_rank} does not "
                                                                  f"serve decode rank {peer.tp_rank}"))]
        old = self.flows.get(peer.tp_rank)
        if old is not None:
            if old.peer == peer and old.session == meta.session:
                return []  # duplicate
            return self.fail(FailureKind.PROTOCOL, f"decode rank {peer.tp_rank} sent metadata for room {self.room} twice "
                                         f"({old.peer} then {peer})", now)
        flow = Flow(peer=peer, session=meta.session, staged=meta.staged, stage_stop=stage.layers.stop if stage else 0,
                    layers=None if stage is None else flow_layers(self.layout.layers, stage),
                    assignment=self._mapping.find(self.layout.tp_rank, peer.tp_rank % self._mapping.decode_tp))
        self.flows[peer.tp_rank] = flow
        prefix_news: list[PrefillAction] = []
        # decode context parallel: the decode rank's prefix is in its local pages, each page_size
        # x its DCP size tokens; this rank's are page_size x its own DCP size tokens
        prefix = meta.prefix_pages if self.dcp is None else meta.prefix_pages * self.dcp.dcp_size // self.layout.dcp_size
        if self.prefix is None:
            self.prefix = prefix
            prefix_news = [DecodePrefix(self.prefix)]
            self._add_draft_items()
        elif prefix != self.prefix:  # every decode rank is told (this one has its flow now)
            return self.fail(FailureKind.PROTOCOL, f"decode ranks of room {self.room} disagree on the prefix they hold: "
                                         f"{self.prefix} pages, then {prefix} from decode rank "
                                         f"{peer.tp_rank}", now)
        early = self._take_parked(peer, meta.session)
        if early is not None:  # its decode room failed before this metadata reached us
            return self.on_room_failed(peer, meta.session, *early, now)
        if self.num_pages is None:
            flow.meta = meta  # checked at init()
        else:
            bad = self._check_meta(flow, meta, now)
            if bad:
                return prefix_news + bad
        out: list[PrefillAction] = prefix_news
        if self._all_metas():
            out += self._move(RoomEvent.INPUT if self.chunks or self.last else RoomEvent.METADATA_IN, now)
        return out + self._pump(now)

    def _take_parked(self, peer: PeerKey, session: int) -> tuple[str, str] | None:
        """The failure parked for `peer`'s `session` (kind, reason), no longer parked; None when
        there is none, and then any parked for that decode rank's other sessions (an earlier use
        of the id's) are dropped."""
        if not self.early:
            return None
        parked = own_dict(self.early)
        self.early = parked
        found = parked.pop((peer, session), None)
        if found is None:
            for key in [k for k in parked if k[0] == peer]:
                del parked[key]
        return found

    def _unpairable(self, peer: PeerKey, meta: RoomMeta, why: str, now: float) -> list[PrefillAction]:
        """Decode stages this rank cannot pair with: the room fails here, at the decode ranks it
        heard from and at this one, with both layouts."""
        reason = (f"prefill {self._layout_text()} cannot pair with the decode engine's stages: {why} "
                  f"(decode stages heard from: "
                  f"{', '.join(st.text() for st in (self.decode_stages or {}).values()) or 'none before it'})")
        return self._refuse(peer, meta, reason, now)

    def _refuse(self, peer: PeerKey, meta: RoomMeta, reason: str, now: float) -> list[PrefillAction]:
        """A decode rank this rank cannot pair with: the room fails here, at the decode ranks it
        heard from and at this one, with `reason` (a LAYOUT failure)."""
        # never written to (its flow was not made): it may reuse its memory at once
        told = [Send(peer, RoomFailed(src=self.me, dst=peer.incarnation, room=self.room, session=meta.session,
                                      kind=FailureKind.LAYOUT, reason=reason)),
                Send(peer, Quiesced(src=self.me, dst=peer.incarnation, room=self.room, session=meta.session))]
        return self.fail(FailureKind.LAYOUT, reason, now) + told

    def _layout_text(self) -> str:
        lay = self.layout
        return (f"PP stage {lay.pp_rank} of {lay.pp_size} [{lay.layers.start}, {lay.layers.stop})" if lay.pp_size > 1
                else f"rank {lay.rank} (no PP, {lay.num_layers} layers)")

    def _written(self, flow: Flow) -> range:
        """The entries this rank writes to that decode rank: its stage's overlap with the decode
        rank's stage (decode PP), else its own stage's (every entry without PP)."""
        return flow.layers if flow.layers is not None else self.layout.layers

    def _flow_pools(self, flow: Flow) -> tuple[PoolSpec, ...]:
        """The pools this rank's writes to that decode rank carry (pool_parts.carried_pools): the
        pools of the layers it writes there, and the pools of no layer where it writes that
        decode rank's last entry (the model's; a decode PP stage's own last layer)."""
        written = self._written(flow)
        return carried_pools(self.pools, written, written.stop == (flow.stage_stop or self.layout.num_entries))

    def _gets_pools(self, flow: Flow) -> bool:
        return bool(self._flow_pools(flow))

    def _counts_mismatch(self, flow: Flow, theirs: Mapping[str, int]) -> str:
        """This request's pool items against the decode rank's, over the pools this flow carries."""
        names = {p.name for p in self._flow_pools(flow)}
        return counts_mismatch({k: v for k, v in self.pool_items.items() if k in names},
                               {k: n for k, n in theirs.items() if k in names})

    def _check_meta(self, flow: Flow, meta: RoomMeta, now: float) -> list[PrefillAction]:
        """The decode rank's page count (and direct destination pages) against ours: [] when
        they agree (the flow moves CHECKED), else the room fails."""
        flow.meta = None
        rank = flow.peer.tp_rank
        if self.dcp is not None:
            return self._check_dcp_meta(flow, meta, now)
        if meta.num_pages != self.num_pages:
            return self.fail(FailureKind.PROTOCOL, f"decode rank {rank} expects {meta.num_pages} pages, this "
                                         f"prefill rank was given {self.num_pages}", now)
        failed = self._take_pool_dst(flow, meta, now)
        if failed is not None:
            return failed
        if not 0 <= meta.prefix_pages < self.num_pages:
            return self.fail(FailureKind.PROTOCOL, f"decode rank {rank} holds a prefix of {meta.prefix_pages} pages of a "
                                         f"{self.num_pages}-page request: at least one page must be sent", now)
        if flow.assignment is not None and not meta.staged:
            pages = meta.pages()
            if pages.size != self.num_pages - meta.prefix_pages:
                return self.fail(FailureKind.PROTOCOL, f"decode rank {rank} sent {pages.size} destination pages "
                                             f"for {self.num_pages} pages past a prefix of {meta.prefix_pages}", now)
            flow.dst_pages = pages
        flow.move(FlowEvent.CHECKED)
        return []

    def _take_pool_dst(self, flow: Flow, meta: RoomMeta, now: float) -> list[PrefillAction] | None:
        """The decode rank's pool items against this request's (pools whose items come with the
        last send are checked then): None when they agree (its items kept on the flow), else the
        room fails."""
        theirs = {k: v.size for k, v in meta.items().items()}
        if not self.last:
            theirs = {k: n for k, n in theirs.items() if k in self.pool_items}
        mismatch = self._counts_mismatch(flow, theirs)
        if mismatch and flow.assignment is not None and self._gets_pools(flow):
            return self.fail(FailureKind.POOL, f"decode rank {flow.peer.tp_rank}: {mismatch}", now)
        flow.pool_dst = meta.items() or NO_ENTRIES   # no pools: the shared empty map
        return None

    def _check_dcp_meta(self, flow: Flow, meta: RoomMeta, now: float) -> list[PrefillAction]:
        """Decode context parallel (token_mapping.py): the decode rank's local pages against the
        request's token count, which both sides must have."""
        assert self.dcp is not None and self.num_pages is not None
        mine, theirs = self.layout.dcp(), self.dcp
        both = f"{mine.describe('prefill')} -> {theirs.describe('decode')}"
        rank, tokens = flow.peer.tp_rank, self.num_tokens
        if tokens is None:
            return self.fail(FailureKind.LAYOUT, f"{both}: decode context parallel needs the request's token count on "
                                                 f"the prefill side (sender(num_tokens=...) or init(num_tokens=...))", now)
        if self.num_pages != local_pages(mine, tokens):
            return self.fail(FailureKind.LAYOUT, f"{both}: {tokens} tokens take {local_pages(mine, tokens)} pages on "
                                                 f"this prefill rank, it was given {self.num_pages}", now)
        if meta.num_pages != local_pages(theirs, tokens) or not 0 <= meta.prefix_pages < meta.num_pages:
            return self.fail(FailureKind.PROTOCOL, f"{both}: decode rank {rank} holds {meta.num_pages} pages with a "
                                                   f"prefix of {meta.prefix_pages} for {tokens} tokens, which take "
                                                   f"{local_pages(theirs, tokens)} pages on each decode DCP rank", now)
        if meta.staged or self.layout.draft is not None:
            return self.fail(FailureKind.LAYOUT, f"{both}: decode context parallel moves the KV and the pool items "
                                                 f"direct (no staging or draft)", now)
        if flow.assignment is not None and mine.dcp_size > 1 and rank % theirs.dcp_size != self.layout.dcp_rank:
            return self.fail(FailureKind.LAYOUT, f"{both}: prefill DCP rank {self.layout.dcp_rank} would write decode "
                                                 f"DCP rank {rank % theirs.dcp_size}", now)
        failed = self._take_pool_dst(flow, meta, now)
        if failed is not None:
            return failed
        if flow.assignment is not None:
            pages = meta.pages()
            if pages.size != meta.num_pages - meta.prefix_pages:
                return self.fail(FailureKind.PROTOCOL, f"decode rank {rank} sent {pages.size} destination pages "
                                                       f"for {meta.num_pages} pages past a prefix of {meta.prefix_pages}",
                                 now)
            flow.dst_pages = pages
        flow.move(FlowEvent.CHECKED)
        return []

    def _dcp_write(self, flow: Flow, a: Assignment) -> list[PrefillAction]:
        """Decode context parallel, direct: the writes carrying the decode rank's tokens of the
        request (token_mapping.build_pair's runs), once the last send is in: one of every layer,
        or, where that would exceed `limits.max_ranges` descriptors, one per group of layers that fits
        (each numbered as a chunk of its own; a run is one descriptor per layer and tensor). The
        write of the last layer also carries the request's pool items for that rank (as the last
        page's write does without DCP); a rank that owns none of the tokens gets them in a write
        of their own, of every layer and no token. Where the rank has staging buffers and the
        relayout cuts the ranges (`_relayout`), each write is gathered into one first and holds
        the layers that fit it; the decode rank sees the same writes either way."""
        assert self.dcp is not None and self.num_tokens is not None and self.prefix is not None
        assert flow.dst_pages is not None, "a direct flow has its destination pages from its metadata"
        lay = self.layout
        src = self.ledger.pages[self.prefix:]
        pair = build_pair(prefill=lay.dcp(), decode=self.dcp, num_tokens=self.num_tokens,
                          prefix=self.prefix * lay.page_size * lay.dcp_size, src_pages=tuple(src.tolist()),
                          dst_pages=tuple(flow.dst_pages.tolist()), decode_rank=flow.peer.tp_rank % self.dcp.dcp_size)
        flow.issued = len(self.sendable)
        m = self._mapping
        copies = request_copies(writer_segments(self._flow_pools(flow), m.prefill_tp, m.decode_tp, a), self.pool_items,
                                flow.pool_dst) if self.pool_items else ()
        if not pair.num_tokens and not copies:   # the decode rank owns none of the tokens (a short request)
            return []
        ready = tuple(r for c in self.sendable for r in c.ready)
        runs = (pair.src_slot, pair.dst_slot, pair.length)
        moves, step = self._relayout(pair, a, block_bytes(copies))
        out: list[PrefillAction] = []
        written = self._written(flow)   # with PP: the layers both stages hold
        for part, first in enumerate(range(written.start, written.stop, step)):
            layers = range(first, min(first + step, written.stop))
            pools = copies if layers.stop == written.stop else ()
            nbytes = pair.num_tokens * self._bytes_per_page(a.num_heads, layers) // lay.page_size + block_bytes(pools)
            tag = make_tag(TagKind.DIRECT, room=self.room, session=flow.session, epoch=flow.peer.incarnation,
                           src=self.me, writer=lay.rank, chunk=part, piece=0, page_start=0,
                           num_pages=int(flow.dst_pages.size), layers=layers, nbytes=nbytes)
            op = WriteOp(op_id=next(self._op_ids), room=self.room, peer=flow.peer, staged=False, chunk=part, piece=0,
                         src_pages=np.asarray(src), dst_pages=flow.dst_pages, src_heads=a.src_heads,
                         dst_heads=a.dst_heads, nbytes=nbytes, tag=tag, pools=pools, layers=layers, ready=ready,
                         token_runs=runs, relayout=moves)
            out.append(self._post(flow, op))
        return out

    def _relayout(self, pair: PairTokens, a: Assignment, pool_bytes: int) -> tuple[Relayout | None, int]:
        """How a DCP flow's writes go: its relayout (None: its direct runs) and the layers a
        write holds. A relayout write holds the layers whose gathered bytes, and the pool
        bytes beside the last, fit `limits.relayout_bytes`, and whose destination runs fit
        `limits.max_ranges`; a flow whose one layer does not fit goes as direct runs."""
        lay = self.layout
        moves = worth_relayout(pair) if self.limits.relayout_bytes else None
        if moves is not None:
            layer_bytes = pair.num_tokens * self._bytes_per_page(a.num_heads, range(1)) // lay.page_size
            fit = min((self.limits.relayout_bytes - pool_bytes) // layer_bytes,
                      self.limits.max_ranges // (int(moves.length.size) * lay.num_kv))
            if fit >= 1:
                return moves, fit
        return None, max(1, self.limits.max_ranges // max(1, int(pair.length.size) * lay.num_kv))

    def on_grant(self, peer: PeerKey, grant: AllocGrant, now: float) -> list[PrefillAction]:
        """Ring space for a chunk this rank asked for: the whole chunk, or (a number from
        credits.remainder_number) the remainder of one whose first pieces went into credits."""
        flow = self._flow_of(peer, grant.session)
        own, remainder = chunk_number(grant.chunk, splits=self._splits)
        index, stage = divmod(own, self.layout.pp_size)
        if flow is None or self.ended or flow.is_granted(index):
            return []  # a repeated grant (we asked twice): already acted upon
        if not flow.staged or index not in flow.requested_at or stage != self.layout.pp_rank \
                or remainder != (index in flow.remainders):
            return self.fail(FailureKind.PROTOCOL, f"unexpected ring allocation for chunk {grant.chunk} from {peer}", now)
        a = flow.assignment
        assert a is not None, "a notice-only flow asks for no ring space"
        chunk, _ = self._asked(flow, index)
        w = self._chunk_writes(flow, a, chunk)
        ops = granted_writes(w, grant, op_ids=self._op_ids, last_part=(
            (lambda kv: final_part(self._flow_pools(flow), self._mapping, a, kv, self.pool_items, flow.pool_dst))
            if self.pool_items else None))
        if isinstance(ops, str):
            return self.fail(FailureKind.PROTOCOL, ops, now)
        out: list[PrefillAction] = [self._post(flow, op) for op in ops]
        flow.grant(index)
        flow.active_at = now
        return out

    def on_write_done(self, op_id: int, ok: bool, reason: str | None, now: float,
                      tags: tuple[bytes, ...] = ()) -> list[PrefillAction]:
        """A write ended. `tags`: the signed tags its backend writes carried (TagsAgain repeats
        them, in case a notification was lost)."""
        op = self.ops.pop(op_id, None)
        if op is None:
            return []
        flow = self.flows[op.peer.tp_rank]
        flow.writes_in_flight -= 1
        if op.credit is not None:   # its credit may go back once nothing of it is in flight
            purse = self.credits.purse(op.peer) if self.credits is not None else None
            if purse is not None and purse.holds(op.credit):
                purse.done(op.credit, ok)
            return [SettleCredits(op.peer)] + self._write_done(flow, op, ok, reason, now, tags)
        return self._write_done(flow, op, ok, reason, now, tags)

    def _write_done(self, flow: Flow, op: WriteOp, ok: bool, reason: str | None, now: float,
                    tags: tuple[bytes, ...]) -> list[PrefillAction]:
        if not ok and flow.state in CONFIRMED_STATES:
            # the decode rank already has every byte (it confirmed the room): a write reported
            # failed now was released after it landed (e.g. the peer left and was disconnected)
            return self._check_done(now) + self._maybe_release()
        if not ok:
            out = self.fail(FailureKind.WRITE, f"write of chunk {op.chunk} piece {op.piece} to {op.peer} failed: {reason}",
                            now)
            return out + self._maybe_release()
        flow.writes += 1
        flow.nbytes += op.nbytes
        flow.note_tags(tags)
        flow.active_at = now
        return self._pump(now) + self._maybe_release()   # a batching room's next write

    def on_room_done(self, peer: PeerKey, session: int, now: float) -> list[PrefillAction]:
        flow = self._flow_of(peer, session)
        if flow is None or self.ended:
            return []
        flow.move(FlowEvent.CONFIRM)
        return self._check_done(now)

    def on_room_failed(self, peer: PeerKey, session: int, kind: str, reason: str, now: float,
                       early: bool = False) -> list[PrefillAction]:
        """`early`: it arrived before this sender existed (parked by the shell)."""
        flow = self._flow_of(peer, session)
        if flow is None:
            if failure_use(self.stale, self._bound(peer), self.decode_engine, peer, session) is RoomUse.STALE:
                # an earlier use's, or another engine's: nothing of this use went to that session
                return [Send(peer, Quiesced(src=self.me, dst=peer.incarnation, room=self.room, session=session)),
                        Dropped("stale_room_failed")]
            if self.mapping is not None and peer.tp_rank not in self.expected:
                return []
            if early:
                parked = own_dict(self.early)
                parked[(peer, session)] = (kind, reason)
                self.early = parked
                return []
        self.failed_by = (peer.incarnation, session)
        return self._fail_remote(peer, kind, reason, now)

    def on_peer_lost(self, peer: PeerKey, reason: str, now: float) -> list[PrefillAction]:
        flow = self.flows.get(peer.tp_rank)
        if flow is None or flow.peer != peer:
            return []
        if flow.state in CONFIRMED_STATES:
            # it confirmed the room (has every byte) before it went, e.g. it closed right after:
            # only our own completions are outstanding, and the room succeeds once they are in
            return self._check_done(now)
        # writes to a lost peer will never be confirmed; the shell fails those in flight
        return self.fail(FailureKind.PEER_LOST, f"decode rank {peer.tp_rank} ({peer}) lost: {reason}", now)

    def abort(self, now: float) -> list[PrefillAction]:
        return self.fail(FailureKind.ABORTED, "aborted by the prefill caller", now)

    def tick(self, now: float) -> list[PrefillAction]:
        if self.ended:
            return []
        return self._retransmit(now) + self._bind_early(now) + self._deadlines(now)

    def _bind_early(self, now: float) -> list[PrefillAction]:
        """A parked failure whose decode rank sent no metadata of another session within a lease
        of this sender's creation is this use's: its decode room failed before its metadata went
        out (an earlier use whose prefill sender was never created here would be followed by new
        metadata from that rank well within a lease)."""
        if not self.early or now - self.created <= self.timeouts.lease:
            return []
        (peer, session), (kind, reason) = next(iter(self.early.items()))
        self.early = NO_ENTRIES
        return self.on_room_failed(peer, session, kind, f"{reason} (before its room metadata went out)", now)

    def _retransmit(self, now: float) -> list[PrefillAction]:
        return [self._writer_done(flow) if chunk is None else self._alloc_request(flow, chunk)
                for flow, chunk in due_again(self.flows.values(), self.timeouts.heartbeat, now)] + self._tags_again(now)

    def _tags_again(self, now: float) -> list[PrefillAction]:
        """The tags of a flow's completed writes once more (TagsAgain), at most once a heartbeat,
        while its decode rank may be waiting for one of them: the room is unconfirmed, the flow
        finished writing (WriterDone sent) or has writes still to complete (staged: perhaps
        waiting for ring space a lost tag holds), and none of its writes was posted or completed
        for a heartbeat. A lost notification then stalls the room (or, staged, the ring) for a
        heartbeat. A flow that keeps completing writes, was confirmed, or waits for its next
        chunk with nothing in flight (the decode rank waits for nothing of it) sends none."""
        beat = self.timeouts.heartbeat
        out: list[PrefillAction] = []
        for flow in self.flows.values():
            if (flow.state in CONFIRMED_STATES or not flow.landed_tags
                    or (flow.state is not FlowState.DONE_SENT and not flow.writes_in_flight)
                    or now - flow.active_at < beat or now - flow.tags_again_at < beat):
                continue
            flow.tags_again_at = now
            out.append(Send(flow.peer, TagsAgain(src=self.me, dst=flow.peer.incarnation, room=self.room,
                                                 session=flow.session, tags=list(flow.landed_tags))))
        return out

    def _alloc_request(self, flow: Flow, index: int) -> Send:
        chunk, number = self._asked(flow, index)
        return Send(flow.peer, AllocRequest(src=self.me, dst=flow.peer.incarnation, room=self.room,
                                            session=flow.session, chunk=number, page_start=chunk.page_start,
                                            num_pages=int(chunk.pages.size), layer_start=chunk.layers.start,
                                            num_layers=len(chunk.layers)))

    def _asked(self, flow: Flow, index: int) -> tuple[Chunk, int]:
        """What the grant path is asked for of sendable chunk `index`, and under which number:
        the whole chunk under its own, or the pages after those written into credits under its
        remainder's (prefill/credits.py)."""
        chunk = self._clip_sendable(flow, index)
        taken = flow.remainders.get(index)
        if taken is None:
            return chunk, self._wire(chunk)
        number = self._remainder_number(self._wire(chunk))
        assert number is not None and 0 < taken < chunk.pages.size, "only a chunk that can be split has a remainder"
        return replace(chunk, page_start=chunk.page_start + taken, pages=chunk.pages[taken:]), number

    def _remainder_number(self, wire: int) -> int | None:
        """The number of the remainder of the chunk numbered `wire` (None: this room splits no
        chunk): its chunks cover distinct (page, layer entry) cells, so their numbers stay
        below pages x entries x PP stages."""
        assert self.num_pages is not None, "chunks come after the page count"
        return remainder_number(wire, most_chunks=self.num_pages * self.layout.num_entries * self.layout.pp_size)

    @property
    def _splits(self) -> bool:
        """Whether this room numbers remainders (none of its chunks' own numbers can reach
        credits.REMAINDER)."""
        return self.num_pages is not None and self._remainder_number(0) is not None

    def _writer_done(self, flow: Flow) -> Send:
        return Send(flow.peer, WriterDone(src=self.me, dst=flow.peer.incarnation, room=self.room,
                                          session=flow.session, writes=flow.writes, nbytes=flow.nbytes))

    def _deadlines(self, now: float) -> list[PrefillAction]:
        t = self.timeouts
        if not self._all_metas() and now - self.created > t.metadata:
            who = f"decode rank(s) {[r for r in self.expected if r not in self.flows]}" if self.mapping else "any decode rank"
            if self.mapping is not None and self.decode_stages and not self.covered:
                who += (f"; this prefill {self._layout_text()} heard from "
                        f"{', '.join(st.text() for st in self.decode_stages.values())}, which leave its layers "
                        f"{uncovered(self.layout.layers, self.decode_stages.values())} to no decode stage (decode "
                        f"stages that do not tile the model?)")
            return self.fail(FailureKind.TIMEOUT, f"no room metadata from {who} within {t.metadata:g} s", now)
        waiting = self.batcher.oldest_waiting() if self.batcher is not None else None
        if waiting is not None and now - waiting > t.write:
            return self.fail(FailureKind.TIMEOUT, f"layers sent were not ready (send(ready=...)) within {t.write:g} s",
                             now)
        why = overdue(self.flows.values(), t, now)
        return self.fail(FailureKind.TIMEOUT, why, now) if why is not None else []

    def _told_of_failure(self) -> list[tuple[PeerKey, int]]:
        return [(flow.peer, flow.session) for flow in self.flows.values()]

    def _after_failure(self, now: float) -> list[PrefillAction]:
        for flow in self.flows.values():
            flow.move(FlowEvent.FAIL)
        if self.batcher is not None:
            self.batcher.clear()   # held units are never written
        return self._maybe_release()

    def totals(self) -> RoomTotals:
        """Bytes and writes completed, summed over the decode ranks written."""
        writing = [f for f in self.flows.values() if f.assignment is not None]
        path = (TransferPath.NONE if not writing
                else TransferPath.STAGED if any(f.staged for f in writing) else TransferPath.DIRECT)
        return RoomTotals(sum(f.nbytes for f in writing), sum(f.writes for f in writing), path,
                          self.batcher.merged if self.batcher is not None else 0)

    def sessions(self) -> frozenset[tuple[int, int]]:
        """(decode incarnation, session) pairs this use dealt with: stale for the next use of the id."""
        out = {(f.peer.incarnation, f.session) for f in self.flows.values()}
        if self.failed_by is not None:
            out.add(self.failed_by)
        return frozenset(out)

    # -- internals --------------------------------------------------------------------------
    @property
    def _mapping(self) -> HeadMapping:
        assert self.mapping is not None, "no decode rank's metadata yet"
        return self.mapping

    @property
    def _pages_to_send(self) -> int:
        """The request's pages past the decode side's prefix (once both are known)."""
        assert self.num_pages is not None and self.prefix is not None
        return self.num_pages - self.prefix

    @property
    def inflight(self) -> int:
        return len(self.ops)

    def _flow_of(self, peer: PeerKey, session: int) -> Flow | None:
        flow = self.flows.get(peer.tp_rank)
        if flow is None or flow.peer != peer or flow.session != session:
            return None
        return flow

    def _all_metas(self) -> bool:
        return self.mapping is not None and self.covered and all(r in self.flows for r in self.expected)

    def _clip(self, flow: Flow, chunk: Chunk) -> Chunk | None:
        """The chunk as written to `flow`'s decode rank: only the layers its stage holds
        (decode PP, stage_mapping.flow_layers); None when it holds none of them."""
        if flow.layers is None or (flow.layers.start <= chunk.layers.start and chunk.layers.stop <= flow.layers.stop):
            return chunk
        lo, hi = max(chunk.layers.start, flow.layers.start), min(chunk.layers.stop, flow.layers.stop)
        return replace(chunk, layers=range(lo, hi)) if lo < hi else None

    def _clip_sendable(self, flow: Flow, index: int) -> Chunk:
        chunk = self._clip(flow, self.sendable[index])
        assert chunk is not None, "ring space is asked for chunks with some of the flow's layers only"
        return chunk

    def _bytes_per_page(self, num_heads: int, layers: range) -> int:
        return direct_nbytes(self.layout.num_kv * len(layers), 1, self.layout.page_size, num_heads,
                             self.layout.head_bytes)

    def _wire(self, chunk: Chunk) -> int:
        """A chunk's number on the wire: the PP stages of an engine number their chunks apart
        (index * pp_size + pp_rank), since one decode room receives them all."""
        return chunk.index * self.layout.pp_size + self.layout.pp_rank

    def _final(self, page_end: int, layers: range, flow: Flow) -> bool:
        """Whether a write ending at `page_end` over `layers` is the one carrying the request's
        last page of the last entry this rank writes to that decode rank, hence the state pool
        items that flow carries (`_flow_pools`: the pools of its layers; with the model's last
        layer, of its last draft entry with a draft, the pools of no layer)."""
        return page_end == self._pages_to_send and (
            layers.stop == (flow.stage_stop or self.layout.num_entries)
            or (layers.stop == self._written(flow).stop and self._gets_pools(flow)))

    def _add_draft_items(self) -> None:
        """A draft of its own geometry (draft_kv.py): once the request's pages and the decode's
        prefix are both known, its pools' items are the token slots of every page past the prefix."""
        names = [p.name for p in self.pools if is_draft_pool(p.name)]
        if names and self.last and self.prefix is not None and names[0] not in self.pool_items:
            self.pool_items = {**self.pool_items, **request_draft_items(
                names, self.ledger.pages[self.prefix:], self.layout.page_size)}

    def _post(self, flow: Flow, op: WriteOp) -> PostWrite:
        self.ops[op.op_id] = op
        flow.writes_in_flight += 1
        return PostWrite(op)

    def _sync_sendable(self) -> None:
        if self.prefix is not None:
            self.sendable += past_prefix(self.chunks[self._synced:], self.prefix, len(self.sendable))
            self._synced = len(self.chunks)

    def _pump(self, now: float) -> list[PrefillAction]:
        if self.ended or not self._all_metas():
            return []  # nothing is written before every decode rank's metadata agreed (pages, prefix)
        if self.batcher is not None and not self.ops:   # its previous write completed: the next one
            for u in self.batcher.take():
                self._add_unit(u)
        self._sync_sendable()
        out: list[PrefillAction] = []
        for flow in self.flows.values():
            a = flow.assignment
            if a is None:
                continue
            if self.dcp is not None:   # decode context parallel: one write once the last send is in
                if self.last and flow.issued < len(self.sendable) and (self.batcher is None or len(self.batcher) == 0):
                    out += self._dcp_write(flow, a)
                continue
            while flow.issued < len(self.sendable):
                clipped = self._clip(flow, self.sendable[flow.issued])
                if clipped is None:   # none of the decode stage's layers: nothing to write there
                    flow.grant(self.sendable[flow.issued].index)
                    flow.issued += 1
                    continue
                chunk = clipped
                if not self.last and self._final(chunk.page_start + chunk.pages.size, chunk.layers, flow):
                    break   # the write carrying the pool items waits for the last send, which may name them
                if flow.staged:
                    taken = self._credit_writes(flow, a, chunk)
                    if taken is not None:
                        out += taken
                        flow.active_at = now
                    if taken is not None and chunk.index not in flow.remainders:
                        flow.grant(chunk.index)
                    else:   # the whole chunk, or its remainder, goes the grant path
                        flow.note_asked(chunk.index, now)
                        out.append(self._alloc_request(flow, chunk.index))
                        if taken is None and self.credits is not None and self.credits.purse(flow.peer) is not None:
                            out.append(SettleCredits(flow.peer))   # credits it retired may go back
                else:
                    out += self._direct_writes(flow, a, chunk)
                    flow.active_at = now
                flow.issued += 1
        return out + self._check_done(now)

    def _credit_writes(self, flow: Flow, a: Assignment, chunk: Chunk) -> list[PrefillAction] | None:
        """The chunk's writes into the decode rank's credits, posted at once: all its pieces, or
        the first that fit (its remainder then recorded in `flow.remainders`, for the grant
        path); None: the whole chunk goes the grant path (no credits from that rank, several
        writers of its pieces, or not even its first piece fits: then they are all retired and
        go back)."""
        purse = self.credits.purse(flow.peer) if self.credits is not None else None
        if purse is None or self.credits is None or \
                len(self._mapping.writers_of(flow.peer.tp_rank % self._mapping.decode_tp)) != 1:
            return None
        piece_bytes = self.credits.piece_bytes
        w = self._chunk_writes(flow, a, chunk)
        last_part = ((lambda kv: final_part(self._flow_pools(flow), self._mapping, a, kv, self.pool_items, flow.pool_dst))
                     if self.pool_items else None)
        end = chunk.page_start + int(chunk.pages.size)
        extra = block_bytes(last_part(0)[1]) if last_part is not None and w.pools_at == end else 0
        cut = cut_pieces(chunk.page_start, int(chunk.pages.size), page_bytes=w.head_page_bytes * a.num_heads,
                         piece_bytes=piece_bytes, last_extra=extra)
        if cut is None:
            return None
        probe = AllocGrant(src=flow.peer.incarnation, dst=self.me, room=self.room, session=flow.session, chunk=w.wire,
                           epoch=purse.epoch, pieces=[Piece(i, s, n, 0, piece_bytes) for i, (s, n) in enumerate(cut)])
        ops = granted_writes(w, probe, op_ids=self._op_ids, last_part=last_part, kind=TagKind.CREDIT)
        if isinstance(ops, str) or any(op.writer_offset for op in ops):
            return None   # a single writer's part starts its piece: never, but then the grant path decides
        sizes = [op.nbytes for op in ops]
        if self._remainder_number(w.wire) is None:   # cannot be split: all of it, or none
            spans = purse.take_all(sizes, self.room, flow.session) or []
        else:
            spans = purse.take_some(sizes, self.room, flow.session)
        if not spans:
            return None
        if len(spans) < len(ops):   # the rest of the chunk goes the grant path (its remainder)
            flow.note_remainder(chunk.index, cut[len(spans)][0] - chunk.page_start)
        placed = [replace(op, ring_start=sp.start, credit=sp, tag=msgspec.structs.replace(op.tag, ring_start=sp.start))
                  for op, sp in zip(ops, spans)]
        out: list[PrefillAction] = [self._post(flow, op) for op in placed]
        return out + [SettleCredits(flow.peer)]

    def wants_credits(self, peer: PeerKey) -> bool:
        """Whether this room may still write staged chunks to `peer` (its purse stays open)."""
        flow = self.flows.get(peer.tp_rank)
        if self.ended or flow is None or flow.peer != peer or not flow.staged or flow.assignment is None:
            return False
        return not (self.last and flow.issued == len(self.sendable)
                    and (self.batcher is None or len(self.batcher) == 0))

    def credits_done(self, peer: PeerKey) -> bool:
        """Whether this room will never again write staged chunks to `peer`, so that
        `wants_credits(peer)` stays False for good: it ended, or its last send came, every chunk
        of it is known past the prefix and was issued towards `peer`, and no layer-wise unit waits.
        (Before every decode rank's metadata agreed on the prefix, `wants_credits` may be False
        for a while and then True again: not done.)"""
        if self.ended:
            return True
        flow = self.flows.get(peer.tp_rank)
        return (flow is not None and flow.peer == peer and self.last and self.prefix is not None
                and self._synced == len(self.chunks) and flow.issued == len(self.sendable)
                and (self.batcher is None or len(self.batcher) == 0))

    def _chunk_writes(self, flow: Flow, a: Assignment, chunk: Chunk) -> ChunkWrites:
        return ChunkWrites(room=self.room, me=self.me, writer=self.layout.rank, peer=flow.peer, session=flow.session,
                           assignment=a, chunk=chunk, wire=self._wire(chunk),
                           head_page_bytes=self._bytes_per_page(1, chunk.layers),
                           pools_at=self._pages_to_send if self._final(self._pages_to_send, chunk.layers, flow) else None)

    def _direct_writes(self, flow: Flow, a: Assignment, chunk: Chunk) -> list[PrefillAction]:
        whole = self._mapping.prefill_tp == self._mapping.decode_tp or self.layout.mla
        assert flow.dst_pages is not None, "a direct flow has its destination pages from its metadata"
        m = self._mapping
        pool_flow = pool_assignment(a, m.page_shards)
        ops = direct_writes(self._chunk_writes(flow, a, chunk), dst_pages=flow.dst_pages,
                            max_ranges=self.limits.max_ranges,
                            ranges_per_page=self.layout.num_kv * len(chunk.layers) * (1 if whole else self.layout.page_size),
                            pools=lambda: request_copies(writer_segments(self._flow_pools(flow), m.prefill_tp, m.decode_tp,
                                                                         pool_flow),
                                                         self.pool_items, flow.pool_dst),
                            op_ids=self._op_ids, shard=(m.page_shards, self.layout.tp_rank) if m.page_shards > 1 else None)
        return [self._post(flow, op) for op in ops]

    def _flow_finished_writing(self, flow: Flow) -> bool:
        return (self.last and flow.issued == len(self.sendable) and not flow.writes_in_flight
                and (self.batcher is None or len(self.batcher) == 0)
                and (not flow.staged or flow.granted_count == len(self.sendable)))

    def _check_done(self, now: float) -> list[PrefillAction]:
        if self.ended or not self._all_metas():
            return []
        out: list[PrefillAction] = []
        for flow in self.flows.values():
            if flow.assignment is None or flow.state not in (FlowState.WRITING, FlowState.CONFIRMED_WRITING):
                continue
            if self._flow_finished_writing(flow):
                flow.done_sent_at = now
                # a decode rank that confirmed needs no WriterDone (and may be gone)
                if flow.move(FlowEvent.WRITTEN) is FlowState.DONE_SENT:
                    out.append(self._writer_done(flow))
        if self.last and all(f.assignment is None or f.state is FlowState.CONFIRMED for f in self.flows.values()):
            out += self._move(RoomEvent.SUCCEED, now) + self._maybe_release()
        return out

    def _maybe_release(self) -> list[PrefillAction]:
        if self.released or not self.ended or self.ops:
            return []
        out: list[PrefillAction] = []
        if self.state is KVPoll.Failed:
            for flow in self.flows.values():
                if flow.assignment is not None:
                    out.append(Send(flow.peer, Quiesced(src=self.me, dst=flow.peer.incarnation, room=self.room,
                                                        session=flow.session)))
        return out + self._release()


def answers_meta(actions: list[PrefillAction], peer: PeerKey) -> bool:
    """Whether a room's `actions` on a decode rank's metadata tell that rank the metadata came,
    so that no MetaAck need go with them: a write towards it (its WritePosted or its tag follows,
    each of which the decode room takes as the acknowledgement) or a message to it about the
    room (AllocRequest, RoomFailed, ...). A staged write that then waits for ring space may leave
    the decode rank to send its metadata again a heartbeat later: that copy is acknowledged."""
    for a in actions:
        if isinstance(a, PostWrite) and a.op.peer == peer:
            return True
        if isinstance(a, Send) and a.peer == peer:
            return True
    return False
