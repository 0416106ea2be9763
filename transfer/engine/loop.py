"""The control thread of one rank: wait on the sockets, the event queue and the clock, and
hand each input to the part of the control plane whose job it is.

The thread owns the zmq sockets, the backend (through BackendOwner) and every room, so none of
them needs a lock. Other threads reach it only through the EventQueue (user calls, write
completions from the transfer workers, scatters, engine lookups). The parts, each in its own
module: peers.py (connections), routing.py (incoming frames and notifications), rooms.py
(state machine actions), write_queue.py (writes and flow control), prefill_side.py and
decode_side.py (the two roles), liveness.py (heartbeats and leases).

How long it blocks is decided by protocol/quiet.py: it polls the backend at 20-200 us only
while a write is known to be in flight from or towards this rank (own writes posted; writes a
prefill rank announced with WritePosted whose tags are not in), and otherwise sleeps in the
poller until a message, an event or the next tick, so a rank whose rooms wait for the other
side costs the process no wake-ups beyond the ticks. Every round, ticks included, steps the
backend once: a tag whose announcement was lost is read at the next tick. The events a step
posts itself (a write's completion, found by polling it) are handled in the same round, so a
room's next write is made without waiting for another round. A tick reads the socket once more
before it judges the leases, and a peer's silence counts only up to the last read that got to
the end (protocol/leases.py): a loop held up by the GIL or a long call does not take its own
lateness for the peer's. An exception in any handler fails
the rooms it concerns (kind "internal") and the loop goes on.
"""

from __future__ import annotations

import functools
import logging
import math
import select
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast

import zmq

from ...bootstrap import RankRecord
from ...hop_trace import TRACE, Hop
from ...staging.handler import StagingHandler
from ...staging.thread_meter import ThreadMeter
from ...staging.workers import ScatterWorker, TransferWorkers
from ...wire import Codec
from ..backends.faults import ControlFaults, FaultPlan
from ..config import ResolvedConfig
from ..kv_buffers import KVBuffers
from ..layout import KVLayout
from ..poll import KVPoll
from ..protocol.engine_leases import LeaseMode
from ..protocol.kinds import FailureKind, Role
from ..protocol.messages import Goodbye, PeerMessage
from ..protocol.prefill.layer_sends import LayerGrouping
from ..protocol.quiet import MIN_EAGER_WAIT, Activity, activity, next_wait
from ..protocol.routing import PeerState
from ..protocol.tags import TagCodec
from .backend_owner import BackendOwner, Step
from .calibration import Calibration
from .context import EngineContext, NoObserver, local_geometry
from .control_socket import MAX_BATCH, ControlSocket
from .decode_planning import EnginePlanner, PlanFacts, decode_hello
from .decode_side import DecodeSide, scatter_report
from .engine_liveness import EngineLiveness
from .events import Call, EventQueue, LayersReady, Wake, WriteDone
from .integrity import Integrity
from .interfaces import HeartbeatSink, HelloSink, LivenessPart, Observer, RoleSide, Room, TagSink
from .liveness import Liveness
from .peers import PeerTable
from .prefill_side import PrefillRank, PrefillSide
from .prefill_sources import PrefillSource
from .ready_waiter import ReadyWaiter
from .ring_credits import piece_cap_bytes
from .rooms import DecodeBook, PrefillBook, RoomBook
from .routing import FrameRouter
from .stats import Stats
from .write_queue import WriteQueue, gather_report

log = logging.getLogger("kvstage")

TICK = 0.1                 # deadlines, retransmissions, heartbeats and leases are all seconds-scale

T = TypeVar("T")


class Lateness:
    """The longest delays the control thread has seen (stats(): ctrl_tick_late_max_s, how late a
    tick ran; ctrl_round_max_s, the longest round from wake-up to its end; backend_step_max_s,
    the longest backend step inside one). Kept in plain floats by the control thread and handed
    to Stats once a tick, so a round pays two clock reads and no lock.

    A backend step or a tick late by `warn_s` or more (the engine's: a quarter of the lease, what
    a heartbeat interval may reach) is also logged as a warning naming `who`: a long step held
    the control thread inside a backend call (NIXL's Python calls keep the GIL, so the whole
    process waits with it), a late tick without one means the process itself was held up (the
    GIL held by another thread, a busy or paused machine). At most one warning each `every_s`."""

    def __init__(self, *, who: str = "", warn_s: float = float("inf"), every_s: float = 10.0) -> None:
        self.round_max = self.step_max = 0.0
        self.who, self.warn_s, self.every_s = who, warn_s, every_s
        self._warned_at = -float("inf")

    def step(self, seconds: float, now: float) -> None:
        if seconds > self.step_max:
            self.step_max = seconds
        if seconds >= self.warn_s:
            self._warn(now, "a backend call held its control thread for %.1f s (a backend whose Python calls "
                       "keep the GIL, as NIXL's do, held the whole process with it)", seconds)

    def round(self, seconds: float) -> None:
        if seconds > self.round_max:
            self.round_max = seconds

    def tick(self, late: float, stats: Stats, now: float) -> None:
        stats.maximum("ctrl_tick_late_max_s", round(max(late, 0.0), 4))
        stats.maximum("ctrl_round_max_s", round(self.round_max, 4))
        stats.maximum("backend_step_max_s", round(self.step_max, 4))
        if late >= self.warn_s:
            self._warn(now, "its control loop ran %.1f s late (the process was held up: the GIL, a busy or "
                       "paused machine); peers may have stopped hearing it", late)

    def _warn(self, now: float, what: str, seconds: float) -> None:
        if now - self._warned_at >= self.every_s:
            self._warned_at = now
            log.warning("kvstage %s: " + what, self.who, seconds)


class EngineLoop:
    """The control thread of one rank, and the assembly of its parts (`_build`): the only place
    that takes the whole EngineContext apart and hands each part what it uses."""

    # the parts, built by _build_prefill or _build_decode
    peers: PeerTable
    book: RoomBook[Any, Any]
    side: RoleSide[Any, Any]
    writes: WriteQueue | None                # a prefill rank's; a decode rank writes nowhere
    credit_bytes: Callable[[], int]          # ring bytes lent out as credits (a decode rank's ring)
    _heartbeats: HeartbeatSink | None        # the prefill side
    _hello: HelloSink | None                 # the prefill side: decode ranks connect to it
    _landed: TagSink | None                  # the decode side: prefill ranks write to it

    def __init__(self, cfg: ResolvedConfig, layout: KVLayout, buffers: KVBuffers, me: int,
                 backend: BackendOwner, backend_name: str, identity: bytes, handler: StagingHandler,
                 stats: Stats, lookup: Callable[[PrefillSource, float], list[RankRecord]],
                 codec: Codec[PeerMessage], ctx: zmq.Context[zmq.Socket[bytes]],
                 control_faults: ControlFaults | None = None, observer: Observer | None = None,
                 calibration: Calibration | None = None,
                 siblings: Callable[[float], list[RankRecord]] | None = None):
        """`lookup(source, timeout)`: a prefill engine's records (decode side); `siblings(timeout)`:
        our own engine's records at our rendezvous (engine-pair leases; both block, called on
        lookup threads)."""
        self.events = EventQueue()
        self.workers: TransferWorkers | None = None
        self.scatter: ScatterWorker | None = None
        self.waiter: ReadyWaiter | None = None
        sock: ControlSocket | None = None
        try:
            sock = ControlSocket(ctx, cfg.host, cfg.ctrl_port, codec, control_faults)
            self._build(cfg, layout, buffers, me, backend, backend_name, identity, handler, stats, lookup, sock,
                        observer, calibration, siblings)
        except BaseException:
            # nothing may outlive a failed construction: an open socket blocks Context.term()
            self.stop_workers()
            if sock is not None:
                sock.close()
            self.events.close()
            raise
        self.thread = threading.Thread(target=self._run, name="kvstage-ctrl", daemon=True)

    def _build(self, cfg: ResolvedConfig, layout: KVLayout, buffers: KVBuffers, me: int, backend: BackendOwner,
               backend_name: str, identity: bytes, handler: StagingHandler, stats: Stats,
               lookup: Callable[[PrefillSource, float], list[RankRecord]], sock: ControlSocket,
               observer: Observer | None,
               calibration: Calibration | None = None,
               siblings: Callable[[float], list[RankRecord]] | None = None) -> None:
        """Every part gets what it uses in its constructor, built in dependency order. Three pairs
        call each other (the peer table and its listeners, the room book and the write queue, the
        book and the role's side): the part built first gets the later one as a `Later`, a
        function of this method that returns it once construction is over."""
        plan = FaultPlan.from_dict(cfg.faults) if cfg.faults else None
        tags = TagCodec(cfg.token_bytes)
        integrity = Integrity(verify=cfg.verify, layout=layout, buffers=buffers, tags=tags, handler=handler,
                              stats=stats, corrupt_data=plan.corrupt_data if plan else 0.0,
                              seed=plan.seed if plan else 0)
        self.ctx = c = EngineContext(cfg=cfg, layout=layout, buffers=buffers, me=me, backend=backend,
                                     backend_name=backend_name, identity=identity, handler=handler, stats=stats,
                                     sock=sock, tags=tags, summary=layout.summary(buffers.pool_specs),
                                     geometry=local_geometry(layout, buffers), post=self.post, integrity=integrity,
                                     observer=observer or NoObserver(), calibration=calibration)
        if cfg.role == Role.PREFILL and handler.buffers:
            self.workers = TransferWorkers(handler.buffers, buffers.entry_k, buffers.entry_v, layout.page_size,
                                           backend.submit_write, gather_report(stats, self.post), buffers.pools,
                                           inline_max_bytes=cfg.inline_gather_kb << 10,
                                           own_streams=cfg.copy_streams)
        elif cfg.role != Role.PREFILL and handler.ring is not None:
            self.scatter = ScatterWorker(buffers.entry_k, buffers.entry_v, layout.page_size,
                                         scatter_report(stats, self.post),
                                         buffers.pools, inline_max_bytes=cfg.inline_scatter_kb << 10,
                                         own_streams=cfg.copy_streams)
        if cfg.role == Role.PREFILL:
            self._build_prefill(c)
        else:
            self._build_decode(c, lookup)
        side = self.side
        engine_liveness: EngineLiveness | None = None
        if cfg.leases is LeaseMode.ENGINE:
            if siblings is None:
                raise ValueError("engine-pair leases need a lookup of this rank's own engine (siblings)")
            engine_liveness = EngineLiveness(
                me=me, engine_id=cfg.engine_id, peers=self.peers, timeouts=c.t, stats=stats, side=side, sock=sock,
                fences=backend if cfg.role == Role.PREFILL else None,
                lookup=siblings, post=self.post, now=time.monotonic())
        self.liveness: LivenessPart = engine_liveness or Liveness(
            me=me, peers=self.peers, timeouts=c.t, stats=stats, ring=handler, side=side, heartbeats=self._heartbeats)
        self.router = FrameRouter(me=me, role=cfg.role, peers=self.peers, tags=tags, stats=stats,
                                  handlers={**self.liveness.handlers, **side.handlers}, failures=side,
                                  hello=self._hello, landed=self._landed, siblings=engine_liveness)
        writes = self.writes
        self.on_event: dict[type, Callable[[Any, float], None]] = {
            **side.events, **self.liveness.events, Wake: lambda ev, now: None,  # step() runs after the events
            Call: lambda ev, now: ev.done(ev.fn(self))}
        if writes is not None:
            self.on_event.update({WriteDone: writes.on_write_done, LayersReady: writes.layers_ready})
        self._next_tick = 0.0
        self.looked = time.monotonic()          # the start of the last complete read of the socket
        self._closing_since: float | None = None
        self._stop = threading.Event()
        self.died: str | None = None            # why the control thread stopped on an error
        self._death_lock = threading.Lock()     # post() against _die(): no event slips past both
        self.meter = ThreadMeter("ctrl")             # wake-ups = rounds of the loop
        self._starved = Lateness(who=f"{cfg.role.value} rank {layout.rank} of {cfg.engine_id}",   # how late the loop
                                 warn_s=c.t.lease / 4)                                     # ran, for stats()
        self.steps: dict[str, int] = {a.value: 0 for a in Activity}  # backend steps, by what was in flight

    def _build_prefill(self, c: EngineContext) -> None:
        """A prefill rank's parts: the book, the write queue and the side call each other (each
        gets the ones built after it as a `Later`)."""
        cfg, stats = c.cfg, c.stats
        peers = PeerTable(me=c.me, sock=c.sock, stats=stats, staging=c.handler, links=c.backend,
                          listeners=lambda: (writes, side))   # staged pieces fail before rooms
        book = PrefillBook(outbox=peers, stats=stats, observer=c.observer, hooks=lambda: side, writes=lambda: writes)
        self.waiter = ReadyWaiter(self.post)
        writes = WriteQueue(me=c.me, peers=peers, book=book, write_timeout=c.t.write,
                            watermark_timeout=c.t.watermark, stats=stats, backend=c.backend, staging=c.handler,
                            tags=c.tags, integrity=c.integrity, observer=c.observer, post=self.post,
                            geometry=c.geometry, layout=c.layout, buffers=c.buffers, workers=self.workers,
                            waiter=self.waiter)
        rank = PrefillRank(engine_id=cfg.engine_id, backend=cfg.backend, backend_name=c.backend_name,
                           verify=cfg.verify, staging=cfg.staging,
                           costs=c.calibration.writer if c.calibration else None, credits=cfg.credits,
                           piece_cap=piece_cap_bytes(cfg.staging_piece_mb))
        side = PrefillSide(me=c.me, rank=rank, layout=c.layout, summary=c.summary, timeouts=c.t, stats=stats,
                           sock=c.sock, backend=c.backend, staging=c.handler, peers=peers, book=book, writes=writes,
                           grouping=LayerGrouping(size=cfg.layer_group, min_tokens=cfg.layerwise_min_tokens,
                                                  batch=cfg.layer_batching))
        self.peers, self.book, self.writes, self.side = peers, book, writes, side
        self._heartbeats, self._hello, self._landed = side, side, None
        self.credit_bytes = lambda: 0   # only a decode rank's ring is lent out as credits

    def _build_decode(self, c: EngineContext, lookup: Callable[[PrefillSource, float], list[RankRecord]]) -> None:
        """A decode rank's parts: no write queue (a decode rank writes nowhere); the book and the
        side call each other."""
        cfg, stats = c.cfg, c.stats
        peers = PeerTable(me=c.me, sock=c.sock, stats=stats, staging=c.handler, links=None, listeners=lambda: (side,))
        book = DecodeBook(outbox=peers, stats=stats, observer=c.observer, hooks=lambda: side)
        piece_cap = piece_cap_bytes(cfg.staging_piece_mb)
        cal = c.calibration
        planner = EnginePlanner(
            me=c.me, layout=c.layout, timeouts=c.t, stats=stats, post=self.post, sock=c.sock, ring=c.handler,
            facts=PlanFacts(staging=cfg.staging, piece_cap=piece_cap, path=cfg.path,
                            mem_kind="VRAM" if c.buffers.device.type == "cuda" else "DRAM",
                            scatter_bytes_per_s=cal.scatter_bytes_per_s if cal is not None else None),
            hello=functools.partial(decode_hello, c), peers=peers, book=book, lookup=lookup)
        side = DecodeSide(me=c.me, layout=c.layout, summary=c.summary, timeouts=c.t,
                          quarantine=c.t.quarantine_for(cfg.backend), stats=stats, tags=c.tags, staging=c.handler,
                          integrity=c.integrity, expected_tags=c.backend, credits=cfg.credits,
                          piece_cap=piece_cap, peers=peers, book=book, planner=planner, scatterer=self.scatter)
        self.peers, self.book, self.writes, self.side = peers, book, None, side
        self._heartbeats, self._hello, self._landed = None, None, side
        self.credit_bytes = side.credit_bytes

    @property
    def endpoint(self) -> str:
        return self.ctx.sock.endpoint

    @property
    def rooms(self) -> Mapping[int, Room[Any]]:
        return self.book.rooms

    def meters(self) -> list[ThreadMeter]:
        """The control thread's, the transfer workers' and the scatter thread's meters."""
        return ([self.meter] + (self.workers.meters if self.workers is not None else [])
                + ([self.scatter.meter] if self.scatter is not None else []))

    def room_state(self) -> dict[str, int]:
        """How much per-room state the control thread holds (all zero once every room ended and
        was released, apart from the bounded memory of finished rooms)."""
        w = self.writes
        return {"rooms": len(self.book.rooms), "statuses": len(self.book.status),
                "write_deadlines": len(w.deadlines) if w else 0, "staged_waiting": len(w.staged) if w else 0,
                "writes_posted": len(w.posted_at) if w else 0, "direct_rows": len(w.kv_rows) if w else 0,
                **self.side.room_state()}

    def staged_waiting(self) -> int:
        """Staged pieces waiting for ring space (a prefill rank's; 0 on a decode rank)."""
        return len(self.writes.staged) if self.writes is not None else 0

    def start(self) -> None:
        self.thread.start()

    def discard(self) -> None:
        """A loop whose thread never started: close what it holds (the caller's thread)."""
        self.ctx.sock.close()
        self.events.close()

    def stop_workers(self) -> None:
        """The transfer workers and the scatter thread, once no write can still be posted."""
        try:
            if self.workers is not None:
                self.workers.stop()
            if self.waiter is not None:
                self.waiter.stop()
        finally:
            if self.scatter is not None:
                self.scatter.stop()

    def post(self, event: object) -> None:
        """Any thread: hand an event to the control thread; RuntimeError once it has died (an
        event nobody will handle would leave its caller waiting forever)."""
        with self._death_lock:
            if self.died is not None:
                raise RuntimeError(f"the kvstage control thread stopped: {self.died}")
            self.events.put(event)

    # -- the loop ----------------------------------------------------------------------------------
    def _run(self) -> None:
        backend, sock = self.ctx.backend, self.ctx.sock
        backend.adopt()
        poller = zmq.Poller()
        poller.register(sock.router, zmq.POLLIN)
        poller.register(self.events.fd, zmq.POLLIN)
        zfd = cast(int, sock.router.getsockopt(zmq.FD))  # edge-triggered: valid to wait on once drained
        self.meter.started()
        wait, act = MIN_EAGER_WAIT, Activity.QUIET
        try:
            while not self._stop.is_set():
                if act is Activity.QUIET:
                    poller.poll(math.ceil(wait * 1000))   # whole ms: rounded down, it would spin to the tick
                else:  # the zmq fd is edge-triggered: valid to wait on once drained, as it is here
                    select.select([zfd, self.events.fd], [], [], wait)
                woke = time.monotonic()
                self.meter.wake()
                busy = self._read_socket()
                for ev in self.events.drain():
                    busy = True
                    self._safely(self._on_event, ev)
                self.steps[act.value] += 1
                stepped = time.monotonic()
                tags, progressed = self._step()
                done = time.monotonic()
                self._starved.step(done - stepped, done)
                if tags:
                    self._safely(self.router.on_tags, tags)
                for ev in self.events.drain():   # completions the step found, handled this round
                    busy = True
                    self._safely(self._on_event, ev)
                now = time.monotonic()
                self._starved.round(now - woke)
                if now >= self._next_tick:
                    self._starved.tick(now - self._next_tick if self._next_tick else 0.0, self.ctx.stats, now)
                    busy |= self._read_socket()     # leases are judged on everything that came in
                    now = time.monotonic()
                    self._next_tick = now + TICK
                    self._safely(lambda _: sock.flush_held(), None)
                    self._safely(self._tick, now)
                flight = backend.in_flight()
                act = activity(flight)
                wait = next_wait(act, last=wait, progressed=busy or progressed, now=now, next_tick=self._next_tick,
                                 postable=bool(flight.postable))
        except BaseException as exc:  # noqa: BLE001 - said in the log and to every room, not re-raised
            self._die(exc)
        finally:
            self.meter.stopped()
            self._teardown()
            backend.release_ownership()

    def _read_socket(self) -> bool:
        """Handle what waits on the socket; `looked` is when the last read that got to the end
        began (nothing that came before it still waits: protocol/leases.py judges silence up to
        it). Whether there was anything."""
        looking = time.monotonic()
        items = self.ctx.sock.recv_batch()
        if len(items) < MAX_BATCH:
            self.looked = looking
        for item in items:
            self._safely(self._on_frame, item)
        return bool(items)

    def _on_frame(self, item: object) -> None:
        self.router.on_frame(item, time.monotonic())

    def _on_event(self, ev: object) -> None:
        if TRACE.on:
            TRACE.hop(Hop.EVENT_TAKEN, getattr(ev, "room", None), f"ctrl {type(ev).__name__}")
        handler = self.on_event.get(type(ev))
        if handler is None:
            self.ctx.stats.count("dropped_events", type(ev).__name__)  # an event for the other role
            return
        handler(ev, time.monotonic())

    def _tick(self, now: float) -> None:
        self.side.tick_rooms(now)
        if self.writes is not None:
            self.writes.tick(now)
        self.side.tick(now)
        self.liveness.tick(now, self.looked)
        if self._closing_since is not None:
            if not self.book.rooms or now - self._closing_since > self.ctx.t.close:
                self._stop.set()

    # -- errors ------------------------------------------------------------------------------------
    def _safely(self, fn: Callable[[T], None], arg: T) -> None:
        try:
            fn(arg)
        except Exception as exc:  # noqa: BLE001 - one bad input must never take the rank down
            log.exception("control thread: handling %s failed", type(arg).__name__)
            self._internal_error(type(arg).__name__, getattr(arg, "room", None), exc)

    def _step(self) -> Step:
        """backend.step(), guarded: the loop must go on (deadlines keep firing) when it raises."""
        try:
            return self.ctx.backend.step()
        except Exception as exc:  # noqa: BLE001
            log.exception("control thread: driving the backend failed")
            self._internal_error("backend_step", None, exc)
            return Step([], True)

    def _internal_error(self, what: str, room_id: object, exc: Exception) -> None:
        """Count an exception inside the loop and fail the rooms it may have left stuck, kind
        "internal": the room the input names, else every room the side says may be stuck
        (writes in flight on prefill, notifications awaited on decode); then, on a prefill rank,
        end each such room's writes the raising input lost before the write queue took them
        (`WriteQueue.settle_lost`), so that it is released."""
        self.ctx.stats.count("internal_errors", what)
        if isinstance(room_id, int) and not isinstance(room_id, bool):
            ids = [room_id] if room_id in self.book.rooms else []
        else:
            ids = self.side.stuck_rooms()
        now = time.monotonic()
        reason = f"internal error in the control thread ({what}: {type(exc).__name__}: {exc})"
        for r in ids:
            try:
                self.book.fail(r, FailureKind.INTERNAL, reason, now)
                if self.writes is not None:   # a prefill rank: the room's writes the error lost
                    self.writes.settle_lost(r, reason, now)
            except Exception:  # noqa: BLE001
                log.exception("control thread: failing room %s after an internal error failed", r)

    def _die(self, exc: BaseException) -> None:
        """The loop itself raised (outside the per-input guards): nothing will drive these rooms
        again, so each fails with the reason now, and every later post() raises. close() still
        releases the rank (KVManager._stop_loop finds the thread gone)."""
        log.critical("kvstage control thread stopped on an error", exc_info=exc)
        reason = f"the kvstage control thread stopped: {type(exc).__name__}: {exc}"
        with self._death_lock:
            self.died = reason
            waiting = self.events.drain()
        statuses = list(self.book.status.values()) + [ev.status for ev in waiting if hasattr(ev, "status")]
        for status in statuses:
            if status.state not in (KVPoll.Success, KVPoll.Failed):
                status.update(KVPoll.Failed, reason, FailureKind.INTERNAL, released=False)
        for ev in waiting:
            if isinstance(ev, Call):
                ev.done(None)

    # -- closing -----------------------------------------------------------------------------------
    def begin_close(self) -> None:
        """On the control thread: fail every room; stop once all are released (or time is up)."""
        now = time.monotonic()
        self._closing_since = now
        for room in list(self.book.rooms.values()):
            self.book.apply(room, self.side.closing(room, now))

    def _teardown(self) -> None:
        try:
            clean = not any(getattr(r, "ops", None) for r in self.book.rooms.values())  # no write of ours in flight
            for peer in list(self.peers.peers.values()):
                if peer.state in (PeerState.CONNECTED, PeerState.CONNECTING):
                    self.ctx.sock.send(peer.endpoint, Goodbye(src=self.ctx.me, dst=peer.key.incarnation,
                                                              reason="closing", clean=clean, conn=peer.conn))
            time.sleep(0.01)  # let zmq hand the goodbyes to the kernel before the sockets close
        finally:  # the sockets close even if a goodbye could not be sent: the context waits for them
            self.ctx.sock.close()
            self.events.close()
