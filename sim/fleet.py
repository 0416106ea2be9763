"""A fleet of serving engines driven through the pure protocol, on one machine: P prefill engines
and D decode engines of mixed TP sizes, many requests in flight, no byte moved.

Each request goes from one prefill engine to one decode engine of the same model. Every rank of
both engines holds a room (transfer/protocol/prefill/room.py, decode/room.py); the simulator is
the engine shell around them: it delivers their messages through a seeded network model
(network.py), lands their writes, hands tags to the decode rooms, scatters staged pieces out of
the decode ranks' rings (transfer/protocol/ring.py, through a `RingPath`), ticks them, kills ranks and
lets their peers notice through their leases (transfer/protocol/leases.py).

Bytes are symbolic: a write or a scatter marks the (request page, layer, head) cells it fills,
and the source page it came from must be the destination page's; a staged write marks the ring
bytes it fills, and a scatter must read a landed write of the same room and pages. At the end
(`check`) every invariant the unit simulator (tests/unit/protocol_sim.py) checks holds, or
`check` says which did not:

- every room on a live rank ended Success or Failed, with a reason when Failed, and released;
- a decode rank in Success holds every cell of the request past its prefix exactly once, from
  the right source page and head, and no prefix cell;
- a prefill rank in Success wrote to decode ranks that are all in Success;
- no staged write landed on ring bytes of a region still held by another piece, every scatter
  read bytes its room's writers landed, and every ring is empty at the end.

Every figure the fleet reports (`Fleet.report`) is counted as it runs: control messages and
their encoded bytes by type, ring occupancy and grants per prefill rank, the CPU time spent in
the pure rooms, connections (hence heartbeats), rendezvous lookups, and how long a dead peer's
requests took to fail.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import random
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
import numpy as np
import torch

from ..transfer.config import Timeouts
from ..transfer.layout import KVLayout
from ..transfer.poll import KVPoll
from ..transfer.protocol.actions import PeerKey, PostWrite, PublishWatermark, Released, Scatter, Send, StatusChanged
from ..transfer.protocol.decode.plan import RoomPlan, SharedPlans
from ..transfer.protocol.decode.room import DecodeRoom
from ..transfer.protocol.decode.watermark_fanout import WatermarkFanout, pending_parts
from ..transfer.protocol.head_mapping import HeadMapping, compute_assignments
from ..transfer.protocol.kinds import FailureKind
from ..transfer.protocol.leases import Lease, heartbeat_interval, pair_interval
from ..transfer.protocol.messages import (
    AllocGrant,
    AllocRequest,
    MetaAck,
    Quiesced,
    RoomDone,
    RoomFailed,
    RoomMessage,
    RoomMeta,
    TagsAgain,
    WatermarkUpdate,
    WriterDone,
)
from ..transfer.protocol.peering import LookupState, needs_lookup
from ..transfer.protocol.pieces import max_piece_pages
from ..transfer.protocol.prefill.room import PrefillRoom, answers_meta
from ..transfer.protocol.ring import RemoteWatermark, RingAllocator, Watermark
from ..transfer.protocol.room_uses import (
    EarlierUses,
    Parked,
    RoomUse,
    ended_answer,
    use_without_sender,
    writer_done_answer,
)
from ..wire import MAC_BYTES
from .network import Network, NetworkModel

DONE = (KVPoll.Success, KVPoll.Failed)


@dataclass(frozen=True, kw_only=True)
class Model:
    """What a fleet serves: engines of one model exchange requests. `head_dim` and the dtype
    only size the pages (the ring's pieces); `layers` is the KV entries a room moves."""

    name: str
    mla: bool
    heads: int          # KV heads (1 for MLA: the latent)
    layers: int
    page_size: int
    head_dim: int = 128


@dataclass(frozen=True, kw_only=True)
class FleetConfig:
    prefill_engines: int
    decode_engines: int
    prefill_tp: tuple[int, ...] = (8,)      # engine i has TP prefill_tp[i % len]
    decode_tp: tuple[int, ...] = (8,)
    models: tuple[Model, ...] = (Model(name="gqa", mla=False, heads=8, layers=4, page_size=16),)
    requests: int = 1000                    # requests opened in all
    in_flight: int = 100                    # at most this many at once (the first ones open together)
    pages: tuple[int, int] = (1, 24)        # pages per request, inclusive range
    chunks: tuple[int, int] = (1, 3)        # chunks per request
    chunk_s: tuple[float, float] = (0.02, 0.08)   # prefill compute per chunk
    layerwise: float = 0.3                  # share of requests sent layer by layer
    prefix: float = 0.3                     # share of requests whose decode side holds a prefix
    aborts: float = 0.01                    # share of requests aborted on one side mid-way
    deaths: int = 1                         # ranks killed (half prefill, half decode), early on
    death_at: float = 0.05                  # when the first dies
    reuse: bool = True                      # room ids of finished requests are used again
    ring_bytes: int = 8 << 20               # each decode rank's staging ring (GQA models)
    buffer_bytes: int = 2 << 20             # each prefill rank's staging buffer
    ring_align: int = 256
    network: NetworkModel = NetworkModel()
    timeouts: Timeouts = Timeouts()
    tick_s: float = 0.25                    # the control loop's tick (deadlines, retransmissions)
    watermark_to_all: bool = False          # every move to every staging peer (the shell before
                                            # protocol/decode/watermark_fanout.py), not to the writers in flight
    seed: int = 0


class RingPath(Protocol):
    """The staging ring's allocation and grant path of a decode rank, as the fleet drives it.
    The ring as on main: `MainRingPath`; a ring with credits plugs in here."""

    def allocator(self, rank: int, size: int, align: int) -> RingAllocator: ...

    def on_alloc_request(self, room: DecodeRoom, peer: PeerKey, msg: AllocRequest, ring: RingAllocator,
                         now: float) -> list[Any]: ...


class MainRingPath:
    def allocator(self, rank: int, size: int, align: int) -> RingAllocator:
        return RingAllocator(size, align=align)

    def on_alloc_request(self, room: DecodeRoom, peer: PeerKey, msg: AllocRequest, ring: RingAllocator,
                         now: float) -> list[Any]:
        return room.on_alloc_request(peer, msg, ring, now)


@dataclass(eq=False)
class Rank:
    gid: int
    side: str                   # "prefill" | "decode"
    engine: int
    tp_rank: int
    key: PeerKey
    layout: KVLayout
    ring: RingAllocator | None = None
    rooms: dict[int, Any] = field(default_factory=dict)
    alive: bool = True
    peers: set[int] = field(default_factory=set)          # connected ranks (gids)
    staging_peers: set[int] = field(default_factory=set)  # decode: connected prefill ranks that stage
    lookups: dict[int, str] = field(default_factory=dict)  # decode: prefill engine -> LookupState
    # what the engine shell keeps of released rooms (engine/rooms.py, prefill_side.py): room ->
    # (state, failure kind, reason, session); prefill: sessions the id's uses dealt with, and the
    # metadata a successful use served; messages parked for a sender not created yet
    finished: dict[int, tuple[KVPoll, str, str, int, float]] = field(default_factory=dict)   # state, kind, why, session, ended at
    used_sessions: dict[int, EarlierUses] = field(default_factory=dict)
    served: dict[int, frozenset[tuple[int, int]]] = field(default_factory=dict)
    parked: dict[int, list[Parked]] = field(default_factory=dict)
    fanout: WatermarkFanout = field(default_factory=WatermarkFanout)   # decode: who was told the watermark
    plans: SharedPlans = field(default_factory=SharedPlans)   # decode: one plan per shape, shared by its rooms


@dataclass(eq=False)
class Request:
    rid: int
    room: int
    model: Model
    pe: int
    de: int
    n: int
    k: int                      # prefix pages the decode side holds
    opened: float
    src_base: int
    dst_base: int
    open_rooms: int = 0
    cover: dict[int, np.ndarray] = field(default_factory=dict)   # decode gid -> (n, layers, heads) counts
    outcome: dict[int, tuple[KVPoll, str | None]] = field(default_factory=dict)  # gid -> end state
    closed: float | None = None
    death: float | None = None  # when a rank it used died
    failed_at: float = 0.0      # last failure of a live rank of it


@dataclass
class RingEntry:
    end: int
    region: int                 # linear start of its region
    op: Any


class Fleet:
    def __init__(self, cfg: FleetConfig, ring_path: RingPath | None = None):
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.net = Network(cfg.network, random.Random(cfg.seed + 1))
        self.ring_path = ring_path or MainRingPath()
        self.now = 0.0
        self._events: list[tuple[float, int, str, tuple]] = []
        self._seq = itertools.count()
        self._incarnations = itertools.count(0x10000)
        self.op_ids = itertools.count(1)
        self._sessions = itertools.count(1)   # a decode rank's sessions increase (room_uses.py)
        self.ranks: list[Rank] = []
        self.engines: dict[tuple[str, int], list[int]] = {}
        self.engine_model: dict[tuple[str, int], Model] = {}
        self.by_key: dict[PeerKey, int] = {}
        self.by_key_inc: dict[int, int] = {}
        self._layouts: dict[tuple, KVLayout] = {}
        self._mappings: dict[tuple, HeadMapping] = {}
        self._build()
        # requests
        self.requests: list[Request] = []
        self.open: dict[int, Request] = {}        # room id -> request in flight
        self._free_rooms: list[int] = []
        self._room_ids = itertools.count(1)
        self._next_rid = 0
        self.dead_engines: set[tuple[str, int]] = set()
        # staged writes waiting for their ring region: (prefill gid, decode gid) -> ops
        self.waiting: dict[tuple[int, int], list[Any]] = defaultdict(list)
        self.remote_wm: dict[tuple[int, int], RemoteWatermark] = {}
        self.ring_data: dict[int, tuple[list[int], dict[int, RingEntry]]] = defaultdict(lambda: ([], {}))
        # measurements
        self.msgs: Counter[str] = Counter()
        self.msg_bytes: Counter[str] = Counter()
        self.msgs_by_rank: Counter[int] = Counter()
        self.setup_msgs: Counter[str] = Counter()
        self.core_s = 0.0
        self.core_calls = 0
        self.lookups = 0
        self.overlaps = 0
        self.bad_scatters: list[str] = []
        self.bad_writes: list[str] = []
        self.events = 0
        self.peak_in_flight = 0
        self.grants: dict[int, Counter[int]] = defaultdict(Counter)     # decode gid -> prefill gid -> bytes
        self.grant_wait: dict[int, list[float]] = defaultdict(list)      # prefill gid -> seconds
        self._alloc_asked: dict[tuple, float] = {}
        self.ring_occ: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])  # [time-weighted bytes, last t, peak]
        self.deaths: list[tuple[float, int]] = []
        self.detect: list[float] = []             # death -> declared lost, per observer
        self.fail_after_death: list[float] = []   # death -> the request failed on every live rank
        self._encoder = msgspec.msgpack.Encoder()
        self.hook_s = 0.0
        self.refused = 0

    # -- set-up ------------------------------------------------------------------------------
    def _build(self) -> None:
        cfg = self.cfg
        for side, count, tps in (("prefill", cfg.prefill_engines, cfg.prefill_tp),
                                 ("decode", cfg.decode_engines, cfg.decode_tp)):
            for e in range(count):
                tp = tps[e % len(tps)]
                model = cfg.models[e % len(cfg.models)]
                self.engine_model[(side, e)] = model
                gids = []
                for r in range(tp):
                    gid = len(self.ranks)
                    key = PeerKey(f"{side[0]}{e}", r, next(self._incarnations))
                    rank = Rank(gid, side, e, r, key, self._layout(model, tp, r))
                    if side == "decode" and not model.mla:
                        rank.ring = self.ring_path.allocator(gid, cfg.ring_bytes, cfg.ring_align)
                    self.ranks.append(rank)
                    self.by_key[key] = gid
                    self.by_key_inc[key.incarnation] = gid
                    gids.append(gid)
                self.engines[(side, e)] = gids

    def _layout(self, m: Model, tp: int, r: int) -> KVLayout:
        key = (m, tp, r)
        if key not in self._layouts:
            self._layouts[key] = KVLayout(num_layers=m.layers, total_kv_heads=m.heads, head_dim=m.head_dim,
                                          dtype=torch.bfloat16, page_size=m.page_size, tp_size=tp, tp_rank=r, mla=m.mla)
        return self._layouts[key]

    def mapping(self, m: Model, ptp: int, dtp: int) -> HeadMapping:
        key = (m.heads, m.mla, ptp, dtp)
        if key not in self._mappings:
            self._mappings[key] = compute_assignments(ptp, dtp, m.heads, m.mla)
        return self._mappings[key]

    # -- the scheduler -----------------------------------------------------------------------
    def at(self, t: float, kind: str, *args: Any) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, args))

    def core(self, fn: Any, *args: Any, **kw: Any) -> Any:
        """A call into the pure rooms, its CPU time counted (thread time: the machine's load
        does not inflate it)."""
        t = time.thread_time()
        out = fn(*args, **kw)
        self.core_s += time.thread_time() - t
        self.core_calls += 1
        return out

    def run(self, until: float = 3600.0) -> None:
        """Open the requests and run every event until nothing is left in flight."""
        cfg = self.cfg
        while self._next_rid < cfg.requests and len(self.open) < cfg.in_flight:
            self._open_request()
        if cfg.deaths:
            self.at(cfg.death_at, "death_plan")
        self.at(cfg.tick_s, "tick")
        while self._events:
            t, _, kind, args = heapq.heappop(self._events)
            if t > until:
                break
            self.now = t
            self.events += 1
            getattr(self, "_ev_" + kind)(*args)
            if kind == "tick" and not self.open and self._next_rid >= cfg.requests:
                break

    # -- requests ----------------------------------------------------------------------------
    def _engines_of(self, side: str, model: Model) -> list[int]:
        n = self.cfg.prefill_engines if side == "prefill" else self.cfg.decode_engines
        return [e for e in range(n) if self.engine_model[(side, e)] == model and (side, e) not in self.dead_engines]

    def _open_request(self) -> None:
        cfg, rng = self.cfg, self.rng
        rid = self._next_rid
        self._next_rid += 1
        model = cfg.models[rid % len(cfg.models)]
        pes, des = self._engines_of("prefill", model), self._engines_of("decode", model)
        if not pes or not des:   # every engine of the model lost a rank: the router has nowhere to send it
            self.refused += 1
            return
        pe, de = rng.choice(pes), rng.choice(des)
        room = self._free_rooms.pop(0) if cfg.reuse and len(self._free_rooms) > 64 else next(self._room_ids)
        n = rng.randint(*cfg.pages)
        k = rng.randint(1, n - 1) if n > 1 and rng.random() < cfg.prefix else 0
        req = Request(rid, room, model, pe, de, n, k, self.now, src_base=rng.randrange(1 << 20),
                      dst_base=rng.randrange(1 << 20))
        self.requests.append(req)
        self.open[room] = req
        self.peak_in_flight = max(self.peak_in_flight, len(self.open))
        # the prefill engine creates its senders when the request arrives
        for gid in self.engines[("prefill", pe)]:
            rank = self.ranks[gid]
            rank.rooms[room] = self.core(PrefillRoom, room=room, num_pages=n, layout=rank.layout, me=rank.key.incarnation,
                                         now=self.now, timeouts=cfg.timeouts, op_ids=self.op_ids,
                                         stale=rank.used_sessions.get(room))
            rank.finished.pop(room, None)
            req.open_rooms += 1
        for gid in self.engines[("prefill", pe)]:   # what came for it before it existed
            for item in self.ranks[gid].parked.pop(room, []):
                self._prefill_item(gid, item, req)
        # its forward passes give the chunks (layer by layer for some requests)
        nchunks = min(n, rng.randint(*cfg.chunks))
        cuts = sorted(rng.sample(range(1, n), nchunks - 1)) if nchunks > 1 else []
        bounds = [0, *cuts, n]
        layerwise = rng.random() < cfg.layerwise
        t = self.now
        for i in range(nchunks):
            dt = rng.uniform(*cfg.chunk_s)
            lo, hi = bounds[i], bounds[i + 1]
            if layerwise:
                step = rng.choice((1, 2))
                for j, l0 in enumerate(range(0, model.layers, step)):
                    lt = t + dt * (j + 1) / -(-model.layers // step)
                    self.at(lt, "chunk", room, rid, lo, hi, None, range(l0, min(l0 + step, model.layers)))
            else:
                self.at(t + dt, "chunk", room, rid, lo, hi, i == nchunks - 1, None)
            t += dt
        # the decode engine gets the request a little later
        self.at(self.now + rng.uniform(0.0, 0.03), "decode_init", room, rid)
        if rng.random() < cfg.aborts:
            side = rng.choice(("prefill", "decode"))
            gid = rng.choice(self.engines[(side, pe if side == "prefill" else de)])
            self.at(self.now + rng.uniform(0.0, t - self.now + 0.01), "abort", gid, room, rid)

    def _req(self, room: int, rid: int) -> Request | None:
        req = self.open.get(room)
        return req if req is not None and req.rid == rid else None

    def _ev_chunk(self, room: int, rid: int, lo: int, hi: int, last: bool | None, layers: range | None) -> None:
        req = self._req(room, rid)
        if req is None:
            return
        for gid in self.engines[("prefill", req.pe)]:
            rank = self.ranks[gid]
            r = rank.rooms.get(room)
            if r is None or not rank.alive:
                continue
            pages = np.arange(req.src_base + lo, req.src_base + hi, dtype=np.int64)
            self.apply(gid, self.core(r.add_chunk, pages, last, self.now, layers=layers), req)

    def _ev_decode_init(self, room: int, rid: int) -> None:
        req = self._req(room, rid)
        if req is None:
            return
        cfg = self.cfg
        pranks = self.engines[("prefill", req.pe)]
        ptp = len(pranks)
        for gid in self.engines[("decode", req.de)]:
            rank = self.ranks[gid]
            if not rank.alive:
                continue
            m = self.mapping(req.model, ptp, len(self.engines[("decode", req.de)]))
            # the rendezvous lookup of the prefill engine, once (again when a rank of it was lost)
            state = rank.lookups.get(req.pe)
            if needs_lookup(state, False):
                self.lookups += 1
                rank.lookups[req.pe] = LookupState.READY
            writers, notices = m.prefill_peers_of(rank.tp_rank)
            r = self.core(DecodeRoom, room=room, session=next(self._sessions), me=rank.key.incarnation,
                          layout=rank.layout, now=self.now, timeouts=cfg.timeouts)
            rank.rooms[room] = r
            req.open_rooms += 1
            n = req.n - req.k
            req.cover[gid] = np.zeros((req.n, req.model.layers, rank.layout.local_heads), dtype=np.int8)
            dst = req.dst_base + (n - 1 - np.arange(n, dtype=np.int64))   # descending: request page i+k -> dst[i]
            dead = [self.ranks[pranks[p]].key for p in writers + notices if not self.ranks[pranks[p]].alive]
            if dead:   # the shell: a needed rank is gone (its connection fails): the plan fails
                self.apply(gid, self.core(r.on_plan_failed, FailureKind.PEER_LOST, f"prefill rank {dead[0]} is gone", self.now), req)
                self.apply(gid, self.core(r.init, dst, self.now, prefix_pages=req.k), req)
                continue
            for p in writers + notices:
                self._connect(gid, pranks[p], staging=not req.model.mla)
            plan = self._plan(req, rank, m, writers, notices, pranks)
            self.apply(gid, self.core(r.on_plan, plan, self.now), req)
            self.apply(gid, self.core(r.init, dst, self.now, prefix_pages=req.k), req)

    def _plan(self, req: Request, rank: Rank, m: HeadMapping, writers: list[int], notices: list[int],
              pranks: list[int]) -> RoomPlan:
        cfg, model = self.cfg, req.model
        assigns = tuple((self.ranks[pranks[p]].key, m.find(p, rank.tp_rank)) for p in writers)
        nkv = 1 if model.mla else 2
        hpb = nkv * model.layers * model.page_size * model.head_dim * 2
        staged = rank.ring is not None and len(pranks) != rank.layout.tp_size and not model.mla
        mpp = max_piece_pages([hpb * a.num_heads for _, a in assigns], cfg.buffer_bytes, cfg.ring_bytes,
                              cfg.ring_align) if staged else 0
        # the rank's planner hands every room of one shape the same (immutable) plan
        return rank.plans.intern(RoomPlan(
            writers=assigns, notices=tuple(self.ranks[pranks[p]].key for p in notices), staged=staged,
            head_page_bytes=hpb, num_layers=model.layers, max_piece_pages=mpp, ring_epoch=rank.key.incarnation,
            ring_size=cfg.ring_bytes, buffer_bytes=cfg.buffer_bytes, piece_bytes=cfg.buffer_bytes if staged else 0,
            ring_align=cfg.ring_align, prefill_tp=len(pranks), decode_tp=rank.layout.tp_size))

    def _connect(self, d: int, p: int, staging: bool) -> None:
        dr = self.ranks[d]
        if p in dr.peers:
            return
        dr.peers.add(p)
        self.ranks[p].peers.add(d)
        self.setup_msgs["Hello"] += 1
        self.setup_msgs["HelloAck"] += 1
        if staging and dr.ring is not None:
            dr.staging_peers.add(p)
            self.remote_wm[(p, d)] = RemoteWatermark(dr.key.incarnation, dr.ring.size)

    # -- the shell: actions ------------------------------------------------------------------
    def apply(self, gid: int, actions: list[Any], req: Request | None) -> None:
        failed = False
        for a in actions:
            if isinstance(a, Send):
                self.send(gid, self.by_key.get(a.peer), a.msg)
            elif isinstance(a, PostWrite):
                self._post(gid, a.op)
            elif isinstance(a, Scatter):
                nbytes = sum(p.nbytes for p in a.parts)
                self.at(self.now + 10e-6 + nbytes / 200e9, "scatter", gid, a)
            elif isinstance(a, PublishWatermark):
                self._publish(gid)
            elif isinstance(a, Released):
                self._released(gid, req)
            elif isinstance(a, StatusChanged) and a.state is KVPoll.Failed:
                failed = True
        if failed and req is not None and self.ranks[gid].side == "prefill":
            self._cancel_queued(gid, req)

    def _cancel_queued(self, p: int, req: Request) -> None:
        """What the prefill shell does for a failed room: its queued writes (staged writes
        waiting for ring space) are never posted."""
        r = self.ranks[p].rooms.get(req.room)
        for (src, d), ops in list(self.waiting.items()):
            if src != p or not ops:
                continue
            mine = [op for op in ops if op.room == req.room]
            if not mine:
                continue
            self.waiting[(src, d)] = [op for op in ops if op.room != req.room]
            for op in mine:
                if r is not None:
                    self.apply(p, self.core(r.on_write_done, op.op_id, False, "cancelled", self.now), req)

    def send(self, src: int, dst: int | None, msg: Any) -> None:
        name = type(msg).__name__
        self.msgs[name] += 1
        self.msg_bytes[name] += len(self._encoder.encode(msg)) + MAC_BYTES
        self.msgs_by_rank[src] += 1
        if dst is None:
            return
        at = self.net.arrival((src, dst), self.now)
        if at is not None:
            self.at(at, "msg", src, dst, msg)

    def _publish(self, d: int) -> None:
        """What the decode shell does when its ring's watermark moved (engine/decode_side.py,
        publish_watermark): tell the writers of its staged rooms in flight (or, as before
        watermark_fanout.py, every connected prefill rank that stages)."""
        rank = self.ranks[d]
        assert rank.ring is not None
        wm = rank.ring.watermark
        self._ring_sample(d)
        if self.cfg.watermark_to_all:
            to = sorted(rank.staging_peers)
        else:
            told = rank.fanout.publish(pending_parts(rank.rooms.values()), wm.linear(rank.ring.size), rank.ring.size)
            to = [g for g in (self.by_key_inc[i] for i in told) if g in rank.staging_peers]
        for p in to:
            self._tell_watermark(d, p)

    def _tell_watermark(self, d: int, p: int) -> None:
        rank = self.ranks[d]
        assert rank.ring is not None
        wm = rank.ring.watermark
        self.send(d, p, WatermarkUpdate(src=rank.key.incarnation, dst=self.ranks[p].key.incarnation,
                                        epoch=rank.key.incarnation, round=wm.round, tail=wm.tail))

    def _ring_sample(self, d: int) -> None:
        ring = self.ranks[d].ring
        assert ring is not None
        occ = self.ring_occ[d]
        occ[0] += (self.now - occ[1]) * ring.occupied_bytes
        occ[1] = self.now
        occ[2] = max(occ[2], ring.occupied_bytes)

    def _released(self, gid: int, req: Request | None) -> None:
        rank = self.ranks[gid]
        if req is None:
            return
        r = rank.rooms.pop(req.room, None)
        if r is None:
            return
        rank.finished[req.room] = (r.state, r.failure_kind or "gone", r.failure or "it succeeded",
                                   getattr(r, "session", 0), r.ended_at if r.ended_at is not None else self.now)
        if rank.side == "prefill":
            if r.state is KVPoll.Success:
                rank.served[req.room] = frozenset((f.peer.incarnation, f.session) for f in r.flows.values())
            rank.used_sessions[req.room] = r.stale.plus(r.sessions())
        req.outcome[gid] = (r.state, r.failure)
        if r.state is KVPoll.Failed:
            req.failed_at = max(req.failed_at, self.now)
        req.open_rooms -= 1
        if req.open_rooms == 0:
            self._close(req)

    def _close(self, req: Request) -> None:
        req.closed = self.now
        if req.death is not None and any(s is KVPoll.Failed for s, _ in req.outcome.values()):
            self.fail_after_death.append(req.failed_at - req.death)
        del self.open[req.room]
        self._free_rooms.append(req.room)
        while self._next_rid < self.cfg.requests and len(self.open) < self.cfg.in_flight:
            self._open_request()

    # -- writes, tags, scatters --------------------------------------------------------------
    def _post(self, p: int, op: Any) -> None:
        d = self.by_key.get(op.peer)
        if d is None:
            return
        if op.staged:
            view = self.remote_wm.get((p, d))
            if view is None or not view.allows(op.ring_start + op.writer_offset, op.nbytes):
                self.waiting[(p, d)].append(op)
                return
        self.at(self.now + 20e-6 + op.nbytes / 25e9, "land", p, d, op)

    def _ev_land(self, p: int, d: int, op: Any) -> None:
        prank = self.ranks[p]
        if not prank.alive:
            return
        drank = self.ranks[d]
        req = self.open.get(op.room)
        if drank.alive and req is not None and req.de == drank.engine and req.pe == prank.engine:
            if op.staged:
                self._land_in_ring(d, op)
            else:
                self._cover(req, p, d, op.src_pages, op.dst_pages, op.layers, op.src_heads, op.dst_heads, "write")
            self.at(self.now + 5e-6, "tag", d, prank.key, op.tag)
        r = prank.rooms.get(op.room)
        if r is not None:
            self.apply(p, self.core(r.on_write_done, op.op_id, True, None, self.now), req)

    def _cover(self, req: Request, p: int, d: int, src: np.ndarray, dst: np.ndarray, layers: range,
               src_heads: tuple[int, int], dst_heads: tuple[int, int], what: str) -> None:
        """Mark the cells a write or scatter filled; each must come from its own source page."""
        n = req.n - req.k
        q_src = src - req.src_base
        q_dst = req.k + (req.dst_base + n - 1 - dst)
        prank, drank = self.ranks[p], self.ranks[d]
        a = self.mapping(req.model, prank.layout.tp_size, drank.layout.tp_size).find(prank.tp_rank, drank.tp_rank)
        if (q_src.shape != q_dst.shape or not np.array_equal(q_src, q_dst) or a is None
                or dst_heads[1] - dst_heads[0] != src_heads[1] - src_heads[0]
                or src_heads[0] - a.src_heads[0] != dst_heads[0] - a.dst_heads[0]):
            self.bad_writes.append(f"{what} of room {req.room} from {prank.key} to {drank.key}: source pages "
                                   f"{q_src.tolist()} heads {src_heads} into request pages {q_dst.tolist()} heads {dst_heads}")
            return
        req.cover[d][q_dst, layers.start:layers.stop, dst_heads[0]:dst_heads[1]] += 1

    def _land_in_ring(self, d: int, op: Any) -> None:
        ring = self.ranks[d].ring
        assert ring is not None
        starts, entries = self.ring_data[d]
        off = op.ring_start % ring.size + op.writer_offset
        end = off + op.nbytes
        i = bisect.bisect_right(starts, off) - 1
        i = max(i, 0)
        while i < len(starts) and starts[i] < end:
            s = starts[i]
            e = entries[s]
            if e.end > off:   # overlaps: only bytes of a freed region may be overwritten
                if ring.holds(e.region) and e.region != op.ring_start:
                    self.overlaps += 1
                del entries[s]
                starts.pop(i)
                continue
            i += 1
        bisect.insort(starts, off)
        entries[off] = RingEntry(end, op.ring_start, op)

    def _ev_tag(self, d: int, peer: PeerKey, tag: Any) -> None:
        rank = self.ranks[d]
        r = rank.rooms.get(tag.room) if rank.alive else None
        if r is not None:
            self.apply(d, self.core(r.on_tag, peer, tag, self.now).actions, self.open.get(tag.room))

    def _ev_scatter(self, d: int, s: Scatter) -> None:
        rank = self.ranks[d]
        if not rank.alive:
            return
        req = self.open.get(s.room)
        r = rank.rooms.get(s.room)
        if req is None or r is None:
            return
        _, entries = self.ring_data[d]
        assert rank.ring is not None
        for part in s.parts:
            e = entries.get(part.region_offset)
            if (e is None or e.op.room != s.room or e.op.nbytes != part.nbytes or e.op.layers != s.layers
                    or e.op.dst_heads != part.dst_heads or not rank.ring.holds(e.region)):
                self.bad_scatters.append(f"room {s.room} piece {s.key} at {rank.key}: ring offset {part.region_offset} "
                                         f"holds {e.op if e else None}")
                continue
            p = self.by_key_writer(e.op, req)
            self._cover(req, p, d, e.op.src_pages, s.dst_pages, s.layers, e.op.src_heads, part.dst_heads, "scatter")
        self.apply(d, self.core(r.on_scattered, s.key, True, None, rank.ring, self.now), req)
        self._ring_sample(d)

    def by_key_writer(self, op: Any, req: Request) -> int:
        """The prefill rank that posted `op` (its tag names the writer's TP rank)."""
        return self.engines[("prefill", req.pe)][op.tag.writer]

    # -- messages ----------------------------------------------------------------------------
    def _ev_msg(self, src: int, dst: int, msg: Any) -> None:
        rank = self.ranks[dst]
        if not rank.alive or src not in rank.peers:
            return   # the sender was declared lost: the shell drops what it still gets from it
        skey = self.ranks[src].key
        if isinstance(msg, WatermarkUpdate):
            view = self.remote_wm.get((dst, src))
            if view is not None and view.update(msg.epoch, Watermark(msg.round, msg.tail)):
                self._retry_waiting(dst, src)
            return
        room = msg.room
        req = self.open.get(room)
        r = rank.rooms.get(room)
        if rank.side == "prefill":
            if isinstance(msg, (RoomMeta, RoomFailed)):
                answered = self._prefill_item(dst, Parked(skey, msg), req)
                if isinstance(msg, RoomMeta) and not answered:   # engine/prefill_side.py on_RoomMeta
                    self.send(dst, src, MetaAck(src=rank.key.incarnation, dst=skey.incarnation, room=room,
                                                session=msg.session))
                return
            if r is None:
                return
            if isinstance(msg, AllocGrant):
                w = self._alloc_asked.pop((dst, src, room, msg.chunk), None)
                if w is not None:
                    self.grant_wait[dst].append(self.now - w)
                out = self.core(r.on_grant, skey, msg, self.now)
            elif isinstance(msg, RoomDone):
                out = self.core(r.on_room_done, skey, msg.session, self.now)
            else:
                raise AssertionError(f"prefill got {msg}")
        else:
            if r is None:
                if isinstance(msg, (AllocRequest, WriterDone, TagsAgain)):
                    self._answer_finished(dst, src, room, msg.session, writer_done=isinstance(msg, WriterDone))
                return
            if isinstance(msg, AllocRequest):
                self._alloc_asked.setdefault((src, dst, room, msg.chunk), self.now)
                assert rank.ring is not None
                if not self.cfg.watermark_to_all and rank.fanout.before_grant(
                        skey.incarnation, rank.ring.watermark.linear(rank.ring.size)):
                    self._tell_watermark(dst, src)   # its view may be old: before its grant
                out = self.core(self.ring_path.on_alloc_request, r, skey, msg, rank.ring, self.now)
                for a in out:
                    if isinstance(a, Send) and isinstance(a.msg, AllocGrant):
                        self.grants[dst][src] += sum(p.region_nbytes for p in a.msg.pieces)
                self._ring_sample(dst)
            elif isinstance(msg, WriterDone):
                out = self.core(r.on_writer_done, skey, msg, self.now)
            elif isinstance(msg, RoomFailed):
                out = self.core(r.on_room_failed, skey, msg.session, msg.kind, msg.reason, self.now)
            elif isinstance(msg, Quiesced):
                out = self.core(r.on_quiesced, skey, msg.session, rank.ring, self.now)
            elif isinstance(msg, MetaAck):
                self.core(r.on_meta_ack, skey, msg.session)
                out = []
            elif isinstance(msg, TagsAgain):
                out = []   # the fleet loses no notification: its writers never need to repeat tags
            else:
                raise AssertionError(f"decode got {msg}")
        self.apply(dst, out, req if req is not None and isinstance(msg, RoomMessage) else None)

    def _prefill_item(self, p: int, item: Parked, req: Request | None) -> bool:
        """The prefill shell's handling of metadata and failures (engine/prefill_side.py, _input
        and _item): to the sender, or parked for one not created yet, or answered for a room
        that is over here. True when the room's actions answer the metadata (no MetaAck)."""
        rank = self.ranks[p]
        msg, key, room = item.msg, item.peer, item.msg.room
        src = self.by_key[key]
        r = rank.rooms.get(room)
        if r is not None:
            if isinstance(msg, RoomMeta):
                use = r.meta_use(key, msg.session)
                if use is RoomUse.STALE:
                    return False
                if use is RoomUse.NEXT:
                    rank.parked.setdefault(room, []).append(item)
                    return False
                out = self.core(r.add_meta, key, self.ranks[src].layout.tp_size, msg, self.now)
                self.apply(p, out, req)
                return answers_meta(out, key)
            out = self.core(r.on_room_failed, key, msg.session, msg.kind, msg.reason, self.now)
            self.apply(p, out, req)
            return False
        me = rank.key.incarnation
        if not item.is_meta:   # nothing of ours for this room is in flight to that peer
            self.send(p, src, Quiesced(src=me, dst=key.incarnation, room=room, session=msg.session))
        use = use_without_sender(item, ended=room in rank.finished, earlier=rank.used_sessions.get(room, EarlierUses()),
                                 served=rank.served.get(room, ()))
        if use is RoomUse.OVER and item.is_meta:   # the decode side must not wait for a room that is over here
            _, kind, why, _, _ = rank.finished[room]
            self.send(p, src, RoomFailed(src=me, dst=key.incarnation, room=room, session=msg.session, kind=kind,
                                         reason=f"the prefill sender of this room has finished: {why}"))
            self.send(p, src, Quiesced(src=me, dst=key.incarnation, room=room, session=msg.session))
        if use is RoomUse.NEXT:
            rank.parked.setdefault(room, []).append(item)
        return False

    def _answer_finished(self, d: int, p: int, room: int, session: int, writer_done: bool = False) -> None:
        """The decode shell: a writer still asks about a room that is over here (to a WriterDone
        only when the writer asks again: room_uses.writer_done_answer)."""
        rank = self.ranks[d]
        done = rank.finished.get(room)
        if done is None:
            return
        state, kind, why, last, ended_at = done
        if writer_done:
            answer = writer_done_answer(succeeded=state is KVPoll.Success, kind=kind, reason=why, last_session=last,
                                        session=session, room=room, ended_at=ended_at, now=self.now,
                                        retry=self.cfg.timeouts.heartbeat)
            if answer is None:
                return
        else:
            answer = ended_answer(succeeded=state is KVPoll.Success, kind=kind, reason=why, last_session=last,
                                  session=session, room=room)
        me, dst = rank.key.incarnation, self.ranks[p].key.incarnation
        if answer.kind is None:
            self.send(d, p, RoomDone(src=me, dst=dst, room=room, session=session))
        else:
            self.send(d, p, RoomFailed(src=me, dst=dst, room=room, session=session, kind=answer.kind,
                                       reason=answer.reason))

    def _retry_waiting(self, p: int, d: int) -> None:
        ops = self.waiting.get((p, d))
        if not ops:
            return
        view = self.remote_wm[(p, d)]
        still = []
        for op in ops:
            if view.allows(op.ring_start + op.writer_offset, op.nbytes):
                self.at(self.now + 20e-6 + op.nbytes / 25e9, "land", p, d, op)
            else:
                still.append(op)
        self.waiting[(p, d)] = still

    # -- time --------------------------------------------------------------------------------
    def _ev_tick(self) -> None:
        for rank in self.ranks:
            if not rank.alive or not rank.rooms:
                continue
            for room, r in list(rank.rooms.items()):
                req = self.open.get(room)
                if rank.side == "prefill":
                    out = self.core(r.tick, self.now)
                else:
                    out = self.core(r.tick, rank.ring, self.now)
                self.apply(rank.gid, out, req)
        # heartbeats carry the watermark: a lost WatermarkUpdate costs at most a heartbeat
        for (p, d), ops in list(self.waiting.items()):
            if ops and self.ranks[d].alive and self.net.arrival(("hb", p, d), self.now) is not None:
                ring = self.ranks[d].ring
                assert ring is not None
                if self.remote_wm[(p, d)].update(self.ranks[d].key.incarnation, ring.watermark):
                    self._retry_waiting(p, d)
        if self.open or self._next_rid < self.cfg.requests:
            self.at(self.now + self.cfg.tick_s, "tick")

    def _ev_hook(self, fn: Any) -> None:
        """A caller's measurement at a chosen time (its time is not the fleet's)."""
        t = time.perf_counter()
        fn()
        self.hook_s += time.perf_counter() - t

    def _ev_abort(self, gid: int, room: int, rid: int) -> None:
        req = self._req(room, rid)
        rank = self.ranks[gid]
        r = rank.rooms.get(room) if req is not None and rank.alive else None
        if r is None:
            return
        out = self.core(r.abort, self.now) if rank.side == "prefill" else self.core(r.abort, rank.ring, self.now)
        self.apply(gid, out, req)

    def _ev_death_plan(self) -> None:
        """Kill `deaths` ranks of engines with requests in flight, spaced a little apart."""
        busy = sorted({(s, e) for req in self.open.values() for s, e in (("prefill", req.pe), ("decode", req.de))})
        self.rng.shuffle(busy)
        for i in range(self.cfg.deaths):
            side = "prefill" if i % 2 == 0 else "decode"
            engines = [x for x in busy if x[0] == side] or busy
            if not engines:
                return
            eng = engines[i % len(engines)]
            self.at(self.now + 0.01 * i, "death", self.rng.choice(self.engines[eng]))

    def _ev_death(self, gid: int) -> None:
        rank = self.ranks[gid]
        if not rank.alive:
            return
        rank.alive = False
        self.deaths.append((self.now, gid))
        self.dead_engines.add((rank.side, rank.engine))
        for req in self.open.values():
            if rank.rooms.get(req.room) is not None:
                req.death = self.now
        # its rooms are gone with it
        for room in list(rank.rooms):
            req = self.open.get(room)
            rank.rooms.pop(room)
            if req is not None:
                req.outcome[gid] = (KVPoll.Failed, "died")
                req.failed_at = max(req.failed_at, self.now)
                req.open_rooms -= 1
                if req.open_rooms == 0:
                    self._close(req)
        # each peer hears its last heartbeat somewhere in the pair's last interval (leases.py:
        # longer for ranks with many peers), and its control loop judges the lease at each tick
        t_ = self.cfg.timeouts
        own = heartbeat_interval(len(rank.peers), base=t_.heartbeat, lease=t_.lease)
        for peer in sorted(rank.peers):
            theirs = heartbeat_interval(len(self.ranks[peer].peers), base=t_.heartbeat, lease=t_.lease)
            hb = pair_interval(own, theirs, t_.lease)
            lease = Lease(self.cfg.timeouts.lease, self.now - self.rng.uniform(0.0, hb))
            t = self.now + self.rng.uniform(0.0, self.cfg.tick_s)
            while lease.alive(t):
                t += self.cfg.tick_s
            self.at(t, "lost", peer, gid)

    def _ev_lost(self, gid: int, dead: int) -> None:
        rank = self.ranks[gid]
        if not rank.alive or dead not in rank.peers:
            return
        self.detect.append(self.now - next(t for t, g in self.deaths if g == dead))
        rank.peers.discard(dead)
        rank.staging_peers.discard(dead)
        rank.fanout.forget(self.ranks[dead].key.incarnation)
        self.ranks[dead].peers.discard(gid)
        if rank.side == "decode":
            rank.lookups.pop(self.ranks[dead].engine, None)   # the records name a lost rank: look up again
        key = self.ranks[dead].key
        for room, r in list(rank.rooms.items()):
            req = self.open.get(room)
            if rank.side == "prefill":
                out = self.core(r.on_peer_lost, key, "lease expired", self.now)
            else:
                out = self.core(r.on_peer_lost, key, "lease expired", rank.ring, self.now)
            self.apply(gid, out, req)
        self.waiting.pop((gid, dead), None)
        self.waiting.pop((dead, gid), None)

    # -- the verdict ---------------------------------------------------------------------------
    def check(self) -> list[str]:
        """Every invariant at the end of the run; the broken ones, each with an example."""
        bad: list[str] = []
        if self.open:
            req = next(iter(self.open.values()))
            bad.append(f"{len(self.open)} requests never ended, e.g. room {req.room}: "
                       + ", ".join(f"{self.ranks[g].key} {r.state.name}" for g in
                                   self.engines[("prefill", req.pe)] + self.engines[("decode", req.de)]
                                   for r in [self.ranks[g].rooms.get(req.room)] if r is not None))
        left = [(rank.key, room) for rank in self.ranks if rank.alive for room in rank.rooms]
        if left:
            bad.append(f"{len(left)} rooms not released, e.g. {left[0]}")
        for req in self.requests:
            for gid, (state, failure) in req.outcome.items():
                if state not in DONE:
                    bad.append(f"room {req.room} at {self.ranks[gid].key} released in {state.name}")
                elif state is KVPoll.Failed and not failure:
                    bad.append(f"room {req.room} at {self.ranks[gid].key} failed without a reason")
            for gid, cover in req.cover.items():
                if req.outcome.get(gid, (None,))[0] is not KVPoll.Success:
                    continue
                if (cover[req.k:] != 1).any() or (cover[:req.k] != 0).any():
                    bad.append(f"room {req.room} succeeded at {self.ranks[gid].key} with cells written "
                               f"{int((cover[req.k:] == 0).sum())} times none, {int((cover[req.k:] > 1).sum())} "
                               f"more than once, {int((cover[:req.k] != 0).sum())} in the prefix")
            pranks = self.engines[("prefill", req.pe)]
            dranks = self.engines[("decode", req.de)]
            m = self.mapping(req.model, len(pranks), len(dranks))
            for p in pranks:
                if req.outcome.get(p, (None,))[0] is not KVPoll.Success:
                    continue
                for a in m.for_prefill(self.ranks[p].tp_rank):
                    d = dranks[a.decode_rank]
                    if self.ranks[d].alive and req.outcome.get(d, (None,))[0] is not KVPoll.Success:
                        bad.append(f"room {req.room}: {self.ranks[p].key} succeeded, its decode peer "
                                   f"{self.ranks[d].key} ended {req.outcome.get(d)}")
        if self.overlaps:
            bad.append(f"{self.overlaps} staged writes landed on ring bytes another piece still held")
        bad += self.bad_writes[:5] + self.bad_scatters[:5]
        for rank in self.ranks:
            if rank.alive and rank.ring is not None and rank.ring.live_regions:
                bad.append(f"ring of {rank.key} still holds {rank.ring.live_regions} regions")
        return bad
