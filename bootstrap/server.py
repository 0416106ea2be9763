"""The bootstrap server: a zmq ROUTER socket around the pure `Registry`.

One thread owns the socket and the registry; it decodes each request with the signed,
versioned codec, asks the registry, and sends the reply. Anything wrong on the wire gets an
Error reply where the sender can be answered, and is counted; nothing a peer sends can stop the
loop. Replies never block: a peer that does not read its replies loses them (zmq high-water
mark), the server does not wait for it.

Auth (when a token is set): a frame whose MAC does not verify is answered with an UNSIGNED
``Error(kind="auth")`` that echoes the request id when one can be read. The server cannot sign
for a sender that lacks the token, and must not hand signed text to strangers; the unsigned
refusal lets an honest client fail fast with a clear error instead of a timeout. Refusals are
logged, rate-limited.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable

import msgspec
import zmq

from ..wire import MAC_BYTES, WireError, sign
from . import messages as m
from .registry import Limits, Refused, Registry

log = logging.getLogger("kvstage.bootstrap.server")

SWEEP_EVERY_S = 0.25


class RateLimitedLog:
    """At most ``burst`` lines per ``period_s`` per key; then one line saying how many were
    suppressed. Keeps a flood of bad requests from filling the disk."""

    def __init__(self, logger: logging.Logger, burst: int = 10, period_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic):
        self._log, self._burst, self._period, self._clock = logger, burst, period_s, clock
        self._windows: dict[str, list] = {}  # key -> [window start, lines, suppressed]

    def __call__(self, key: str, level: int, msg: str, *args) -> None:
        now = self._clock()
        w = self._windows.setdefault(key, [now, 0, 0])
        if now - w[0] >= self._period:
            if w[2]:
                self._log.log(level, "%d more %r messages suppressed in the last %.0fs",
                              w[2], key, now - w[0])
            w[:] = [now, 0, 0]
        if w[1] < self._burst:
            w[1] += 1
            self._log.log(level, msg, *args)
        else:
            w[2] += 1


def endpoint(host: str, port: int) -> str:
    """tcp endpoint for a host name, IPv4 or IPv6 address (bracketed) and port."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


class BootstrapServer:
    """Owns the ROUTER socket and the registry. ``start()`` binds; ``serve(stop)`` runs the loop
    until ``stop`` is set; ``handle(frames)`` is one request -> reply step (no socket)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 8998, *, token: bytes | None = None,
                 lease_s: float = 10.0, forget_s: float | None = None,
                 limits: Limits | None = None, max_request: int = m.MAX_REQUEST,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time):
        self.host, self.port = host, port
        self.token = token
        self._clock, self._wall = clock, wall_clock
        self.started_at = wall_clock()
        # Epochs start at the start time in milliseconds: a restarted server hands out larger
        # epochs than its predecessor as long as that one assigned fewer than one per ms of life.
        self.registry = Registry(lease_s, forget_s, limits or Limits(), epoch_base=int(self.started_at * 1000))
        self.max_request = max_request
        self._codec = m.request_codec(token, max_frame=max_request)
        self._encoder = msgspec.msgpack.Encoder()
        self.counters: Counter[str] = Counter()
        self._ratelog = RateLimitedLog(log)
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        self.endpoint: str | None = None

    # ---- socket shell -------------------------------------------------------------------

    def start(self) -> str:
        """Bind the ROUTER socket; returns the bound endpoint (the real port when port is 0)."""
        self._ctx = zmq.Context()
        s = self._ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.LINGER, 0)
        # Frames above this are cut off by zmq itself (the peer is disconnected); frames between
        # max_request and this get an "oversized" Error reply.
        s.setsockopt(zmq.MAXMSGSIZE, max(4 * self.max_request, 1 << 20))
        s.setsockopt(zmq.SNDHWM, 10000)
        s.setsockopt(zmq.RCVHWM, 10000)
        if ":" in self.host:
            s.setsockopt(zmq.IPV6, 1)
        try:
            s.bind(endpoint(self.host, self.port))
        except zmq.ZMQError:
            s.close(0)
            self._ctx.term()
            raise
        self._sock = s
        last = s.getsockopt_string(zmq.LAST_ENDPOINT)
        self.port = int(last.rsplit(":", 1)[1])
        self.endpoint = endpoint(self.host, self.port)
        return self.endpoint

    def serve(self, stop: threading.Event, poll_ms: int = 100) -> None:
        assert self._sock is not None, "start() first"
        sock = self._sock
        next_sweep = self._clock()
        while not stop.is_set():
            if sock.poll(poll_ms, zmq.POLLIN):
                for _ in range(1000):  # drain a batch, then sweep and check stop again
                    try:
                        parts = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._serve_one(sock, parts)
            now = self._clock()
            if now >= next_sweep:
                self._sweep(now)
                next_sweep = now + SWEEP_EVERY_S

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def _serve_one(self, sock: zmq.Socket, parts: list[bytes]) -> None:
        ident, frames = parts[0], parts[1:]
        try:
            reply = self.handle(frames)
        except Exception:  # a bug must not stop the server; handle() already catches most
            self.counters["internal"] += 1
            log.exception("unexpected error handling a request")
            return
        if reply is None:
            return
        try:
            sock.send_multipart([ident, *reply], zmq.NOBLOCK)
            self.counters["replies"] += 1
        except zmq.ZMQError:  # peer gone or not reading: drop
            self.counters["replies_dropped"] += 1

    def _sweep(self, now: float) -> None:
        res = self.registry.sweep(now)
        for eid, r in res.went_stale:
            log.warning("rank %s/%d is stale (no heartbeat for %.1fs)", eid, r,
                        self.registry.lease_s)
        for eid, r in res.forgotten:
            log.info("forgot rank %s/%d (silent for %.1fs)", eid, r, self.registry.forget_s)

    # ---- one request, no socket ---------------------------------------------------------

    def handle(self, frames: list[bytes]) -> list[bytes] | None:
        """Decode one request's frames, apply it, and return the reply frames (None: drop)."""
        self.counters["requests"] += 1
        try:
            msg = self._codec.decode(frames)
        except WireError as exc:
            return self._wire_error(frames, exc)
        try:
            reply = self._apply(msg)
        except Refused as exc:
            self.counters[f"refused_{exc.kind}"] += 1
            self._ratelog("refused", logging.INFO, "refused %s: %s", type(msg).__name__, exc)
            reply = m.Error(rid=msg.rid, kind=exc.kind, text=exc.text)
        except Exception as exc:
            self.counters["internal"] += 1
            self._ratelog("internal", logging.ERROR, "error applying %s: %r",
                          type(msg).__name__, exc)
            reply = m.Error(rid=msg.rid, kind="internal", text=type(exc).__name__)
        return self._sign(reply)

    def _sign(self, reply: m.Reply, signed: bool = True) -> list[bytes]:
        payload = self._encoder.encode(reply)
        return [payload, sign(self.token if signed else None, payload)]

    def _authentic(self, frames: list[bytes]) -> bool:
        """Did the sender prove it holds the token? (Always True when auth is off.)"""
        if self.token is None:
            return True
        if len(frames) != 2:
            return False
        payload, mac = bytes(frames[0]), bytes(frames[1])
        return len(mac) == MAC_BYTES and hmac.compare_digest(mac, sign(self.token, payload))

    def _wire_error(self, frames: list[bytes], exc: WireError) -> list[bytes] | None:
        payload = bytes(frames[0]) if frames else b""
        rid = m.peek_rid(payload) if len(payload) <= self.max_request else 0
        if not self._authentic(frames):
            self.counters["refused_auth"] += 1
            self._ratelog("auth", logging.WARNING,
                          "refused a request without a valid token (%s, %d parts, %d bytes)",
                          exc.kind, len(frames), len(payload))
            return self._sign(m.Error(rid=rid, kind="auth", text="missing or wrong token"),
                              signed=False)
        self.counters[f"bad_{exc.kind}"] += 1
        self._ratelog("wire", logging.WARNING, "bad request frame: %s", exc)
        return self._sign(m.Error(rid=rid, kind=exc.kind, text=str(exc)[:200]))

    def _apply(self, msg: m.Request) -> m.Reply:
        now = self._clock()
        reg = self.registry
        self.counters[type(msg).__name__] += 1
        if isinstance(msg, m.Heartbeat):
            state = reg.heartbeat(msg.engine_id, msg.tp_rank, msg.incarnation, now)
            return m.HeartbeatReply(rid=msg.rid, state=state)
        if isinstance(msg, m.Lookup):
            res = reg.lookup(msg.engine_id, now)
            return m.LookupReply(rid=msg.rid, engine_id=res.engine_id, known=res.known,
                                 role=res.role, tp_size=res.tp_size, records=list(res.records),
                                 missing=list(res.missing), stale=list(res.stale))
        if isinstance(msg, m.Register):
            e = msg.rank
            rec, fresh = reg.register(e, now, epoch_hint=msg.epoch_hint, wall=self._wall())
            if fresh:
                log.info("registered %s %s rank %d/%d epoch %d at %s (%s)", e.engine_id, e.role,
                         e.tp_rank, e.tp_size, rec.epoch, e.ctrl_endpoint, e.backend)
            return m.RegisterReply(rid=msg.rid, record=rec, fresh=fresh)
        if isinstance(msg, m.Deregister):
            removed = reg.deregister(msg.engine_id, msg.tp_rank, msg.incarnation)
            if removed:
                log.info("deregistered %s rank %d", msg.engine_id, msg.tp_rank)
            return m.DeregisterReply(rid=msg.rid, removed=removed)
        if isinstance(msg, m.Status):
            lim = reg.limits
            return m.StatusReply(
                rid=msg.rid, started_at=self.started_at, lease_s=reg.lease_s,
                auth=self.token is not None,
                limits={"max_engines": lim.max_engines,
                        "max_ranks_per_engine": lim.max_ranks_per_engine,
                        "max_ranks": lim.max_ranks, "max_request_bytes": self.max_request},
                counters=dict(self.counters), rows=reg.rows(now))
        raise Refused("bad_request", f"unexpected request {type(msg).__name__}")
