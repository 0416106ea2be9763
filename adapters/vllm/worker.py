"""The worker side: one kvstage KVManager per vLLM worker (TP rank), fed the scheduler's orders.

Rank 0 of each instance runs the instance's kvstage rendezvous server in its own process, on
`rendezvous_port`; every rank registers there (registration retries until kvstage's bootstrap
deadline, so ranks may start in any order). Prefill ranks push, staged for heterogeneous TP:
layer-wise, a StreamOrder opens `mgr.sender(room, num_pages)` at the request's first step and
each step's completed pages go out one layer at a time (`save_layer`, from vLLM's save_kv_layer;
`end_step` sends the layers no save_kv_layer named); chunk-wise, a SendOrder is one `send()` of
the request's prompt pages once it finished. Decode ranks open `mgr.receiver(room,
bootstrap=prefill rendezvous)` and `init()` their pages past the local prefix. A request is reported finished to vLLM only once
kvstage says no write of it can still land (its blocks are then freed or reused by vLLM); a
failed receive also reports its blocks as load errors.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from kvstage import EngineConfig, KVManager, KVPoll
from kvstage.bootstrap.in_process import InProcessServer

from .params import ConnectorSettings
from .plan import StepOrders

log = logging.getLogger("kvstage.vllm")


@dataclass
class _Tracked:
    handle: object                   # None: kvstage refused to open it (reported as failed)
    pages: tuple[int, ...] = ()
    aborted: bool = False
    room: int = -1
    vllm_done: bool = True           # prefill: vLLM finished the request (only then is it reported)


@dataclass
class _StepSend:
    """A streaming request's pages that this step's forward completes."""

    req_id: str
    tracked: _Tracked
    pages: list[int]


def _runs(layers: list[int]) -> list[range]:
    """Sorted layer indices as ranges of consecutive layers."""
    out: list[range] = []
    for layer in layers:
        if out and out[-1].stop == layer:
            out[-1] = range(out[-1].start, layer + 1)
        else:
            out.append(range(layer, layer + 1))
    return out


@dataclass
class WorkerSide:
    """One worker's requests in flight. Not thread-safe: vLLM calls it from one thread."""

    settings: ConnectorSettings
    is_prefill: bool
    tp_rank: int
    engine_id: str
    ready: Callable[[], object] = lambda: None   # a readiness object for layers just written (CUDA event)
    manager: KVManager | None = None
    rendezvous: InProcessServer | None = None
    _sends: dict[str, _Tracked] = field(default_factory=dict)
    _recvs: dict[str, _Tracked] = field(default_factory=dict)
    _load_errors: set[int] = field(default_factory=set)
    _refused_sends: set[str] = field(default_factory=set)
    _refused_recvs: set[str] = field(default_factory=set)
    _dropped: list[_Tracked] = field(default_factory=list)      # preempted streams, until released
    _step: list[_StepSend] = field(default_factory=list)
    _step_layers: set[int] = field(default_factory=set)
    _layers: range = range(0)
    counts: dict[str, float] = field(default_factory=lambda: dict.fromkeys(
        ("succeeded", "failed", "bytes", "seconds", "staged", "direct"), 0))

    def start(self, layout, buffers) -> None:
        """The rendezvous server (rank 0), then this rank's engine; on failure nothing stays."""
        cfg = self.settings
        if self.tp_rank == 0:
            self.rendezvous = InProcessServer(cfg.host.strip("[]"), cfg.rendezvous_port)
        try:
            self.manager = KVManager(EngineConfig(role="prefill" if self.is_prefill else "decode",
                                                  engine_id=self.engine_id, bootstrap=cfg.rendezvous,
                                                  backend=cfg.backend, staging=cfg.staging, host=cfg.host,
                                                  metrics_port=None if cfg.metrics_port is None
                                                  else cfg.metrics_port + self.tp_rank),
                                     layout, buffers)
            self._layers = layout.layers
        except BaseException:
            if self.rendezvous is not None:
                self.rendezvous.close()
                self.rendezvous = None
            raise

    def apply(self, orders: StepOrders | None) -> None:
        """This step's orders from the scheduler. Never raises into vLLM: an order kvstage
        refuses fails its request (reported at the next get_finished, a receive with its blocks
        as load errors), with the reason in the log."""
        if orders is None or self.manager is None:
            return
        for d in orders.drops:
            t = self._sends.get(d.req_id)
            if t is not None and t.room == d.room:
                del self._sends[d.req_id]
                if t.handle is not None:
                    t.aborted = True
                    t.handle.abort()
                    self._dropped.append(t)
        for o in orders.sends:
            try:
                h = self.manager.sender(o.room, num_pages=len(o.pages))
                h.send(list(o.pages))
                self._sends[o.req_id] = _Tracked(h, o.pages, room=o.room)
            except (ValueError, RuntimeError) as exc:
                log.warning("kvstage: request %s: cannot send room %d: %s", o.req_id, o.room, exc)
                self._refused_sends.add(o.req_id)
        for s in orders.streams:
            self._stream(s)
        for o in orders.recvs:
            try:
                h = self._receiver(o.source)
                h.init(list(o.pages), prefix_pages=o.prefix_pages)
                self._recvs[o.req_id] = _Tracked(h, o.pages)
            except (ValueError, RuntimeError) as exc:
                log.warning("kvstage: request %s: cannot receive room %d: %s", o.req_id, o.source.room, exc)
                self._refused_recvs.add(o.req_id)
                self._load_errors.update(o.pages)
        for o in orders.aborts:
            t = self._recvs.get(o.req_id) or self._sends.get(o.req_id)
            if t is not None:
                t.aborted = True
                if t.handle is not None:
                    t.handle.abort()
            elif o.source is not None:
                # a decode request that ended before vLLM gave it blocks: reach the prefill side
                # through a receiver that only aborts, so it frees the request's blocks at once
                try:
                    h = self._receiver(o.source)
                except (ValueError, RuntimeError) as exc:   # e.g. the room is still active here
                    log.info("kvstage: request %s: abort of room %d not sent: %s", o.req_id, o.source.room, exc)
                    continue
                h.abort()
                h.clear()

    def _stream(self, o) -> None:
        """A StreamOrder: open the sender on the request's first step, send the pages computed
        in earlier steps (every layer), keep this step's pages for save_layer / end_step."""
        t = self._sends.get(o.req_id)
        try:
            if o.open:
                t = self._sends[o.req_id] = _Tracked(None, room=o.room, vllm_done=False)
                t.handle = self.manager.sender(o.room, num_pages=o.num_pages)
            if t is None or t.handle is None or t.handle.poll() == KVPoll.Failed:
                return
            t.pages += o.before + o.pages
            if o.before:
                t.handle.send(list(o.before), ready=self.ready())
            if o.pages:
                self._step.append(_StepSend(o.req_id, t, list(o.pages)))
        except (ValueError, RuntimeError) as exc:
            self._fail_stream(o.req_id, t, exc)

    def _fail_stream(self, req_id: str, t: _Tracked | None, exc: Exception) -> None:
        """A send kvstage refused: the request fails (the decode side is told), never the step."""
        log.warning("kvstage: request %s: layer-wise send refused: %s", req_id, exc)
        self._step = [w for w in self._step if w.req_id != req_id]
        if t is not None and t.handle is not None:
            t.handle.abort()

    def save_layer(self, layer: int) -> None:
        """save_kv_layer: this step's pages of `layer` are written (on CUDA, once `ready()` fires)."""
        if not self._step or layer in self._step_layers or layer not in self._layers:
            return
        self._step_layers.add(layer)
        ready = self.ready()
        for w in list(self._step):
            try:
                w.tracked.handle.send(w.pages, layers=range(layer, layer + 1), ready=ready)
            except (ValueError, RuntimeError) as exc:
                self._fail_stream(w.req_id, w.tracked, exc)

    def end_step(self) -> None:
        """wait_for_save: the forward is done; send the layers of this step's pages that no
        save_kv_layer named (all of them when vLLM's attention never called it)."""
        missing = [layer for layer in self._layers if layer not in self._step_layers]
        if self._step and missing:
            ready = self.ready()
            for run in _runs(missing):
                for w in list(self._step):
                    try:
                        w.tracked.handle.send(w.pages, layers=run, ready=ready)
                    except (ValueError, RuntimeError) as exc:
                        self._fail_stream(w.req_id, w.tracked, exc)
        self._step, self._step_layers = [], set()

    def _receiver(self, source):
        return self.manager.receiver(source.room, bootstrap=source.rendezvous, prefill_dp_rank=source.dp_rank)

    def finished(self, finished_req_ids=()) -> tuple[set[str], set[str]]:
        """(sending ended, receiving ended): requests whose memory kvstage no longer touches.
        `finished_req_ids`: requests vLLM finished since the last step; a streaming request is
        reported only after vLLM finished it (before, its blocks are still the request's)."""
        for r in finished_req_ids or ():
            t = self._sends.get(r)
            if t is not None:
                t.vllm_done = True
        for t in list(self._dropped):
            if t.handle.released:
                t.handle.clear()
                self._dropped.remove(t)
        sending, self._refused_sends = self._collect(self._sends) | self._refused_sends, set()
        recving, self._refused_recvs = self._collect(self._recvs, load_errors=True) | self._refused_recvs, set()
        return sending, recving

    def _collect(self, table: dict[str, _Tracked], load_errors: bool = False) -> set[str]:
        done = set()
        for req_id, t in list(table.items()):
            if not t.vllm_done:
                continue
            if t.handle is None:          # kvstage refused to open it; the reason was logged
                self.counts["failed"] += 1
                del table[req_id]
                done.add(req_id)
                continue
            state = t.handle.poll()
            if state == KVPoll.Success:
                self.counts["succeeded"] += 1
                m = t.handle.metrics()
                if m is not None:
                    self.counts["bytes"] += m.nbytes
                    self.counts["seconds"] += m.seconds or 0.0
                    if m.path in ("staged", "direct"):
                        self.counts[m.path] += 1
            elif state == KVPoll.Failed and t.handle.released:
                self.counts["failed"] += 1
                if not t.aborted:
                    log.warning("kvstage: request %s failed: %s", req_id, t.handle.failure)
                    if load_errors:
                        self._load_errors.update(t.pages)
            else:
                continue
            t.handle.clear()
            del table[req_id]
            done.add(req_id)
        return done

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    @property
    def in_flight(self) -> int:
        return len(self._sends) + len(self._recvs) + len(self._dropped)

    def close(self) -> None:
        if self.manager is not None:
            self.manager.close()
            self.manager = None
        if self.rendezvous is not None:
            self.rendezvous.close()
            self.rendezvous = None
