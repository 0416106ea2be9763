"""The worker side: one kvstage KVManager per vLLM worker (TP rank), fed the scheduler's orders.

Rank 0 of each instance runs the instance's kvstage rendezvous server in its own process, on
`rendezvous_port`; every rank registers there (registration retries until kvstage's bootstrap
deadline, so ranks may start in any order). Prefill ranks push: a SendOrder becomes
`mgr.sender(room, num_pages)` and one `send()` of the request's prompt pages, staged for
heterogeneous TP. Decode ranks open `mgr.receiver(room, bootstrap=prefill rendezvous)` and
`init()` their pages past the local prefix. A request is reported finished to vLLM only once
kvstage says no write of it can still land (its blocks are then freed or reused by vLLM); a
failed receive also reports its blocks as load errors.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from kvstage import EngineConfig, KVManager, KVPoll
from kvstage.bootstrap.in_process import InProcessServer

from .params import ConnectorSettings
from .plan import StepOrders

log = logging.getLogger("kvstage.vllm")


@dataclass
class _Tracked:
    handle: object
    pages: tuple[int, ...] = ()
    aborted: bool = False


@dataclass
class WorkerSide:
    """One worker's requests in flight. Not thread-safe: vLLM calls it from one thread."""

    settings: ConnectorSettings
    is_prefill: bool
    tp_rank: int
    engine_id: str
    manager: KVManager | None = None
    rendezvous: InProcessServer | None = None
    _sends: dict[str, _Tracked] = field(default_factory=dict)
    _recvs: dict[str, _Tracked] = field(default_factory=dict)
    _load_errors: set[int] = field(default_factory=set)
    _refused_sends: set[str] = field(default_factory=set)
    _refused_recvs: set[str] = field(default_factory=set)
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
        for o in orders.sends:
            try:
                h = self.manager.sender(o.room, num_pages=len(o.pages))
                h.send(list(o.pages))
                self._sends[o.req_id] = _Tracked(h, o.pages)
            except (ValueError, RuntimeError) as exc:
                log.warning("kvstage: request %s: cannot send room %d: %s", o.req_id, o.room, exc)
                self._refused_sends.add(o.req_id)
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

    def _receiver(self, source):
        return self.manager.receiver(source.room, bootstrap=source.rendezvous, prefill_dp_rank=source.dp_rank)

    def finished(self) -> tuple[set[str], set[str]]:
        """(sending ended, receiving ended): requests whose memory kvstage no longer touches."""
        sending, self._refused_sends = self._collect(self._sends) | self._refused_sends, set()
        recving, self._refused_recvs = self._collect(self._recvs, load_errors=True) | self._refused_recvs, set()
        return sending, recving

    def _collect(self, table: dict[str, _Tracked], load_errors: bool = False) -> set[str]:
        done = set()
        for req_id, t in list(table.items()):
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
        return len(self._sends) + len(self._recvs)

    def close(self) -> None:
        if self.manager is not None:
            self.manager.close()
            self.manager = None
        if self.rendezvous is not None:
            self.rendezvous.close()
            self.rendezvous = None
