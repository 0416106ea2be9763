"""The control thread of one rank: sockets, the backend, peers, leases, and the rooms' state
machines.

It owns the zmq sockets, the backend (through BackendOwner) and every room object, so none of
them needs a lock, and a request crosses as few threads as possible. Other threads reach it only
through the EventQueue (user calls, write completions from the transfer workers, scatters,
engine lookups). Each input is handed to the pure state machine it concerns, and the actions
that come back are carried out here: messages sent, writes posted or queued until the decode
ring's watermark allows them, scatters submitted, statuses published.

While writes are in flight or tags are expected it polls the backend every loop and waits at
most MAX_EAGER_WAIT for the sockets; otherwise it sleeps in the poller until a message, an
event or the next tick.
"""

from __future__ import annotations

import itertools
import logging
import select
import threading
import time
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

import zmq

from ...bootstrap.wire import WireError
from ...staging.handler import StagingHandler
from ...staging.ring import Watermark
from ...staging.scatter_worker import ScatterJob, ScatterWorker
from ...staging.workers import GatherJob, TransferWorkers

from ..config import EngineConfig
from ..layout import KVBuffers, KVLayout, LayoutSummary
from ..poll import KVPoll
from ..protocol.actions import (Dropped, PeerKey, PostWrite, PublishWatermark, Released, Scatter, Send, StatusChanged,
                                WriteOp)
from ..protocol.decode_room import DecodeRoom, WriterOffer, plan_room
from ..protocol.direct_ranges import CacheGeometry, direct_descriptors
from ..protocol.head_mapping import compute_assignments
from ..protocol.leases import Lease
from ..protocol.messages import (AllocGrant, AllocRequest, Goodbye, Heartbeat, Hello, HelloAck, KVMemory, MetaAck,
                                 PeerMessage, Quiesced, RingInfo, RoomDone, RoomFailed, RoomMeta, WatermarkUpdate,
                                 WriterDone)
from ..protocol.prefill_room import PrefillRoom
from ..protocol.tags import TagCodec
from .backend_owner import BackendOwner
from .control_socket import ControlSocket
from .events import (Abort, Call, EventQueue, InitReceiver, LookupDone, NewReceiver, NewSender, ScatterDone,
                     SendChunk, Wake, WriteDone)
from .stats import Stats

log = logging.getLogger("kvstage")

TICK = 0.1                 # deadlines, retransmissions, heartbeats and leases are all seconds-scale
MIN_EAGER_WAIT = 20e-6     # backend polling interval while writes are in flight or tags expected,
MAX_EAGER_WAIT = 200e-6    # backing off to this when nothing happens
_OP_IDS = itertools.count(1)  # write ids, unique in the process
FINISHED_MEMORY = 65536
MAX_PENDING_ROOMS = 65536


@dataclass
class Peer:
    key: PeerKey
    role: str
    tp_size: int
    endpoint: str
    lease: Lease
    state: str = "connecting"          # connecting | connected | rejected | lost
    backend_name: str = ""
    staging: bool = False
    buffer_bytes: int = 0
    kv: KVMemory | None = None         # prefill side: where the decode rank's pages are
    ring: RingInfo | None = None       # prefill side: the decode rank's ring
    reason: str = ""
    since: float = 0.0


@dataclass
class EngineView:
    """Decode side: a prefill engine as the bootstrap server described it."""

    engine_id: str
    state: str = "lookup"              # lookup | ready | failed
    records: list = field(default_factory=list)
    error: str = ""
    rooms: set = field(default_factory=set)
    tombstones: list = field(default_factory=list)  # rooms that failed before their metadata went out


class EngineLoop:
    def __init__(self, cfg: EngineConfig, layout: KVLayout, buffers: KVBuffers, me: int,
                 backend: BackendOwner, backend_name: str, identity: bytes, handler: StagingHandler,
                 stats: Stats, lookup: Callable[[str, float], list], codec, ctx: zmq.Context,
                 control_faults: Any = None):
        self.cfg, self.layout, self.buffers, self.me = cfg, layout, buffers, me
        self.t = cfg.timeouts
        self.role = cfg.role
        self.backend, self.backend_name, self.identity = backend, backend_name, identity
        self.handler, self.stats, self._lookup = handler, stats, lookup
        self.events = EventQueue()
        self.sock = ControlSocket(ctx, cfg.host, cfg.ctrl_port, codec, control_faults)
        self.tags = TagCodec(cfg.token_bytes)
        self.summary: LayoutSummary = layout.summary()
        device = (buffers.device.index or 0) if buffers.device.type == "cuda" else 0
        self.geometry = CacheGeometry(tuple(t.data_ptr() for t in buffers.tensors()), layout.page_size,
                                      layout.token_bytes, layout.head_bytes, device)
        self._fallback_logged: set[tuple[str, str]] = set()
        self.peers: dict[int, Peer] = {}
        self.by_rank: dict[tuple[str, int], int] = {}
        self.by_backend: dict[str, int] = {}
        self.gone: OrderedDict[int, str] = OrderedDict()            # incarnations lost (may reconnect)
        self.gone_endpoint: dict[int, str] = {}                     # ... and where to tell them so
        self._told_gone: dict[int, float] = {}
        self.replaced: OrderedDict[int, None] = OrderedDict()       # superseded by a newer one: never again
        self.rooms: dict[int, Any] = {}
        self.status: dict[int, Any] = {}
        self.finished: OrderedDict[int, tuple[KVPoll, str, str]] = OrderedDict()  # room -> (state, kind, reason)
        self.served: dict[int, frozenset] = {}  # prefill: room that succeeded -> its (decode incarnation, session)s
        self.used_sessions: dict[int, frozenset] = {}  # prefill: finished room -> its sessions (stale for the next use)
        self.pending: dict[int, list] = defaultdict(list)          # prefill: room -> early messages
        self.pending_since: dict[int, float] = {}
        self.engines: dict[str, EngineView] = {}
        self.engine_of: dict[int, str] = {}                         # decode: room -> prefill engine
        self.waiting: dict[int, list] = defaultdict(list)          # decode peer -> staged ops + queued time
        self.write_deadline: dict[int, tuple[int, float]] = {}     # op id -> (room, deadline)
        self.workers: TransferWorkers | None = None
        self.scatter: ScatterWorker | None = None
        self._eager_rooms: set[int] = set()
        self._next_tick = 0.0
        self._next_heartbeat = 0.0
        self._closing_since: float | None = None
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="kvstage-ctrl", daemon=True)
        if self.role == "prefill" and handler.buffers:
            self.workers = TransferWorkers(handler.buffers, buffers.k, buffers.v, layout.page_size,
                                           backend.submit_write, self._worker_report)
        if self.role == "decode" and handler.ring is not None:
            self.scatter = ScatterWorker(buffers.k, buffers.v, layout.page_size, self._scatter_report)

    # -- thread entry ---------------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        return self.sock.endpoint

    def start(self) -> None:
        self.thread.start()

    def post(self, event: Any) -> None:
        self.events.put(event)

    def _run(self) -> None:
        self.backend.adopt()
        poller = zmq.Poller()
        poller.register(self.sock.router, zmq.POLLIN)
        poller.register(self.events.fd, zmq.POLLIN)
        zfd = self.sock.router.getsockopt(zmq.FD)  # edge-triggered: valid to wait on once drained
        wait = MIN_EAGER_WAIT
        try:
            while not self._stop.is_set():
                if self.backend.eager:
                    select.select([zfd, self.events.fd], [], [], wait)
                else:
                    poller.poll(max(0.0, (self._next_tick - time.monotonic()) * 1000))
                busy = False
                for item in self.sock.recv_batch():
                    busy = True
                    self._safely(self._on_wire, item)
                for ev in self.events.drain():
                    busy = True
                    self._safely(self._on_event, ev)
                tags, progressed = self._step()
                if tags:
                    self._safely(self._on_tags, tags)
                wait = MIN_EAGER_WAIT if busy or progressed else min(wait * 2, MAX_EAGER_WAIT)
                now = time.monotonic()
                if now >= self._next_tick:
                    self._next_tick = now + TICK
                    self._safely(lambda _: self.sock.flush_held(), None)
                    self._safely(self._tick, now)
        finally:
            self._teardown()
            self.backend.release_ownership()

    def _safely(self, fn: Callable, arg: Any) -> None:
        try:
            fn(arg)
        except Exception as exc:  # noqa: BLE001 - one bad input must never take the rank down
            log.exception("control thread: handling %s failed", type(arg).__name__)
            self._internal_error(type(arg).__name__, getattr(arg, "room", None), exc)

    def _step(self) -> tuple[list, bool]:
        """backend.step(), guarded: the loop must go on (deadlines keep firing) when it raises."""
        try:
            return self.backend.step()
        except Exception as exc:  # noqa: BLE001
            log.exception("control thread: driving the backend failed")
            self._internal_error("backend_step", None, exc)
            return [], True

    def _internal_error(self, what: str, room_id: Any, exc: Exception) -> None:
        """Count an exception inside the loop and fail the rooms it may have left stuck, kind
        "internal": the room the input names, else every room with writes in flight (prefill)
        or waiting for the backend's notifications (decode)."""
        self.stats.count("internal_errors", what)
        if isinstance(room_id, int) and not isinstance(room_id, bool):
            ids = [room_id] if room_id in self.rooms else []
        else:
            ids = [r for r, room in self.rooms.items() if getattr(room, "ops", None) or r in self._eager_rooms]
        now = time.monotonic()
        for r in ids:
            room = self.rooms.get(r)
            if room is None:
                continue
            try:
                self._apply(room, room.fail("internal", f"internal error in the control thread ({what}: "
                                                        f"{type(exc).__name__}: {exc})", now))
            except Exception:  # noqa: BLE001
                log.exception("control thread: failing room %s after an internal error failed", r)

    # -- inputs: wire -------------------------------------------------------------------------------
    def _on_wire(self, item: object) -> None:
        now = time.monotonic()
        if isinstance(item, WireError):
            self.stats.count("dropped_messages", item.kind)
            return
        msg: PeerMessage = item
        if isinstance(msg, Hello):
            return self._on_hello(msg, now)
        peer = self.peers.get(msg.src)
        if peer is None:
            stale = msg.src in self.gone or msg.src in self.replaced
            self.stats.count("dropped_messages", "stale_peer" if stale else "unknown_peer")
            if msg.src in self.gone and not isinstance(msg, Goodbye):
                self._tell_gone(msg.src, now)
            return
        if msg.dst != self.me:
            self.stats.count("dropped_messages", "stale_epoch")
            return
        if peer.state == "rejected":
            if isinstance(msg, RoomFailed) and self.role == "prefill":
                self._prefill_input(msg.room, ("failed", peer.key, msg), now)
            return
        peer.lease.heard(now)
        handler = getattr(self, f"_on_{type(msg).__name__}", None)
        if handler is None:
            self.stats.count("dropped_messages", "unexpected")
            return
        handler(peer, msg, now)

    def _tell_gone(self, inc: int, now: float) -> None:
        """A peer we declared lost still talks to us: tell it (at most once a second), so it
        fails what it has with us and connects again."""
        endpoint = self.gone_endpoint.get(inc)
        if endpoint is None or now - self._told_gone.get(inc, -1e9) < 1.0:
            return
        self._told_gone[inc] = now
        self.sock.send(endpoint, Goodbye(src=self.me, dst=inc, reason=f"you were declared lost: {self.gone[inc]}"))

    def _send(self, key: PeerKey, msg: PeerMessage) -> None:
        peer = self.peers.get(key.incarnation)
        if peer is None or peer.state == "lost":
            self.stats.count("dropped_messages", "to_lost_peer")
            return
        if not self.sock.send(peer.endpoint, msg):
            self.stats.count("dropped_messages", "send_queue_full")

    # -- connection handshake -------------------------------------------------------------------------
    def _on_hello(self, msg: Hello, now: float) -> None:
        """Prefill side: a decode rank connects."""
        if self.role != "prefill" or msg.role != "decode" or msg.dst not in (0, self.me):
            self.stats.count("dropped_messages", "unexpected")
            return
        key = PeerKey(msg.engine_id, msg.tp_rank, msg.src)
        old = self.peers.get(msg.src)
        if old is not None and old.state == "connected":
            return self._send_ack(old, True, "")  # a retried Hello: ack again
        if msg.src in self.replaced:
            self.stats.count("dropped_messages", "stale_peer")
            return
        if self.gone.pop(msg.src, None) is not None:
            self.gone_endpoint.pop(msg.src, None)
            log.info("decode rank %s reconnects after it was lost", key)
        self._replace_rank(key, now)
        peer = Peer(key, "decode", msg.tp_size, msg.ctrl_endpoint, Lease(self.t.lease, now), kv=msg.kv,
                    ring=msg.ring, since=now)
        self._index(peer)
        problems = self.summary.mismatches(msg.layout)
        if msg.backend != self.cfg.backend:
            problems.append(f"backend: {self.cfg.backend!r} here vs {msg.backend!r} at peer")
        if not problems:
            try:
                peer.backend_name = self.backend.call(lambda b: b.connect(msg.backend_identity))
            except Exception as exc:  # noqa: BLE001
                problems.append(f"backend connect failed: {exc}")
        if problems:
            peer.state, peer.reason = "rejected", "; ".join(problems)
            log.error("rejecting decode rank %s: %s", key, peer.reason)
            self.stats.count("failures_by_kind", "layout" if not peer.backend_name else "connect")
            return self._send_ack(peer, False, peer.reason)
        self.by_backend[peer.backend_name] = key.incarnation
        self.backend.fence(peer.backend_name, peer.lease.fence_base + peer.lease.lease_s)
        peer.state = "connected"
        peer.staging = bool(msg.staging and msg.ring is not None and self.handler.buffers)
        if peer.staging:
            self.handler.subscribe(key.incarnation, msg.ring.epoch, msg.ring.size)
        elif self.cfg.staging:
            log.info("staging off towards decode rank %s: %s", key,
                     "it has no staging ring" if msg.ring is None or not msg.staging else "no staging buffers here")
        self._send_ack(peer, True, "")

    def _send_ack(self, peer: Peer, ok: bool, reason: str) -> None:
        self.sock.send(peer.endpoint, HelloAck(
            src=self.me, dst=peer.key.incarnation, ok=ok, reason=reason, engine_id=self.cfg.engine_id,
            tp_size=self.layout.tp_size, tp_rank=self.layout.tp_rank, backend_name=self.backend_name,
            staging=bool(ok and peer.staging), buffer_bytes=self.handler.buffer_bytes, lease_s=self.t.lease))

    def _on_HelloAck(self, peer: Peer, msg: HelloAck, now: float) -> None:
        if self.role != "decode" or peer.state != "connecting":
            return
        if not msg.ok:
            peer.state, peer.reason = "rejected", msg.reason
            log.error("prefill rank %s refused the connection: %s", peer.key, msg.reason)
            self._engine_changed(peer.key.engine_id, now)
            return
        peer.state, peer.backend_name = "connected", msg.backend_name
        peer.staging, peer.buffer_bytes = msg.staging, msg.buffer_bytes
        if self.gone.pop(peer.key.incarnation, None) is not None:
            self.gone_endpoint.pop(peer.key.incarnation, None)
            log.info("prefill rank %s reconnected after it was lost", peer.key)
        self.by_backend[msg.backend_name] = peer.key.incarnation
        if self.handler.allocator is not None and peer.staging:
            wm = self.handler.allocator.watermark  # a new subscriber gets the watermark at once
            self._send(peer.key, WatermarkUpdate(src=self.me, dst=peer.key.incarnation, epoch=self.me,
                                                 round=wm.round, tail=wm.tail))
        self._engine_changed(peer.key.engine_id, now)

    def _replace_rank(self, key: PeerKey, now: float) -> None:
        """A rank re-appears with a new incarnation: its previous life is over."""
        old = self.by_rank.get((key.engine_id, key.tp_rank))
        if old is not None and old != key.incarnation:
            if old in self.peers:
                self._peer_lost(self.peers[old], "the rank restarted (new incarnation)", now)
            self.replaced[old] = None
            while len(self.replaced) > FINISHED_MEMORY:
                self.replaced.popitem(last=False)

    def _index(self, peer: Peer) -> None:
        self.peers[peer.key.incarnation] = peer
        self.by_rank[(peer.key.engine_id, peer.key.tp_rank)] = peer.key.incarnation

    def _hello(self) -> Hello:
        kv = KVMemory(k_addrs=[t.data_ptr() for t in self.buffers.k],
                      v_addrs=[t.data_ptr() for t in self.buffers.v] if self.buffers.v is not None else [],
                      num_pages=self.buffers.num_pages, page_stride=self.layout.page_bytes,
                      token_stride=self.layout.token_bytes,
                      mem_kind="VRAM" if self.buffers.device.type == "cuda" else "DRAM",
                      device=self.geometry.device)
        ring = None
        if self.handler.ring is not None:
            r = self.handler.ring
            ring = RingInfo(addr=r.addr, size=self.handler.allocator.size, epoch=self.me, mem_kind=r.kind,
                            device=r.device)
        return Hello(src=self.me, engine_id=self.cfg.engine_id, role=self.role, tp_size=self.layout.tp_size,
                     tp_rank=self.layout.tp_rank, ctrl_endpoint=self.endpoint, backend=self.cfg.backend,
                     backend_identity=self.identity, layout=self.summary, kv=kv, ring=ring,
                     staging=bool(self.cfg.staging and ring is not None), lease_s=self.t.lease)

    # -- decode: engines, peers, plans ------------------------------------------------------------------
    def _engine(self, engine_id: str, now: float) -> EngineView:
        view = self.engines.get(engine_id)
        if view is None or view.state == "failed" or (view.state == "ready" and self._stale(view)):
            rooms = view.rooms if view is not None else set()
            tombs = view.tombstones if view is not None else []
            view = EngineView(engine_id, rooms=rooms, tombstones=tombs)
            self.engines[engine_id] = view
            threading.Thread(target=self._do_lookup, args=(engine_id,), name="kvstage-lookup", daemon=True).start()
        return view

    def _stale(self, view: EngineView) -> bool:
        """The records name a rank we lost or saw replaced: the server may know better now."""
        return any(r.incarnation in self.gone or r.incarnation in self.replaced for r in view.records)

    def _do_lookup(self, engine_id: str) -> None:
        try:
            records = self._lookup(engine_id, self.t.bootstrap)
            self.post(LookupDone(engine_id, list(records), None))
        except Exception as exc:  # noqa: BLE001 - reported to the rooms waiting for it
            self.post(LookupDone(engine_id, None, f"{type(exc).__name__}: {exc}"))

    def _on_lookup(self, ev: LookupDone, now: float) -> None:
        view = self.engines.get(ev.engine_id)
        if view is None:
            return
        if ev.error is not None:
            view.state, view.error = "failed", ev.error
        else:
            bad = [r for r in ev.records if r.role != "prefill"]
            if bad or not ev.records:
                view.state, view.error = "failed", f"engine {ev.engine_id} is not a prefill engine"
            else:
                view.state, view.records = "ready", sorted(ev.records, key=lambda r: r.tp_rank)
        self._engine_changed(ev.engine_id, now)

    def _engine_changed(self, engine_id: str, now: float) -> None:
        view = self.engines.get(engine_id)
        if view is None:
            return
        for room_id in list(view.rooms):
            self._try_plan(self.rooms.get(room_id), view, now)
        self._flush_tombstones(view, now)

    def _flush_tombstones(self, view: EngineView, now: float) -> None:
        """Tell the prefill ranks of rooms that failed here before they heard of them, so
        their senders fail now rather than at their metadata deadline."""
        if not view.tombstones:
            return
        if view.state == "failed":
            view.tombstones.clear()
            return
        if view.state != "ready":
            return
        writers, notices, _ = self._needed_ranks(view)
        keep = []
        for room_id, session, kind, reason, since in view.tombstones:
            if now - since > self.t.metadata:
                continue
            waiting = False
            for rank in writers + notices:
                peer = self._ensure_peer(view, rank, now)
                if peer.state == "connected":
                    self._send(peer.key, RoomFailed(src=self.me, dst=peer.key.incarnation, room=room_id,
                                                    session=session, kind=kind, reason=reason))
                elif peer.state == "connecting":
                    waiting = True
            if waiting:
                keep.append((room_id, session, kind, reason, since))
        view.tombstones = keep

    def _needed_ranks(self, view: EngineView) -> tuple[list[int], list[int], Any]:
        P = view.records[0].tp_size
        mapping = compute_assignments(P, self.layout.tp_size, self.layout.total_kv_heads, self.layout.mla)
        writers, notices = mapping.prefill_peers_of(self.layout.tp_rank)
        return writers, notices, mapping

    def _try_plan(self, room: DecodeRoom | None, view: EngineView, now: float) -> None:
        if room is None or room.plan is not None or room.state in (KVPoll.Success, KVPoll.Failed):
            if room is not None:
                view.rooms.discard(room.room)
            return
        if view.state == "failed":
            view.rooms.discard(room.room)
            return self._apply(room, room.on_plan_failed("bootstrap", f"looking up prefill engine "
                                                                      f"{view.engine_id} failed: {view.error}", now))
        if view.state != "ready":
            return
        try:
            writers, notices, mapping = self._needed_ranks(view)
        except ValueError as exc:
            view.rooms.discard(room.room)
            return self._apply(room, room.on_plan_failed("layout", str(exc), now))
        peers = {}
        for rank in writers + notices:
            peer = self._ensure_peer(view, rank, now)
            if peer.state == "rejected":
                view.rooms.discard(room.room)
                self._tell_rejected(view, room, peer.reason)
                return self._apply(room, room.on_plan_failed("layout", f"prefill rank {rank} of {view.engine_id}: "
                                                                       f"{peer.reason}", now))
            peers[rank] = peer
        if any(p.state != "connected" for p in peers.values()):
            return
        view.rooms.discard(room.room)
        ring = self.handler.allocator
        plan = plan_room(self.layout, mapping, {w: WriterOffer(peers[w].key, peers[w].staging, peers[w].buffer_bytes)
                                                for w in writers}, {n: peers[n].key for n in notices},
                         staging=bool(self.cfg.staging), ring_size=ring.size if ring else 0,
                         ring_align=ring.align if ring else 1, piece_cap=int(self.cfg.staging_piece_mb * (1 << 20)),
                         epoch=self.me)
        if isinstance(plan, tuple):
            return self._apply(room, room.on_plan_failed(*plan, now))
        if self.cfg.staging and not plan.staged:
            self._log_fallback(view.engine_id, mapping, [peers[w] for w in writers])
        self._apply(room, room.on_plan(plan, now))

    def _log_fallback(self, engine_id: str, mapping: Any, writers: list[Peer]) -> None:
        if self.handler.allocator is None:
            why = "this rank has no staging ring"
        elif self.layout.mla:
            why = "the model is MLA (the latent is replicated: direct whole pages)"
        elif mapping.prefill_tp == mapping.decode_tp:
            why = "TP sizes are equal (direct whole pages)"
        else:
            why = "staging is off at prefill rank(s) " + ", ".join(str(p.key.tp_rank) for p in writers if not p.staging)
        if (engine_id, why) not in self._fallback_logged:
            self._fallback_logged.add((engine_id, why))
            log.info("direct path for rooms from %s: %s", engine_id, why)

    def _tell_rejected(self, view: EngineView, room: DecodeRoom, reason: str) -> None:
        """The prefill ranks of a room must fail too when the connection was refused."""
        for rec in view.records:
            inc = self.by_rank.get((view.engine_id, rec.tp_rank))
            peer = self.peers.get(inc) if inc is not None else None
            if peer is not None:
                self.sock.send(peer.endpoint, RoomFailed(src=self.me, dst=peer.key.incarnation, room=room.room,
                                                          session=room.session, kind="layout",
                                                          reason=f"decode rank {self.layout.tp_rank} refused: "
                                                                 f"{reason}"))

    def _ensure_peer(self, view: EngineView, rank: int, now: float) -> Peer:
        rec = view.records[rank]
        inc = self.by_rank.get((view.engine_id, rank))
        peer = self.peers.get(inc) if inc is not None else None
        if peer is not None and peer.key.incarnation == rec.incarnation and peer.state != "lost":
            return peer
        key = PeerKey(view.engine_id, rank, rec.incarnation)
        self._replace_rank(key, now)
        peer = Peer(key, "prefill", rec.tp_size, rec.ctrl_endpoint, Lease(self.t.lease, now), since=now)
        self._index(peer)
        self.sock.send(peer.endpoint, self._hello())
        return peer

    # -- inputs: events from other threads --------------------------------------------------------------
    def _on_event(self, ev: Any) -> None:
        now = time.monotonic()
        if isinstance(ev, Wake):
            pass  # the backend has queued work: step() runs after the events
        elif isinstance(ev, WriteDone):
            self._on_write_done(ev, now)
        elif isinstance(ev, ScatterDone):
            room = self.rooms.get(ev.room)
            if room is not None:
                self._apply(room, room.on_scattered(ev.key, ev.ok, ev.reason, self.handler.allocator, now))
        elif isinstance(ev, SendChunk):
            room = self.rooms.get(ev.room)
            if room is not None:
                self._apply(room, room.add_chunk(ev.pages, ev.last, now))
        elif isinstance(ev, NewSender):
            self._new_sender(ev, now)
        elif isinstance(ev, NewReceiver):
            self._new_receiver(ev, now)
        elif isinstance(ev, InitReceiver):
            room = self.rooms.get(ev.room)
            if room is not None:
                self._apply(room, room.init(ev.pages, now))
        elif isinstance(ev, Abort):
            room = self.rooms.get(ev.room)
            if room is not None:
                acts = room.abort(now) if self.role == "prefill" else room.abort(self.handler.allocator, now)
                self._apply(room, acts)
        elif isinstance(ev, LookupDone):
            self._on_lookup(ev, now)
        elif isinstance(ev, Call):
            ev.done(ev.fn(self))

    def _new_sender(self, ev: NewSender, now: float) -> None:
        room = PrefillRoom(ev.room, ev.num_pages, self.layout, self.me, now, self.t, _OP_IDS,
                           stale=self.used_sessions.pop(ev.room, frozenset()))
        self.rooms[ev.room] = room
        self.status[ev.room] = ev.status
        self.finished.pop(ev.room, None)
        self.served.pop(ev.room, None)
        for item in self.pending.pop(ev.room, []):
            self._prefill_item(room, item, now, early=True)  # parked before this use: bound by session
        self.pending_since.pop(ev.room, None)

    def _new_receiver(self, ev: NewReceiver, now: float) -> None:
        room = DecodeRoom(ev.room, ev.session, self.me, self.layout, now, self.t)
        self.rooms[ev.room] = room
        self.status[ev.room] = ev.status
        self.finished.pop(ev.room, None)
        self.served.pop(ev.room, None)
        self.engine_of[ev.room] = ev.prefill_engine
        view = self._engine(ev.prefill_engine, now)
        view.rooms.add(ev.room)
        self._try_plan(room, view, now)

    # -- prefill: messages about rooms ------------------------------------------------------------------
    def _prefill_input(self, room_id: int, item: tuple, now: float) -> None:
        room = self.rooms.get(room_id)
        if room is not None:
            return self._prefill_item(room, item, now)
        kind, key, msg = item
        if kind == "failed":
            # nothing of ours for this room is in flight to that peer (finished, or never started):
            # say so, in case an earlier Quiesced was lost
            self._send(key, Quiesced(src=self.me, dst=key.incarnation, room=room_id, session=msg.session))
        if room_id in self.finished:
            if kind == "meta" and (key.incarnation, msg.session) in self.served.get(room_id, ()):
                pass  # a late retransmission of metadata this room already served (and acked): no news
            elif kind == "meta":  # the decode side must not wait for a room that is over here
                _, kind_, why = self.finished[room_id]
                self._send(key, RoomFailed(src=self.me, dst=key.incarnation, room=room_id, session=msg.session,
                                           kind=kind_, reason=f"the prefill sender of this room has finished: {why}"))
                self._send(key, Quiesced(src=self.me, dst=key.incarnation, room=room_id, session=msg.session))
            self.stats.count("dropped_messages", "finished_room")
            return
        if len(self.pending) >= MAX_PENDING_ROOMS and room_id not in self.pending:
            self.stats.count("dropped_messages", "too_many_pending_rooms")
            return
        self.pending[room_id].append(item)
        self.pending_since.setdefault(room_id, now)

    def _prefill_item(self, room: PrefillRoom, item: tuple, now: float, early: bool = False) -> None:
        kind, key, msg = item
        if kind == "meta":
            peer = self.peers.get(key.incarnation)
            if peer is None or peer.state != "connected":
                return
            self._apply(room, room.add_meta(key, peer.tp_size, msg, now))
        else:
            self._apply(room, room.on_room_failed(key, msg.session, msg.kind, msg.reason, now, early=early))

    def _on_RoomMeta(self, peer: Peer, msg: RoomMeta, now: float) -> None:
        if self.role == "prefill":
            self._prefill_input(msg.room, ("meta", peer.key, msg), now)  # the write goes out first
            self._send(peer.key, MetaAck(src=self.me, dst=peer.key.incarnation, room=msg.room, session=msg.session))

    def _on_MetaAck(self, peer: Peer, msg: MetaAck, now: float) -> None:
        room = self.rooms.get(msg.room)
        if self.role == "decode" and room is not None:
            room.on_meta_ack(peer.key, msg.session)

    def _answer_finished(self, peer: Peer, room_id: int, session: int) -> None:
        """Decode: a writer still asks about a room that is over here; repeat the outcome."""
        done = self.finished.get(room_id)
        if done is None:
            self.stats.count("dropped_messages", "unknown_room")
            return
        state, kind, why = done
        if state is KVPoll.Success:
            self._send(peer.key, RoomDone(src=self.me, dst=peer.key.incarnation, room=room_id, session=session))
        else:
            self._send(peer.key, RoomFailed(src=self.me, dst=peer.key.incarnation, room=room_id, session=session,
                                            kind=kind, reason=why))

    def _on_AllocGrant(self, peer: Peer, msg: AllocGrant, now: float) -> None:
        room = self.rooms.get(msg.room)
        if self.role == "prefill" and room is not None:
            self._apply(room, room.on_grant(peer.key, msg, now))

    def _on_WatermarkUpdate(self, peer: Peer, msg: WatermarkUpdate, now: float) -> None:
        if self.role == "prefill" and self.handler.on_watermark(peer.key.incarnation, msg.epoch,
                                                                Watermark(msg.round, msg.tail)):
            self._dispatch_staged(peer.key.incarnation, now)

    def _on_RoomDone(self, peer: Peer, msg: RoomDone, now: float) -> None:
        room = self.rooms.get(msg.room)
        if self.role == "prefill" and room is not None:
            self._apply(room, room.on_room_done(peer.key, msg.session, now))

    def _on_RoomFailed(self, peer: Peer, msg: RoomFailed, now: float) -> None:
        if self.role == "prefill":
            return self._prefill_input(msg.room, ("failed", peer.key, msg), now)
        room = self.rooms.get(msg.room)
        if room is not None:
            self._apply(room, room.on_room_failed(peer.key, msg.session, msg.kind, msg.reason, now))

    # -- decode: messages about rooms -------------------------------------------------------------------
    def _on_AllocRequest(self, peer: Peer, msg: AllocRequest, now: float) -> None:
        room = self.rooms.get(msg.room)
        if self.role == "decode" and room is not None and self.handler.allocator is not None:
            self._apply(room, room.on_alloc_request(peer.key, msg, self.handler.allocator, now))
            a = self.handler.allocator
            self.stats.maximum("ring_high_water_bytes", min(a.high_water, a.size))
            self.stats.maximum("ring_backlog_high_water_bytes", a.high_water)
        elif room is None and self.role == "decode":
            self._answer_finished(peer, msg.room, msg.session)

    def _on_WriterDone(self, peer: Peer, msg: WriterDone, now: float) -> None:
        room = self.rooms.get(msg.room)
        if self.role == "decode" and room is not None:
            self._apply(room, room.on_writer_done(peer.key, msg, now))
        elif room is None and self.role == "decode":
            self._answer_finished(peer, msg.room, msg.session)

    def _on_Quiesced(self, peer: Peer, msg: Quiesced, now: float) -> None:
        room = self.rooms.get(msg.room)
        if self.role == "decode" and room is not None:
            self._apply(room, room.on_quiesced(peer.key, msg.session, self.handler.allocator, now))

    # -- both: liveness ---------------------------------------------------------------------------------
    def _on_Heartbeat(self, peer: Peer, msg: Heartbeat, now: float) -> None:
        peer.lease.on_heartbeat(msg.seq, msg.ack, now)
        if self.role == "prefill" and peer.backend_name:
            self.backend.fence(peer.backend_name, peer.lease.fence_base + peer.lease.lease_s)
            if msg.wm_epoch and self.handler.on_watermark(peer.key.incarnation, msg.wm_epoch,
                                                          Watermark(msg.wm_round, msg.wm_tail)):
                self._dispatch_staged(peer.key.incarnation, now)

    def _on_Goodbye(self, peer: Peer, msg: Goodbye, now: float) -> None:
        self._peer_lost(peer, f"it said goodbye: {msg.reason or 'closing'}", now, tell=False, clean=msg.clean)

    def _peer_lost(self, peer: Peer, reason: str, now: float, tell: bool = True, clean: bool = False) -> None:
        if peer.state == "lost":
            return
        if tell:  # it may be alive but frozen or cut off: when it wakes up it learns at once
            self.sock.send(peer.endpoint, Goodbye(src=self.me, dst=peer.key.incarnation,
                                                  reason=f"you were declared lost: {reason}"))
        log.warning("peer %s lost: %s", peer.key, reason)
        was = peer.state
        peer.state, peer.reason = "lost", reason
        self.peers.pop(peer.key.incarnation, None)
        if self.by_rank.get((peer.key.engine_id, peer.key.tp_rank)) == peer.key.incarnation:
            del self.by_rank[(peer.key.engine_id, peer.key.tp_rank)]
        self.gone[peer.key.incarnation] = reason
        self.gone_endpoint[peer.key.incarnation] = peer.endpoint
        while len(self.gone) > FINISHED_MEMORY:
            old, _ = self.gone.popitem(last=False)
            self.gone_endpoint.pop(old, None)
            self._told_gone.pop(old, None)
        if peer.backend_name:
            self.by_backend.pop(peer.backend_name, None)
            if self.role == "prefill":
                self.backend.disconnect(peer.backend_name)  # its pending writes fail
        self.handler.unsubscribe(peer.key.incarnation)
        self.sock.forget(peer.endpoint)
        self.stats.count("peers_lost", "connecting" if was == "connecting" else "connected")
        for staged in self.waiting.pop(peer.key.incarnation, []):
            self._cancel_staged(staged[0], f"decode peer lost: {reason}", now)
        for room in list(self.rooms.values()):
            if self.role == "prefill":
                self._apply(room, room.on_peer_lost(peer.key, reason, now))
            else:
                quarantine = 0.0 if clean else self.t.quarantine_for(self.cfg.backend)
                self._apply(room, room.on_peer_lost(peer.key, reason, self.handler.allocator, now, quarantine))
        view = self.engines.get(peer.key.engine_id) if self.role == "decode" else None
        if view is not None and view.rooms:
            self._engine(peer.key.engine_id, now)  # look the engine up again for rooms still waiting

    # -- executing actions ------------------------------------------------------------------------------
    def _apply(self, room: Any, actions: list) -> None:
        failed = False
        for a in actions:
            if isinstance(a, Send):
                self._send(a.peer, a.msg)
            elif isinstance(a, PostWrite):
                self._post_write(a.op, time.monotonic())
            elif isinstance(a, Scatter):
                self._submit_scatter(a)
            elif isinstance(a, PublishWatermark):
                self._publish_watermark()
            elif isinstance(a, StatusChanged):
                self._status_changed(room, a)
                failed |= a.state is KVPoll.Failed and not a.released
            elif isinstance(a, Released):
                self._released(room)
            elif isinstance(a, Dropped):
                self.stats.count("dropped_messages", a.reason)
        if failed and self.role == "prefill":
            # pieces still waiting for ring space are never started (after the room's own messages)
            self._cancel_room_staged(room.room, time.monotonic())

    def _status_changed(self, room: Any, a: StatusChanged) -> None:
        status = self.status.get(room.room)
        if status is not None:
            status.update(a.state, a.failure, a.failure_kind, a.released)
        if a.released:
            return
        if self.role == "decode":
            eager = a.state is KVPoll.Transferring
            if eager and room.room not in self._eager_rooms:
                self._eager_rooms.add(room.room)
                self.backend.expecting += 1
            elif not eager and room.room in self._eager_rooms:
                self._eager_rooms.discard(room.room)
                self.backend.expecting -= 1
        if a.state is KVPoll.Success:
            self.stats.count("rooms", "success")
        elif a.state is KVPoll.Failed:
            self.stats.count("rooms", "failed")
            self.stats.count("failures_by_kind", a.failure_kind or "unknown")
            log.warning("room %s failed (%s): %s", room.room, a.failure_kind, a.failure)
            if self.role == "decode" and not room.meta_sent and a.failure_kind not in ("layout",):
                view = self.engines.get(self.engine_of.get(room.room, ""))
                if view is not None:
                    view.rooms.discard(room.room)
                    view.tombstones.append((room.room, room.session, a.failure_kind or "failed", a.failure or "",
                                            time.monotonic()))
                    self._flush_tombstones(view, time.monotonic())

    def _released(self, room: Any) -> None:
        self.rooms.pop(room.room, None)
        self.engine_of.pop(room.room, None)
        self.status.pop(room.room, None)
        if room.room in self._eager_rooms:
            self._eager_rooms.discard(room.room)
            self.backend.expecting -= 1
        self.finished[room.room] = (room.state, room.failure_kind or "gone", room.failure or "it succeeded")
        if self.role == "prefill" and room.state is KVPoll.Success:
            self.served[room.room] = frozenset((f.peer.incarnation, f.session) for f in room.flows.values())
        if self.role == "prefill":
            self.used_sessions[room.room] = room.sessions()
        while len(self.finished) > FINISHED_MEMORY:
            gone, _ = self.finished.popitem(last=False)
            self.served.pop(gone, None)
            self.used_sessions.pop(gone, None)

    # -- prefill: writes ---------------------------------------------------------------------------------
    def _post_write(self, op: WriteOp, now: float) -> None:
        peer = self.peers.get(op.peer.incarnation)
        if peer is None or peer.state != "connected":
            return self._finish_op(op.room, op.op_id, False, "decode peer is not connected", now)
        if not peer.lease.may_write(now):
            return self._finish_op(op.room, op.op_id, False, "the lease with the decode peer expired", now)
        if op.staged:
            self.waiting[op.peer.incarnation].append((op, now))
            self.stats.add("watermark_waits_started")
            return self._dispatch_staged(op.peer.incarnation, now)
        src, dst = direct_descriptors(self.geometry, self._peer_geometry(peer), op.src_pages, op.dst_pages,
                                      op.src_heads, op.dst_heads)
        self.stats.add("write_requests")
        self.stats.add("descriptors", len(src))
        self.write_deadline[op.op_id] = (op.room, now + self.t.write)
        room, op_id = op.room, op.op_id

        def posted() -> None:  # on this thread; the deadline counts from the post, not the queue
            if op_id in self.write_deadline:
                self.write_deadline[op_id] = (room, time.monotonic() + self.t.write)

        self.backend.submit_write(peer.backend_name, src, dst, self.tags.encode(op.tag),
                                  lambda ok, reason: self.post(WriteDone(op_id, room, ok, reason)), posted,
                                  dst_kind=peer.kv.mem_kind)
        self.stats.add("bytes_posted", op.nbytes)

    def _peer_geometry(self, peer: Peer) -> CacheGeometry:
        kv = peer.kv
        return CacheGeometry(tuple(kv.k_addrs) + tuple(kv.v_addrs), self.layout.page_size, kv.token_stride,
                             self.layout.head_bytes, kv.device)

    def _dispatch_staged(self, peer_inc: int, now: float) -> None:
        """Hand every waiting piece whose ring region is free to a transfer worker."""
        queue = self.waiting.get(peer_inc)
        if not queue:
            return
        peer = self.peers.get(peer_inc)
        keep = []
        for op, since in queue:
            room = self.rooms.get(op.room)
            if room is None or room.state is KVPoll.Failed:
                self._finish_op(op.room, op.op_id, False, "cancelled: the room failed", now)
            elif self.handler.region_free(peer_inc, op.ring_start + op.writer_offset, op.nbytes):
                if since != now:
                    self.stats.add("watermark_waits")
                    self.stats.add("watermark_wait_s", now - since)
                self.stats.add("write_requests")
                self.stats.add("descriptors")
                self.stats.add("staged_writes")
                self.stats.add("staged_bytes", op.nbytes)
                self.stats.staged_write((peer_inc, op.room, op.chunk, op.piece))
                self.write_deadline[op.op_id] = (op.room, now + self.t.write)
                self.workers.submit(GatherJob(op.op_id, op.room, peer.backend_name, op.src_pages, op.src_heads,
                                              op.nbytes, peer.ring.addr + op.ring_start % peer.ring.size
                                              + op.writer_offset, peer.ring.device, self.tags.encode(op.tag),
                                              dst_kind=peer.ring.mem_kind))
            else:
                keep.append((op, since))
        if keep:
            self.waiting[peer_inc] = keep
        else:
            self.waiting.pop(peer_inc, None)

    def _cancel_staged(self, op: WriteOp, reason: str, now: float) -> None:
        self._finish_op(op.room, op.op_id, False, reason, now)

    def _cancel_room_staged(self, room_id: int, now: float) -> None:
        for inc, queue in list(self.waiting.items()):
            mine = [x for x in queue if x[0].room == room_id]
            if mine:
                self.waiting[inc] = [x for x in queue if x[0].room != room_id]
                for op, _ in mine:
                    self._cancel_staged(op, "cancelled: the room failed", now)

    def _finish_op(self, room_id: int, op_id: int, ok: bool, reason: str | None, now: float) -> None:
        room = self.rooms.get(room_id)
        if room is not None:
            self._apply(room, room.on_write_done(op_id, ok, reason, now))

    def _on_write_done(self, ev: WriteDone, now: float) -> None:
        self.write_deadline.pop(ev.op_id, None)
        room = self.rooms.get(ev.room)
        op = room.ops.get(ev.op_id) if room is not None else None
        if ev.ok and op is not None:
            self.stats.add("bytes_sent", op.nbytes)
        elif not ev.ok:
            self.stats.count("write_failures", "failed")
        self._finish_op(ev.room, ev.op_id, ev.ok, ev.reason, now)

    def _worker_report(self, op_id: int, room: int, ok: bool, reason: str | None, gather_s: float) -> None:
        self.stats.add("gather_s", gather_s)
        self.post(WriteDone(op_id, room, ok, reason))

    # -- decode: arrivals and scatter ------------------------------------------------------------------
    def _on_tags(self, tags: list) -> None:
        now = time.monotonic()
        for arrived in tags:
            inc = self.by_backend.get(arrived.peer)
            peer = self.peers.get(inc) if inc is not None else None
            if peer is None:
                self.stats.count("dropped_tags", "unknown_sender")
                continue
            try:
                tag = self.tags.decode(arrived.tag)
            except WireError as exc:
                self.stats.count("dropped_tags", exc.kind)
                continue
            room = self.rooms.get(tag.room)
            if self.role != "decode":  # only decode ranks are written to: a confused or forged peer
                self.stats.count("dropped_tags", "tag_at_prefill_rank")
                continue
            if room is None:
                self.stats.count("dropped_tags", "finished_room")
                continue
            verdict, actions = room.on_tag(peer.key, tag, now)
            if verdict == "ok":
                self.stats.add("bytes_received", tag.nbytes)
                self.stats.add("tags_received")
            else:
                self.stats.count("dropped_tags", verdict)
            self._apply(room, actions)

    def _submit_scatter(self, s: Scatter) -> None:
        parts = tuple((self.handler.ring_view(p.region_offset, p.nbytes), p.dst_heads) for p in s.parts)
        self.scatter.submit(ScatterJob(s.room, s.key, s.dst_pages, parts))

    def _scatter_report(self, room: int, key: tuple, ok: bool, reason: str | None, seconds: float) -> None:
        self.stats.add("scatter_s", seconds)
        self.post(ScatterDone(room, key, ok, reason))

    def _publish_watermark(self) -> None:
        a = self.handler.allocator
        wm = a.watermark
        self.stats.set("ring_live_bytes", a.live_bytes)
        for peer in self.peers.values():
            if peer.state == "connected" and peer.staging:
                self._send(peer.key, WatermarkUpdate(src=self.me, dst=peer.key.incarnation, epoch=self.me,
                                                     round=wm.round, tail=wm.tail))

    # -- time ------------------------------------------------------------------------------------------
    def _tick(self, now: float) -> None:
        for room in list(self.rooms.values()):
            if self.role == "prefill":
                self._apply(room, room.tick(now))
            else:
                self._apply(room, room.tick(self.handler.allocator, now))
        for op_id, (room_id, at) in list(self.write_deadline.items()):
            if now > at:
                del self.write_deadline[op_id]
                room = self.rooms.get(room_id)
                if room is not None:
                    self._apply(room, room.fail("timeout", f"a write did not complete within {self.t.write:g} s",
                                                now))
        for inc, queue in list(self.waiting.items()):
            for op, since in list(queue):
                if now - since > self.t.watermark:
                    queue.remove((op, since))
                    self._cancel_staged(op, f"the decode ring stayed full for {self.t.watermark:g} s", now)
            if not queue:
                self.waiting.pop(inc, None)
        for room_id, since in list(self.pending_since.items()):
            if now - since > self.t.metadata:
                self.pending.pop(room_id, None)
                del self.pending_since[room_id]
                self.stats.count("dropped_messages", "meta_without_sender")
        if self.role == "decode":
            self._plan_deadlines(now)
        for peer in list(self.peers.values()):
            if peer.state == "connecting" and now - peer.since > self.t.connect:
                self._connect_failed(peer, now)
            elif peer.state == "connected":
                if not peer.lease.alive(now):
                    self._peer_lost(peer, f"silent for {self.t.lease:g} s (lease expired)", now)
                elif self.role == "prefill" and not peer.lease.may_write(now):
                    self._peer_lost(peer, "its acknowledgements stopped (write lease expired)", now)
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + self.t.heartbeat
            wm = self.handler.allocator.watermark if self.handler.allocator is not None else None
            for peer in list(self.peers.values()):
                if peer.state == "connected":
                    seq, ack = peer.lease.next_heartbeat(now)
                    extra = {}
                    if wm is not None and peer.staging:
                        extra = {"wm_epoch": self.me, "wm_round": wm.round, "wm_tail": wm.tail}
                    self._send(peer.key, Heartbeat(src=self.me, dst=peer.key.incarnation, seq=seq, ack=ack, **extra))
        if self._closing_since is not None:
            if not self.rooms or now - self._closing_since > self.t.close:
                self._stop.set()

    def _connect_failed(self, peer: Peer, now: float) -> None:
        """Rooms keep waiting (the rank may be restarting): look the engine up again; each room
        gives up at its own plan deadline (see _plan_deadlines)."""
        reason = f"no answer from prefill rank {peer.key.tp_rank} at {peer.endpoint} within {self.t.connect:g} s"
        log.warning("connecting to %s failed: %s", peer.key, reason)
        view = self.engines.get(peer.key.engine_id)
        self._peer_lost(peer, reason, now)
        if view is not None:
            view.error = reason
            if view.rooms or view.tombstones:
                self._engine(peer.key.engine_id, now)

    def _plan_deadlines(self, now: float) -> None:
        """Decode rooms that could not reach their prefill ranks in time fail, saying why."""
        limit = self.t.bootstrap + self.t.connect
        for view in self.engines.values():
            for room_id in list(view.rooms):
                room = self.rooms.get(room_id)
                if room is None:
                    view.rooms.discard(room_id)
                elif now - room.created > limit:
                    view.rooms.discard(room_id)
                    why = view.error or f"prefill engine {view.engine_id} not ready"
                    self._apply(room, room.on_plan_failed("connect", f"no connection to the prefill ranks of "
                                                                     f"this room within {limit:g} s: {why}", now))

    # -- closing ---------------------------------------------------------------------------------------
    def begin_close(self) -> None:
        """On the control thread: fail every room; stop once all are released (or time is up)."""
        now = time.monotonic()
        self._closing_since = now
        for room in list(self.rooms.values()):
            acts = room.fail("closed", "the kvstage manager is closing", now)
            if self.role == "decode":
                acts += room.abort(self.handler.allocator, now)
            self._apply(room, acts)

    def _teardown(self) -> None:
        clean = not any(getattr(r, "ops", None) for r in self.rooms.values())  # no write of ours in flight
        for peer in list(self.peers.values()):
            if peer.state in ("connected", "connecting"):
                self.sock.send(peer.endpoint, Goodbye(src=self.me, dst=peer.key.incarnation, reason="closing",
                                                      clean=clean))
        time.sleep(0.01)  # let zmq hand the goodbyes to the kernel before the sockets close
        self.sock.close()
        self.events.close()

