"""`KVManager`: what one rank process embeds. It wires the backend's owning thread, the staging
handler, the control thread and the bootstrap registration together, and takes them down in
the opposite order, deregistering memory only once no peer can still write to it."""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
import zmq

from ...bootstrap import BootstrapError, RankGone, RankInfo, open_rendezvous
from ...hop_trace import TRACE
from ...staging.handler import StagingHandler
from ...staging.kernels import kernel_choice, requested_kernels
from ...staging.warmup import warm_kernels
from ..backends import create_backend
from ..backends.base import Backend, Registration
from ..backends.faults import ControlFaults, FaultPlan, FaultyBackend
from ..config import METRICS_PORT_ENV, EngineConfig, ResolvedConfig, Timeouts
from ..kv_buffers import KVBuffers
from ..layout import KVLayout
from ..pool_spec import check_pool_items
from ..protocol.kinds import Role
from ..protocol.messages import peer_codec
from ..protocol.path_choice import PathMode
from ..protocol.peering import stage_record
from ..protocol.tags import TagCodec
from ..regions import buffer_regions, unregistrable
from .backend_owner import BackendOwner
from .calibration import Calibration, calibrate
from .events import Call, NewReceiver, NewSender, Wake
from .handles import KVReceiver, KVSender, PoolItemsArg, RoomStatus, check_num_tokens
from .loop import EngineLoop
from .prefill_sources import SourceResolver, make_source
from .stats import Snapshot, Stats, meter_stats

if TYPE_CHECKING:
    from ..metrics import MetricsExporter

log = logging.getLogger("kvstage")

# KVManager() runs these in order, each `_start_<step>` (listed as bound methods in __init__), each
# pushing its own undo; a failure at any of them undoes the ones before, newest first
# (tests/integration/test_startup_steps.py injects one at each step and checks that the methods,
# this list and the order they ran in agree).
STARTUP_STEPS = ("metrics", "backend", "regions", "staging", "control_context", "bootstrap_client",
                 "sources", "control_loop", "control_thread", "registration", "keepalive")

T = TypeVar("T")


class KVManager:
    """The KV transfer engine of one prefill or decode rank (README, "Embedding it")."""

    def __init__(self, config: EngineConfig, layout: KVLayout, buffers: KVBuffers):
        self.config = config.resolved()
        if self.config.path == PathMode.STAGED and layout.mla:
            raise ValueError("path='staged' (EngineConfig.path / KVSTAGE_PATH) cannot be used with an MLA model: "
                             "its latent is replicated and moves as whole pages on the direct path")
        if self.config.role == Role.DECODE and layout.page_shards > 1:
            raise ValueError(f"page_shards={layout.page_shards} on a decode rank: KV page sharding is a prefill's "
                             f"(SGLang shards prefill engines only); a decode takes every page whole")
        self.layout = layout
        self.buffers = buffers.validate(layout)
        self.num_pages = buffers.num_pages
        self.incarnation = secrets.randbits(63) | 1
        self._sessions = itertools.count(1)  # increasing: a prefill rank tells earlier uses of a room id apart
        self._stats = Stats()
        self._rooms: dict[int, RoomStatus] = {}
        self._rooms_lock = threading.Lock()
        self._closed = False
        self._metrics_option_explicit = config.metrics_port is not None
        cfg = self.config
        check_kernels(cfg, self.layout, self.buffers)   # the last check: nothing is created before it
        self._stack = contextlib.ExitStack()
        self._metrics: MetricsExporter | None = None
        self._loop_stuck = False
        self.metrics_port: int | None = None   # where /metrics is served (the bound port when 0 was asked)
        self.name = f"kvstage-{cfg.engine_id}-{cfg.role}{self.layout.rank}-{self.incarnation & 0xFFFFFF:06x}"
        TRACE.name_process(f"{cfg.role}{self.layout.rank}")   # KVSTAGE_TRACE (hop_trace.py); else nothing
        try:
            steps = (self._start_metrics, self._start_backend, self._start_regions, self._start_staging,
                     self._start_control_context, self._start_bootstrap_client, self._start_sources,
                     self._start_control_loop, self._start_control_thread, self._start_registration,
                     self._start_keepalive)   # STARTUP_STEPS, in order
            for step in steps:
                step(cfg)
        except BaseException:
            # everything already created goes, newest first; each undo is bounded, so the
            # original error reaches the caller within seconds (never a hang in cleanup)
            self._closed = True
            try:
                self._stack.close()
            except Exception:  # noqa: BLE001 - the start-up error is the one the caller needs
                log.exception("kvstage %s: cleaning up after a failed start raised", self.name)
            raise
        log.info("kvstage %s rank %d of %s ready on %s (backend %s, staging %s)", cfg.role, self.layout.rank,
                 cfg.engine_id, self.endpoint, cfg.backend, "on" if cfg.staging else "off")

    @property
    def _timeouts(self) -> Timeouts:
        return self.config.timeouts

    # -- start-up, one step each (STARTUP_STEPS); each pushes its own undo ----------------------------
    def _start_metrics(self, cfg: ResolvedConfig) -> None:
        """First of all, so a port in use or a missing prometheus-client fails at once."""
        if cfg.metrics_port is None:
            return
        from ..metrics import MetricsExporter  # prometheus-client only when metrics are asked for
        option = "metrics_port" if self._metrics_option_explicit else METRICS_PORT_ENV
        labels = {"role": cfg.role, "engine": cfg.engine_id, "rank": str(self.layout.rank),
                  "backend": cfg.backend}
        self._metrics = MetricsExporter(cfg.host, cfg.metrics_port, labels, self.stats, option)
        self._stack.callback(self._metrics.close)
        self.metrics_port = self._metrics.port

    def _start_backend(self, cfg: ResolvedConfig) -> None:
        plan = FaultPlan.from_dict(cfg.faults) if cfg.faults else None
        # owned by this thread until the control thread starts, and again once it stopped
        self._backend = BackendOwner(self._make_backend(cfg, plan), wake=lambda: self._loop.post(Wake()))
        self._stack.callback(self._backend.close)

    def _start_regions(self, cfg: ResolvedConfig) -> None:
        """The KV layers and each state pool, each registered as its own region with its own
        memory kind (transfer/regions.py)."""
        regions = buffer_regions(self.buffers)
        kinds = self._backend.call(lambda b: b.memory_kinds)
        problem = unregistrable(regions, kinds, cfg.backend)
        if problem:
            raise ValueError(problem)
        for region in regions:
            reg = self._backend.call(lambda b, spans: b.register(spans), region.spans)
            self._stack.callback(self._deregister, reg)

    def _deregister(self, reg: Registration) -> None:
        self._backend.call(lambda b: b.deregister(reg))

    def _start_staging(self, cfg: ResolvedConfig) -> None:
        staging = cfg.staging and cfg.path != PathMode.DIRECT   # forced direct: no ring, no buffers
        staged = staging and not self.layout.mla
        # an MLA prefill stages nothing, but writes a decode with context parallel through its
        # buffers: each decode rank's tokens gathered into one (token_mapping.Relayout)
        workers, buffer_mb, ring_mb = cfg.staging_workers, cfg.staging_buffer_mb, cfg.ring_mb
        self._handler = StagingHandler(
            cfg.role, lambda r: self._backend.call(lambda b: b.register(r)), self._deregister,
            epoch=self.incarnation, device=self.buffers.device,
            workers=workers if staging and cfg.role == Role.PREFILL else 0,
            buffer_bytes=int(buffer_mb * (1 << 20)),
            ring_bytes=int(ring_mb * (1 << 20)) if staged and cfg.role == Role.DECODE else 0)
        self._handler.open()
        self._stack.callback(self._handler.close)
        self._calibration = self._calibrate(cfg, staged)
        if staged:
            self._warm_kernels(cfg, self.layout.page_size)
        elif staging and cfg.role == Role.PREFILL:   # an MLA prefill's relayouts gather token by token
            self._warm_kernels(cfg, 1)

    def _warm_kernels(self, cfg: ResolvedConfig, page_tokens: int) -> None:
        """Every gather/scatter kernel this layout can use, built (or loaded from Triton's cache)
        now rather than in the first staged request (staging/warmup.py); nothing on CPU.
        `page_tokens`: the tokens a gathered entry holds (the page size; 1 for the relayout's
        pool slots, token_mapping.Relayout)."""
        b, lay = self.buffers, self.layout
        try:
            launches, seconds = warm_kernels(role=cfg.role, k=b.entry_k, v=b.entry_v, page_size=page_tokens,
                                             local_heads=lay.local_heads,
                                             num_pages=b.num_pages * lay.page_size // page_tokens,
                                             region_bytes=lay.num_kv * len(b.entry_k) * page_tokens * lay.token_bytes)
        except Exception as exc:  # noqa: BLE001 - the first request then compiles, as before
            log.warning("kvstage %s: building the staging kernels at start failed (%s: %s); the first staged "
                        "request builds them", self.name, type(exc).__name__, exc)
            return
        if launches:
            log.info("kvstage %s: %d kernel variants ready in %.2f s", self.name, launches, seconds)
            self._stats.set("kernel_warmup_s", seconds)

    def _calibrate(self, cfg: ResolvedConfig, staged: bool) -> Calibration | None:
        """The path costs (calibration.py), measured when the choice needs them: staging on and
        the path not forced. None otherwise (the rank plans by the fixed rule)."""
        if not (staged and cfg.calibrate and cfg.path == PathMode.AUTO):
            return None
        device = self.buffers.device
        options = {k: v for k, v in self._make_backend_options(cfg).items() if k != "agent_name"}
        cal = calibrate(backend_kind=cfg.backend, call=self._backend.call,
                        make_probe=lambda: create_backend(cfg.backend, f"{self.name}-probe", cfg.host, **options),
                        device=device, mem_kind="VRAM" if device.type == "cuda" else "DRAM",
                        row_bytes=self.layout.page_size * self.layout.token_bytes,
                        writes=cfg.role == Role.PREFILL)
        log.info("kvstage %s: path costs measured in %.0f ms: %s, scatter %s B/s", self.name, cal.seconds * 1e3,
                 cal.writer, f"{cal.scatter_bytes_per_s:.3g}" if cal.scatter_bytes_per_s else None)
        self._stats.set("calibration_s", cal.seconds)
        return cal

    def _start_control_context(self, cfg: ResolvedConfig) -> None:
        self._ctx = zmq.Context()
        self._stack.callback(self._close_context)

    def _start_bootstrap_client(self, cfg: ResolvedConfig) -> None:
        # a server, or etcd
        self._bootstrap = open_rendezvous(cfg.bootstrap, token=cfg.token_bytes)
        self._stack.callback(self._bootstrap.close)

    def _start_sources(self, cfg: ResolvedConfig) -> None:
        # other rendezvous, lazily; a decode rank hears of prefill ranks the rendezvous dropped (etcd)
        on_gone = self._rank_gone if cfg.role == Role.DECODE else None
        self._sources = SourceResolver(self._bootstrap, cfg.token_bytes, on_gone=on_gone)
        self._stack.callback(self._sources.close)

    def _start_control_loop(self, cfg: ResolvedConfig) -> None:
        plan = FaultPlan.from_dict(cfg.faults) if cfg.faults else None
        self._loop = EngineLoop(cfg, self.layout, self.buffers, self.incarnation, self._backend,
                                self._backend.call(lambda b: b.name), self._backend.call(lambda b: b.identity()),
                                self._handler, self._stats, self._sources.lookup,
                                peer_codec(cfg.token_bytes), self._ctx, ControlFaults(plan) if plan else None,
                                observer=self._metrics.observer if self._metrics is not None else None,
                                calibration=self._calibration,
                                siblings=functools.partial(self._bootstrap.lookup, cfg.engine_id))
        self._stack.callback(self._stop_loop)
        self.endpoint = self._loop.endpoint

    def _start_control_thread(self, cfg: ResolvedConfig) -> None:
        self._loop.start()   # stopped by _stop_loop, pushed with the loop

    def _start_registration(self, cfg: ResolvedConfig) -> None:
        self._info = RankInfo(
            engine_id=cfg.engine_id, role=cfg.role, tp_size=self.layout.ranks, tp_rank=self.layout.rank,
            ctrl_endpoint=self.endpoint, backend=cfg.backend, backend_identity=self._backend.call(lambda b: b.name),
            layout={**{k: v for k, v in msgspec.structs.asdict(self.layout.summary()).items() if k != "pools"},
                    **stage_record(self.layout)},
            pools=self._pools(), incarnation=self.incarnation, dp_rank=cfg.dp_rank)
        self._register(self._timeouts.bootstrap)

    def _start_keepalive(self, cfg: ResolvedConfig) -> None:
        # stopped by the bootstrap client's close(); close() deregisters first
        self._bootstrap.start_keepalive(self._info, interval_s=self._timeouts.heartbeat)

    def _make_backend_options(self, cfg: ResolvedConfig) -> dict[str, Any]:
        options = dict(cfg.backend_options)
        if cfg.backend == "mooncake":
            # a Mooncake write cannot be cancelled once inside the engine: bound how long it may
            # make no progress (and so how long memory stays quarantined), and let a big but
            # progressing write run until the write deadline
            options.setdefault("stall_timeout_s", self._timeouts.mooncake_stall())
            options.setdefault("transfer_timeout_s", self._timeouts.write)
        return options

    def _make_backend(self, cfg: ResolvedConfig, plan: FaultPlan | None) -> Backend:
        backend = create_backend(cfg.backend, self.name, cfg.host, **self._make_backend_options(cfg))
        if plan is None:
            return backend
        log.warning("kvstage rank %s runs with injected faults: %s", self.name, plan)
        codec = TagCodec(cfg.token_bytes)
        rooms = set(plan.corrupt_rooms)

        def retag(data: bytes) -> bytes | None:
            tag = codec.decode(data)
            if tag.room not in rooms:
                return None
            return codec.encode(msgspec.structs.replace(tag, ring_start=tag.ring_start + 256, page_start=tag.page_start + 1))
        return FaultyBackend(backend, plan, retag, room_of=lambda data: codec.decode(data).room)

    def _pools(self) -> dict[str, int]:
        pools = {"kv": sum(t.numel() * t.element_size() for t in self.buffers.tensors())}
        if self._handler.ring is not None:
            pools["staging_ring"] = self._handler.ring.nbytes
        if self._handler.buffers:
            pools["staging_buffers"] = sum(b.nbytes for b in self._handler.buffers)
        return pools

    def _rank_gone(self, gone: RankGone) -> None:
        """From a rendezvous' watch thread: the control thread fails what depended on that rank."""
        loop = getattr(self, "_loop", None)
        if loop is not None and not self._closed:
            with contextlib.suppress(RuntimeError):   # the control thread died: its rooms failed already
                loop.post(gone)

    def _register(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._bootstrap.register(self._info)
                return
            except BootstrapError as exc:
                # a permanent refusal fails at once with the server's reason; no answer or a
                # transient error is retried until the bootstrap deadline
                if exc.permanent or time.monotonic() > deadline:
                    raise BootstrapError(f"registering at the rendezvous {self.config.bootstrap} failed: "
                                         f"{exc}", exc.kind) from exc
                time.sleep(0.2)

    # -- per-request handles -----------------------------------------------------------------------
    def sender(self, room: int, num_pages: int | None = None, pool_items: PoolItemsArg | None = None, *,
               num_tokens: int | None = None) -> KVSender:
        """Prefill side of a request; num_pages = pages of this request held by this rank, or
        None when not known yet (give it, and `pool_items`, later with the sender's init());
        `pool_items`: its items of the state pools ({pool name: [item, ...]}); `num_tokens`: the
        request's token count, needed when the decode engine has decode context parallel."""
        self._check("prefill", room)
        if num_pages is not None and (isinstance(num_pages, bool) or not isinstance(num_pages, int)
                                      or num_pages <= 0):
            raise ValueError(f"num_pages must be a positive int or None, got {num_pages!r}")
        if num_pages is None and (pool_items is not None or num_tokens is not None):
            raise ValueError("pool_items and num_tokens come with the page count: give them to sender() or to init()")
        check_num_tokens(room, num_tokens)
        items = check_pool_items(pool_items, self.buffers.pools, f"room {room} sender()")
        status = self._claim(room)
        # sharded pages (KVLayout.page_shards): send() takes logical page ids, this rank holding 1 in page_shards
        handle = KVSender(self._post, self.num_pages * self.layout.page_shards, room, num_pages, status, self._forget,
                          self.buffers.pools,
                          layers=self.layout.layers, pool_items=items)
        self._post(NewSender(room=room, num_pages=num_pages, status=status, pool_items=items, num_tokens=num_tokens))
        return handle

    def receiver(self, room: int, prefill_engine: str | None = None, *, bootstrap: str | None = None,
                 prefill_dp_rank: int | None = None) -> KVReceiver:
        """Decode side of a request whose KV comes from the prefill engine `prefill_engine` (at
        this rank's rendezvous server, or at `bootstrap`), or from the engine of DP rank
        `prefill_dp_rank` (default 0) of the prefill instance whose rendezvous server is
        `bootstrap` ("host:port")."""
        self._check("decode", room)
        source = make_source(prefill_engine, bootstrap, prefill_dp_rank)
        status = self._claim(room)
        handle = KVReceiver(self._post, self.num_pages, room, prefill_engine or source.key, status, self._forget,
                            self.buffers.pools)
        self._post(NewReceiver(room=room, session=next(self._sessions), source=source, status=status))
        return handle

    def _check(self, role: str, room: int) -> None:
        if self._closed:
            raise RuntimeError("the KVManager is closed")
        if self.config.role != role:
            raise ValueError(f"this is a {self.config.role} rank; {'sender' if role == Role.PREFILL else 'receiver'}() "
                             f"belongs on a {role} rank")
        if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room < 1 << 64:
            raise ValueError(f"room must be an unsigned 64-bit int, in [0, 2**64), got {room!r}")

    def _claim(self, room: int) -> RoomStatus:
        with self._rooms_lock:
            old = self._rooms.get(room)
            if old is not None and not old.released:
                raise ValueError(f"room {room} is still active on this rank")
            status = RoomStatus()
            self._rooms[room] = status
            if len(self._rooms) > 4096:
                for r in [r for r, s in self._rooms.items() if s.released]:
                    del self._rooms[r]
            else:
                self._prune_cleared()
            return status

    def _forget(self, room: int, status: RoomStatus) -> None:
        """A handle was cleared: its status goes once the room is released (at once if it is)."""
        with self._rooms_lock:
            status.cleared = True
            self._prune_cleared()

    def _prune_cleared(self) -> None:
        for r in [r for r, s in self._rooms.items() if s.cleared and s.released]:
            del self._rooms[r]

    def _post(self, event: object) -> None:
        if self._closed:
            raise RuntimeError("the KVManager is closed")
        self._loop.post(event)

    # -- observability and shutdown ------------------------------------------------------------------
    def stats(self) -> Snapshot:
        """Counters: bytes, write requests, descriptors, gather/scatter time, ring occupancy,
        rooms by outcome, failures by kind, dropped messages by reason."""
        out = self._stats.snapshot()
        with self._rooms_lock:
            self._prune_cleared()
            out["rooms_tracked"] = len(self._rooms)       # handles' statuses this manager still holds
        live = self._on_loop(_live_stats, timeout=2.0)
        if live:
            out.update(live)
        if self._metrics is not None:
            for key, value in meter_stats(self._metrics.meters).items():
                out.setdefault(key, {}).update(value)
        return out

    def _on_loop(self, fn: Callable[[EngineLoop], T], timeout: float) -> T | None:
        loop = getattr(self, "_loop", None)   # a scrape may come while the manager is still starting
        if self._closed or loop is None or not loop.thread.is_alive():
            return None
        fut: Future[T] = Future()
        try:
            loop.post(Call(fn, fut.set_result))
        except RuntimeError:   # the control thread died (its reason is in every room's failure)
            return None
        try:
            return fut.result(timeout)
        except Exception:  # noqa: BLE001 - stats are best effort while busy
            return None

    def close(self) -> None:
        """Fail what is in flight, tell peers, wait until nothing can still be written into this
        rank's memory (bounded by timeouts.close), then release everything. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._metrics is not None:   # first: no scrape sees the rank half torn down
            try:
                self._metrics.close()
            except Exception:  # noqa: BLE001 - close() goes on
                log.exception("closing kvstage %s: stopping the metrics server raised", self.name)
        with contextlib.suppress(Exception):
            self._bootstrap.deregister(self.config.engine_id, self.layout.rank, self.incarnation)
        try:
            self._stack.close()  # every step runs even if an earlier one raised
        except Exception:  # noqa: BLE001 - close() must not raise once everything is down
            log.exception("closing kvstage %s: a step raised", self.name)
        try:
            TRACE.dump()   # KVSTAGE_TRACE: this process's hops so far (hop_trace.py); off, nothing
        except OSError:
            log.exception("closing kvstage %s: writing the hop trace failed", self.name)

    def _stop_loop(self) -> None:
        loop = self._loop
        if loop.thread.ident is None:          # never started: its socket is still this thread's
            loop.discard()
        elif loop.thread.is_alive():
            with contextlib.suppress(RuntimeError):   # it died: it is ending by itself
                loop.post(Call(lambda lp: lp.begin_close(), lambda _: None))
            loop.thread.join(self._timeouts.close + 30)
        if loop.thread.is_alive():
            self._loop_stuck = True
            log.error("the kvstage control thread did not stop; leaving the backend to it")
            return
        # the backend is this thread's again: no write may stay in flight past this point,
        # which also unblocks transfer workers waiting for theirs
        self._backend.adopt()
        try:
            self._backend.abort_writes()
        finally:  # the workers stop (and the backend closes, a later callback) even if that raised
            loop.stop_workers()

    def _close_context(self) -> None:
        """Context.term() waits for every socket of the context to close: bounded here. The
        control thread closes its own sockets when it ends (or discard() did, when it never
        ran); a socket left open after that is closed now rather than waited for. While the
        thread is still running (stuck), its sockets are its own: the context is left to it."""
        if self._loop_stuck:
            log.error("kvstage %s: leaving the control context open to the stuck control thread", self.name)
            return
        self._ctx.destroy(linger=0)

    def __enter__(self) -> KVManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_kernels(cfg: ResolvedConfig, layout: KVLayout, buffers: KVBuffers) -> None:
    """KVSTAGE_STAGING_KERNELS, checked before anything is created: its value on every rank,
    and the choice against the KV cache's device where this rank stages (prefill workers
    gather, the decode ring scatters). ValueError (RuntimeError: triton asked for by name but
    not importable) naming the variable."""
    requested_kernels()
    if cfg.staging and not layout.mla:
        kernel_choice(buffers.device)


def _live_stats(loop: EngineLoop) -> Snapshot:
    out: Snapshot = {"rooms_active": len(loop.rooms), "peers_connected": len(loop.peers.connected())}
    a = loop.ctx.handler.allocator
    if a is not None:
        out.update(ring_bytes=a.size, ring_live_bytes=a.live_bytes, ring_live_regions=a.live_regions,
                   ring_held_bytes=a.held_bytes,
                   ring_occupied_bytes=a.occupied_bytes, ring_high_water_bytes=min(a.high_water, a.size),
                   ring_backlog_high_water_bytes=a.high_water, ring_credit_bytes=loop.credit_bytes())
    out["staged_pieces_waiting"] = loop.staged_waiting()
    out["quarantined_bytes"] = loop.side.quarantined_bytes()
    out["room_state"] = loop.room_state()
    out["backend_steps"] = dict(loop.steps)
    out.update(meter_stats(loop.meters()))
    return out
