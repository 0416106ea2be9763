"""Decode side: where a room's data comes from. Prefill engines looked up on the bootstrap
server, connections to the ranks a room needs, and each room's plan once they all answered.

Lookups run on short-lived threads (the bootstrap client blocks) and come back as LookupDone
events. A room that fails before its metadata reached the prefill ranks leaves a tombstone,
sent to them once they are reachable, so their senders fail at once rather than at their
metadata deadline. The decisions themselves are pure (protocol/peering.py).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ...bootstrap import RankRecord
from ...bootstrap.rendezvous import RankGone
from ..config import Timeouts
from ..layout import KVLayout
from ..poll import KVPoll
from ..protocol import peering
from ..protocol.actions import PeerKey
from ..protocol.decode.plan import PathInputs, RoomPlan, SharedPlans
from ..protocol.decode.room import DecodeRoom, PlanRefused, WriterOffer, plan_room
from ..protocol.head_mapping import HeadMapping
from ..protocol.kinds import FailureKind, Role
from ..protocol.leases import Lease
from ..protocol.messages import Hello, HelloAck, KVMemory, PoolMemory, RingInfo, RoomFailed, WatermarkUpdate
from ..protocol.path_choice import PathMode, WriterCosts
from ..protocol.peering import LookupState
from ..protocol.room_uses import tombstone_obsolete
from ..protocol.routing import PeerState
from .context import EngineContext
from .events import LookupDone
from .interfaces import Counters, Post, RingOwner, Sockets
from .peers import Peer, PeerTable
from .prefill_sources import PrefillSource
from .rooms import DecodeBook

if TYPE_CHECKING:
    from ..state_pools import StatePool

log = logging.getLogger("kvstage")

_CONNECTIONS = itertools.count(1)   # connection numbers: a newer connection to the same rank has a higher one


@dataclass(frozen=True, kw_only=True)
class Tombstone:
    """A room that failed before its metadata reached its prefill ranks: sent to them as a
    RoomFailed once they are reachable (until the metadata timeout)."""

    room: int
    session: int
    kind: str
    reason: str
    since: float


@dataclass(kw_only=True)
class EngineView:
    """A prefill engine as its rendezvous server described it, for one PrefillSource."""

    source: PrefillSource
    engine_id: str = ""                # known at once for a source named by engine id, else after the lookup
    state: str = peering.LookupState.LOOKUP
    records: list[RankRecord] = field(default_factory=list)
    error: str = ""
    rooms: set[int] = field(default_factory=set)                # rooms waiting for their plan
    tombstones: list[Tombstone] = field(default_factory=list)   # rooms that failed before their metadata went out
    # the last answers worked out from `records` (replaced, never changed in place, on a lookup):
    # the ranks this decode rank deals with, and the last plan with what it was made of
    needed: tuple[list[RankRecord], peering.NeededRanks] | None = None
    last_plan: tuple[PlanInputs, RoomPlan] | None = None

    @property
    def name(self) -> str:
        return self.engine_id or self.source.key


@dataclass(frozen=True, kw_only=True)
class PlanInputs:
    """What a room's plan is made of besides this rank's fixed facts: the engine's records (the
    same list object: a lookup replaces it), each writer's and notice's peer, and the path
    inputs. Equal inputs make an equal plan, so the rooms of one engine reuse the last one
    instead of planning (and interning) it again."""

    records: list[RankRecord]
    writers: tuple[tuple[int, PeerKey, bool, int], ...]   # rank, peer, staging, buffer bytes
    notices: tuple[tuple[int, PeerKey], ...]
    path: PathInputs

    def same(self, other: PlanInputs) -> bool:
        return (self.records is other.records and self.writers == other.writers and self.notices == other.notices
                and self.path == other.path)


@dataclass(frozen=True, kw_only=True)
class PlanFacts:
    """What a decode rank's plans weigh of its configuration and hardware: plain values taken
    once at start (EngineConfig, the calibration)."""

    staging: bool                         # EngineConfig.staging: staging asked for here
    piece_cap: int                        # the largest staged piece in bytes (0: no cap)
    path: PathMode                        # EngineConfig.path
    mem_kind: str                         # this rank's KV memory: "VRAM" or "DRAM"
    scatter_bytes_per_s: float | None     # the measured scatter rate (calibration.py; None: not measured)


class EnginePlanner:
    """Decode rank `me`'s prefill engines and rooms' plans. `layout`: this rank's cache;
    `timeouts`: bootstrap, connect, lease, metadata; `stats` counts drops; `post` hands a
    lookup's result to the control thread (from the lookup's thread); `sock` sends a first
    Hello (`hello(conn)` makes it) and a refusal to a peer not connected; `ring`: the staging
    ring, if any; `facts`: what the plans weigh; `lookup(source, timeout)`: the bootstrap
    server's records of a prefill engine (blocks: on a lookup thread)."""

    def __init__(self, *, me: int, layout: KVLayout, timeouts: Timeouts, stats: Counters, post: Post,
                 sock: Sockets, ring: RingOwner, facts: PlanFacts, hello: Callable[[int], Hello], peers: PeerTable,
                 book: DecodeBook, lookup: Callable[[PrefillSource, float], list[RankRecord]]):
        self.me, self.layout, self.t, self.stats, self.post = me, layout, timeouts, stats, post
        self.sock, self.ring, self.facts, self._hello = sock, ring, facts, hello
        self.peers, self.book, self._lookup = peers, book, lookup
        self.engines: dict[str, EngineView] = {}      # source key -> view
        self.engine_of: dict[int, str] = {}          # room -> source key
        self._fallback_logged: set[tuple[str, str]] = set()
        self._costs: dict[int, WriterCosts | None] = {}   # prefill incarnation -> the costs its HelloAck sent
        self._plans = SharedPlans()                    # one plan per shape, shared by its rooms (decode/plan.py)

    # -- engines ----------------------------------------------------------------------------------
    def engine(self, source: PrefillSource, now: float) -> EngineView:
        """The source's view, looking it up (again) when needed."""
        view = self.engines.get(source.key)
        stale = view is not None and peering.records_stale((r.incarnation for r in view.records),
                                                           self.peers.gone, self.peers.replaced)
        if peering.needs_lookup(view.state if view is not None else None, stale):
            view = EngineView(source=source, engine_id=view.engine_id if view else source.engine_id,
                              rooms=view.rooms if view else set(), tombstones=view.tombstones if view else [])
            self.engines[source.key] = view
            threading.Thread(target=self._do_lookup, args=(source,), name="kvstage-lookup", daemon=True).start()
        assert view is not None
        return view

    def _do_lookup(self, source: PrefillSource) -> None:
        try:
            records = self._lookup(source, self.t.bootstrap)
            self.post(LookupDone(source.key, list(records), None))
        except Exception as exc:  # noqa: BLE001 - reported to the rooms waiting for it
            self.post(LookupDone(source.key, None, f"{type(exc).__name__}: {exc}"))

    def on_lookup(self, ev: LookupDone, now: float) -> None:
        view = self.engines.get(ev.engine_id)   # the source key
        if view is None:
            return
        found = peering.read_lookup(view.name, ev.records, ev.error)
        view.state = found.state
        if found.state is peering.LookupState.READY:
            view.records, view.engine_id = found.records, found.records[0].engine_id
        else:
            view.error = found.error
        self._changed(view, now)

    def _views_of(self, engine_id: str) -> list[EngineView]:
        return [v for v in self.engines.values() if v.engine_id == engine_id]

    def changed(self, engine_id: str, now: float) -> None:
        for view in self._views_of(engine_id):
            self._changed(view, now)

    def _changed(self, view: EngineView, now: float) -> None:
        for room_id in list(view.rooms):
            self.try_plan(self.book.get(room_id), view, now)
        self._flush_tombstones(view, now)

    # -- rooms ------------------------------------------------------------------------------------
    def add_room(self, room: DecodeRoom, source: PrefillSource, now: float) -> None:
        for other in self.engines.values():   # an earlier use's failure not sent yet would only reach this use
            kept = [s for s in other.tombstones if not tombstone_obsolete(room=s.room, session=s.session,
                                                                         started_room=room.room,
                                                                         started_session=room.session)]
            if len(kept) < len(other.tombstones):
                self.stats.count("dropped_messages", "obsolete_tombstone")
                other.tombstones = kept
        self.engine_of[room.room] = source.key
        view = self.engine(source, now)
        view.rooms.add(room.room)
        self.try_plan(room, view, now)

    def try_plan(self, room: DecodeRoom | None, view: EngineView, now: float) -> None:
        if room is None or room.plan is not None or room.state in (KVPoll.Success, KVPoll.Failed):
            if room is not None:
                view.rooms.discard(room.room)
            return
        if view.state == LookupState.FAILED:
            view.rooms.discard(room.room)
            reason = f"looking up prefill engine {view.name} failed: {view.error}"
            self._tell_connected(view, room, FailureKind.BOOTSTRAP, reason)
            return self.book.apply(room, room.on_plan_failed(FailureKind.BOOTSTRAP, reason, now))
        if view.state != LookupState.READY:
            return
        try:
            need = self._needed(view)
        except ValueError as exc:
            view.rooms.discard(room.room)
            self.book.apply(room, room.on_plan_failed(FailureKind.LAYOUT, str(exc), now))
            # no rank of the engine gets metadata: tell them all why, not only a timeout later
            self._bury(view, room, FailureKind.LAYOUT, str(exc), now)
            return
        peers: dict[int, Peer] = {}
        for rank in need.all:
            peers[rank] = self.ensure_peer(view, rank, now)
            if peers[rank].state == PeerState.REJECTED:
                break  # no Hello to the rest: this room cannot be planned
        verdict = peering.plan_gate({rank: p.state for rank, p in peers.items()})
        if verdict.gate is peering.Gate.REJECTED:
            bad = verdict.rejected_by
            assert bad is not None
            view.rooms.discard(room.room)
            self._tell_rejected(view, room, peers[bad].reason)
            return self.book.apply(room, room.on_plan_failed(
                FailureKind.LAYOUT, f"prefill rank {bad} of {view.engine_id}: {peers[bad].reason}", now))
        if verdict.gate is peering.Gate.WAIT:
            return
        view.rooms.discard(room.room)
        inputs = PlanInputs(records=view.records,
                            writers=tuple((w, peers[w].key, peers[w].staging, peers[w].buffer_bytes)
                                          for w in need.writers),
                            notices=tuple((n, peers[n].key) for n in need.notices),
                            path=self._path_inputs([peers[w] for w in need.writers]))
        if view.last_plan is not None and view.last_plan[0].same(inputs):
            return self.book.apply(room, room.on_plan(view.last_plan[1], now))
        ring, facts = self.ring.allocator, self.facts
        plan = plan_room(self.layout, need.mapping,
                         {w: WriterOffer(peers[w].key, peers[w].staging, peers[w].buffer_bytes, need.layers[w])
                          for w in need.writers},
                         {n: peers[n].key for n in need.notices}, staging=facts.staging,
                         ring_size=ring.size if ring else 0, ring_align=ring.align if ring else 1,
                         piece_cap=facts.piece_cap, epoch=self.me,
                         draft_pools=need.draft_pools, path=inputs.path)
        if isinstance(plan, PlanRefused):
            return self.book.apply(room, room.on_plan_failed(plan.kind, plan.reason, now))
        plan = self._plans.intern(plan)
        view.last_plan = (inputs, plan)
        if facts.staging and not plan.can_stage:
            self._log_fallback(view.engine_id, need.mapping, [peers[w] for w in need.writers])
        self.book.apply(room, room.on_plan(plan, now))

    def _path_inputs(self, writers: list[Peer]) -> PathInputs:
        """What the path choice of a room weighs (protocol/path_choice.py): the configured mode,
        the writers' measured costs, this rank's KV memory kind and scatter rate."""
        facts = self.facts
        return PathInputs(mode=facts.path, writers=tuple(self._costs.get(p.key.incarnation) for p in writers),
                          mem_kind=facts.mem_kind, scatter_bytes_per_s=facts.scatter_bytes_per_s)

    def _needed(self, view: EngineView) -> peering.NeededRanks:
        """The engine's ranks this decode rank deals with; ValueError when its TP size cannot
        share the heads or its PP stages do not tile the model."""
        if view.needed is not None and view.needed[0] is view.records:
            return view.needed[1]
        stages = peering.read_stages(view.name, view.records, self.layout.num_layers)
        need = peering.needed_ranks(stages.tp_size, self.layout, stages.layers, stages.draft_pools, stages.page_shards)
        view.needed = (view.records, need)
        return need

    def _log_fallback(self, engine_id: str, mapping: HeadMapping, writers: list[Peer]) -> None:
        why = peering.fallback_reason(self.ring.allocator is not None, self.layout.mla,
                                      mapping.prefill_tp, mapping.decode_tp,
                                      [p.key.tp_rank for p in writers if not p.staging])
        if (engine_id, why) not in self._fallback_logged:
            self._fallback_logged.add((engine_id, why))
            log.info("direct path for rooms from %s: %s", engine_id, why)

    def _tell_rejected(self, view: EngineView, room: DecodeRoom, reason: str) -> None:
        """The prefill ranks of a room must fail too when the connection was refused."""
        for rec in view.records:
            peer = self.peers.of_rank(view.engine_id, rec.tp_rank)
            if peer is not None:
                self.sock.send(peer.endpoint, RoomFailed(
                    src=self.me, dst=peer.key.incarnation, room=room.room, session=room.session, kind=FailureKind.LAYOUT,
                    reason=f"decode rank {self.layout.rank} refused: {reason}"))

    def _tell_connected(self, view: EngineView, room: DecodeRoom, kind: str, reason: str) -> None:
        """A room failed because its engine's lookup failed: the ranks of that engine this rank is
        still connected to (from earlier rooms) may hold the room already; they fail it now, with
        this reason, rather than at their metadata deadline. The others cannot be reached."""
        for peer in self.peers.connected():
            if peer.key.engine_id == view.engine_id:
                self.peers.send(peer.key, RoomFailed(src=self.me, dst=peer.key.incarnation, room=room.room,
                                                     session=room.session, kind=kind, reason=reason))

    def tombstone(self, room: DecodeRoom, kind: str, reason: str, now: float) -> None:
        """A room failed before its metadata went out: its prefill ranks are told (RoomFailed)
        once connected, so they fail it now rather than at their metadata deadline."""
        view = self.engines.get(self.engine_of.get(room.room, ""))
        if view is not None:
            self._bury(view, room, kind, reason, now)

    def _bury(self, view: EngineView, room: DecodeRoom, kind: str, reason: str, now: float) -> None:
        view.rooms.discard(room.room)
        view.tombstones.append(Tombstone(room=room.room, session=room.session, kind=kind, reason=reason, since=now))
        self._flush_tombstones(view, now)

    def _flush_tombstones(self, view: EngineView, now: float) -> None:
        if not view.tombstones:
            return
        if view.state == LookupState.FAILED:
            view.tombstones.clear()
            return
        if view.state != LookupState.READY:
            return
        try:
            ranks: Iterable[int] = self._needed(view).all
        except ValueError:   # its stages cannot be planned: every rank of it waits for metadata
            ranks = range(len(view.records))
        keep = []
        for stone in view.tombstones:
            if now - stone.since > self.t.metadata:
                continue
            waiting = False
            for rank in ranks:
                peer = self.ensure_peer(view, rank, now)
                if peer.state == PeerState.CONNECTED:
                    self.peers.send(peer.key, RoomFailed(src=self.me, dst=peer.key.incarnation, room=stone.room,
                                                         session=stone.session, kind=stone.kind, reason=stone.reason))
                elif peer.state == PeerState.CONNECTING:
                    waiting = True
            if waiting:
                keep.append(stone)
        view.tombstones = keep

    # -- connections ------------------------------------------------------------------------------
    def ensure_peer(self, view: EngineView, rank: int, now: float) -> Peer:
        rec = view.records[rank]
        peer = self.peers.of_rank(view.engine_id, rank)
        if peer is not None and peering.reuse_peer(peer.key.incarnation, peer.state, rec.incarnation):
            return peer
        peer = Peer(key=PeerKey(view.engine_id, rank, rec.incarnation), role=Role.PREFILL, tp_size=rec.tp_size,
                    endpoint=rec.ctrl_endpoint, lease=Lease(self.t.lease, now), since=now, conn=next(_CONNECTIONS))
        self.peers.add(peer, now)
        self.sock.send(peer.endpoint, self._hello(peer.conn))
        return peer

    def on_HelloAck(self, peer: Peer, msg: HelloAck, now: float) -> None:
        if msg.conn and msg.conn != peer.conn:
            self.stats.count("dropped_messages", "stale_connection")  # answers an older Hello
            return
        if peer.state != PeerState.CONNECTING:
            return
        if not msg.ok:
            peer.state, peer.reason = PeerState.REJECTED, msg.reason
            log.error("prefill rank %s refused the connection: %s", peer.key, msg.reason)
            return self.changed(peer.key.engine_id, now)
        self.peers.connected_via(peer, msg.backend_name)
        peer.staging, peer.buffer_bytes = msg.staging, msg.buffer_bytes
        self._costs[peer.key.incarnation] = msg.costs
        if self.peers.came_back(peer.key.incarnation):
            log.info("prefill rank %s reconnected after it was lost", peer.key)
        allocator = self.ring.allocator
        if allocator is not None and peer.staging:
            wm = allocator.watermark  # a new subscriber gets the watermark at once
            self.peers.send(peer.key, WatermarkUpdate(src=self.me, dst=peer.key.incarnation, epoch=self.me,
                                                      round=wm.round, tail=wm.tail))
        self.changed(peer.key.engine_id, now)

    def connect_failed(self, peer: Peer, now: float) -> None:
        """Rooms keep waiting (the rank may be restarting): look the engine up again; each room
        gives up at its own plan deadline (see plan_deadlines)."""
        reason = f"no answer from prefill rank {peer.key.tp_rank} at {peer.endpoint} within {self.t.connect:g} s"
        log.warning("connecting to %s failed: %s", peer.key, reason)
        views = self._views_of(peer.key.engine_id)
        self.peers.lost(peer, reason, now)
        for view in views:
            view.error = reason
            if view.rooms or view.tombstones:
                self.engine(view.source, now)

    def peer_lost(self, peer: Peer, now: float) -> None:
        for view in self._views_of(peer.key.engine_id):
            if view.rooms:
                self.engine(view.source, now)  # look the engine up again for rooms still waiting

    def rank_gone(self, gone: RankGone, now: float) -> None:
        """The rendezvous no longer holds a prefill rank (etcd's watch saw its key deleted or taken
        over): a connection to it ends as a lost peer's does, failing its rooms with the reason;
        views that name it without a connection fail their waiting rooms and are looked up again
        for the next ones."""
        reason = f"prefill rank {gone.tp_rank} of {gone.engine_id}: {gone.reason}"
        peer = self.peers.get(gone.incarnation)
        if peer is not None:
            self.peers.lost(peer, reason, now)
            return
        for view in self._views_of(gone.engine_id):
            if view.state == LookupState.READY and any(r.incarnation == gone.incarnation for r in view.records):
                view.state, view.error = "failed", reason
                self._changed(view, now)

    def plan_deadlines(self, now: float) -> None:
        """Rooms that could not reach their prefill ranks in time fail, saying why."""
        limit = self.t.bootstrap + self.t.connect
        for view in self.engines.values():
            for room_id in list(view.rooms):
                room = self.book.get(room_id)
                if room is None:
                    view.rooms.discard(room_id)
                elif now - room.created > limit:
                    view.rooms.discard(room_id)
                    why = view.error or f"prefill engine {view.name} not ready"
                    self.book.apply(room, room.on_plan_failed(
                        FailureKind.CONNECT, f"no connection to the prefill ranks of this room within {limit:g} s: {why}", now))


def decode_hello(ctx: EngineContext, conn: int) -> Hello:
    """The Hello decode rank `ctx.me` sends a prefill rank on connection `conn`: where its KV
    memory and ring are, its layout and identity. An assembly helper: the loop (loop.py) hands
    the planner this function bound to its context, read at each call."""
    b = ctx.buffers
    entry_v = b.entry_v
    kv = KVMemory(k_addrs=[t.data_ptr() for t in b.entry_k],
                  v_addrs=[t.data_ptr() for t in entry_v] if entry_v is not None else [],
                  num_pages=b.num_pages, page_stride=ctx.layout.page_bytes,
                  token_stride=ctx.layout.token_bytes, mem_kind="VRAM" if b.device.type == "cuda" else "DRAM",
                  device=ctx.geometry.device, pools=pool_memory(b.pools))
    ring = None
    if ctx.handler.ring is not None and ctx.handler.allocator is not None:
        r = ctx.handler.ring
        ring = RingInfo(addr=r.addr, size=ctx.handler.allocator.size, epoch=ctx.me, mem_kind=r.kind,
                        device=r.device)
    lay = ctx.layout
    stage = lay.stage if lay.pp_size > 1 else None   # decode PP: its stage (stage_mapping.py)
    return Hello(src=ctx.me, engine_id=ctx.cfg.engine_id, role=ctx.role, tp_size=lay.tp_size,
                 tp_rank=lay.rank, pp_size=lay.pp_size, stage_start=stage.start if stage else 0,
                 stage_stop=stage.stop if stage else 0, dcp_size=lay.dcp_size, dcp_rank=lay.dcp_rank,
                 ctrl_endpoint=ctx.sock.endpoint, backend=ctx.cfg.backend,
                 backend_identity=ctx.identity, layout=ctx.summary, kv=kv, ring=ring,
                 staging=ctx.cfg.staging and ring is not None, lease_s=ctx.t.lease, conn=conn,
                 verify=ctx.cfg.verify)


def pool_memory(pools: dict[str, StatePool]) -> list[PoolMemory]:
    """Where this rank's state pool items are, for writers' direct writes."""
    out = []
    for name in sorted(pools):
        ts = pools[name].tensors
        heads = pools[name].sharding == "heads"
        pool = pools[name]
        out.append(PoolMemory(name=name, addrs=[t.data_ptr() for t in ts],
                              item_strides=[t.stride(0) * t.element_size() for t in ts],
                              head_strides=[t.stride(1) * t.element_size() if heads else 0 for t in ts],
                              mem_kind=pool.kind, device=(pool.device.index or 0) if pool.kind == "VRAM" else 0,
                              own_writes=pool.own_writes))
    return out
