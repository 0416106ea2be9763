"""The client kvstage ranks use to register with the bootstrap server and find their peers.

Transport: a DEALER socket (a REQ socket wedges when the server dies mid-request). Every
request carries a request id and has a deadline; replies with another id are stale and are
discarded. When a request times out the socket is closed (linger 0) and a fresh one connects,
so nothing queued for a dead server is delivered to its successor.

Threads: the client is safe to call from several threads. Each `_Channel` (one socket) is
guarded by a lock held for one request; `lookup` releases it between polls. The keepalive
thread has its own channel, so a long call on the main channel never delays heartbeats.

Auth: a client with a token only accepts replies signed with it; the one exception is the
server's unsigned ``Error(kind="auth")`` refusal, which can only make a request fail (never
succeed) and becomes `BootstrapAuthError`. A client without a token ignores MACs.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
import zmq

from ..wire import WireError
from . import messages as m
from .address import split_host_port

log = logging.getLogger("kvstage.bootstrap.client")

ROLES = ("prefill", "decode")
_POLL_SLICE_S = 0.05
_MAX_EPOCH_HINTS = 4096
R = TypeVar("R", bound=m.Reply)


class BootstrapError(RuntimeError):
    """Base of bootstrap failures. ``kind``: the server's Error kind when it refused
    (full, conflict, bad_request, malformed, ...), else "timeout", "auth" or "closed"."""

    def __init__(self, text: str, kind: str = "error"):
        super().__init__(text)
        self.kind = kind

    @property
    def permanent(self) -> bool:
        """True when retrying cannot help: the server refused for good, or the client is closed."""
        return self.kind in m.PERMANENT_KINDS or self.kind == "closed"


class BootstrapTimeout(BootstrapError, TimeoutError):
    """A deadline passed: the server did not answer, or a lookup stayed incomplete."""

    def __init__(self, text: str):
        super().__init__(text, "timeout")


class BootstrapAuthError(BootstrapError, PermissionError):
    """The server refused our token, or answered without the token we expect."""

    def __init__(self, text: str):
        super().__init__(text, "auth")


def new_incarnation() -> int:
    """A random 63-bit id; pick one per process life and keep it."""
    return secrets.randbits(63)


@dataclass(frozen=True)
class RankInfo:
    """What a rank tells the server about itself (see docs/bootstrap.md)."""

    engine_id: str
    role: str                   # "prefill" | "decode"
    tp_size: int
    tp_rank: int
    ctrl_endpoint: str          # e.g. "tcp://10.0.0.2:5555"
    backend: str                # "nixl" | "mooncake"
    backend_identity: str
    layout: dict[str, str | int | float | bool]
    pools: dict[str, int]       # named memory pools -> bytes
    incarnation: int            # random 63-bit id, once per process life
    dp_rank: int = field(default=0, kw_only=True)  # data-parallel rank of its engine in the serving instance

    def __post_init__(self):
        if not isinstance(self.engine_id, str) or not self.engine_id:
            raise ValueError("RankInfo.engine_id must be a non-empty str")
        if self.role not in ROLES:
            raise ValueError(f"RankInfo.role must be one of {ROLES}, got {self.role!r}")
        for name in ("tp_size", "tp_rank", "incarnation"):
            if not isinstance(getattr(self, name), int) or isinstance(getattr(self, name), bool):
                raise TypeError(f"RankInfo.{name} must be an int")
        if not 1 <= self.tp_size <= m.MAX_TP:
            raise ValueError(f"RankInfo.tp_size must be in 1..{m.MAX_TP}, got {self.tp_size}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"RankInfo.tp_rank must be in 0..{self.tp_size - 1}, "
                             f"got {self.tp_rank}")
        if not 0 <= self.incarnation <= m.MAX_ID:
            raise ValueError("RankInfo.incarnation must be a 63-bit non-negative int")
        if isinstance(self.dp_rank, bool) or not isinstance(self.dp_rank, int) or not 0 <= self.dp_rank <= m.MAX_TP:
            raise ValueError(f"RankInfo.dp_rank must be an int in 0..{m.MAX_TP}, got {self.dp_rank!r}")
        if not isinstance(self.layout, dict) or not isinstance(self.pools, dict):
            raise TypeError("RankInfo.layout and RankInfo.pools must be dicts")

    def _entry(self) -> m.RankEntry:
        try:
            return msgspec.convert({f.name: getattr(self, f.name)
                                    for f in dataclasses.fields(RankInfo)}, m.RankEntry)
        except msgspec.ValidationError as exc:
            raise ValueError(f"RankInfo does not fit the bootstrap protocol: {exc}") from None


@dataclass(frozen=True)
class RankRecord(RankInfo):
    """A registered rank: its RankInfo plus the server-assigned epoch and registration time
    (server wall clock, seconds since the Unix epoch)."""

    epoch: int
    registered_at: float

    @property
    def info(self) -> RankInfo:
        return RankInfo(**{f.name: getattr(self, f.name) for f in dataclasses.fields(RankInfo)})

    @classmethod
    def _from_wire(cls, rec: m.RecordEntry) -> RankRecord:
        return cls(**msgspec.structs.asdict(rec))


def parse_addr(addr: str, name: str = "bootstrap") -> str:
    """"host:port", "[v6]:port" or "tcp://host:port" -> a zmq endpoint; ValueError naming
    `name` and what is wrong (bootstrap/address.py)."""
    host, port = split_host_port(name, addr)
    return f"tcp://{host}:{port}"


def poll_lookup(engine_id: str, timeout_s: float, ask, stop: threading.Event, who: str) -> list:
    """A lookup: ``ask(seconds left)`` until it returns records (``(records, "")``) rather than
    what is still missing (``(None, why)``), polling every 20 ms growing to 250 ms, waiting on
    `stop` (a closed client). BootstrapTimeout from `ask` (``who`` did not answer) is retried;
    at the deadline BootstrapTimeout says what the last answer said, or that none came."""
    deadline = time.monotonic() + timeout_s
    delay = 0.02
    state = unanswered = None  # what the last answer said; the last unanswered poll
    while True:
        if stop.is_set():
            raise BootstrapError("the rendezvous client is closed", "closed")
        try:
            records, why = ask(deadline - time.monotonic())
        except BootstrapTimeout as exc:
            unanswered = str(exc)
        else:
            if records is not None:
                return records
            state, unanswered = why, None
        left = deadline - time.monotonic()
        if left <= 0:
            why = state or unanswered
            if state and unanswered:
                why += f" (and {who} did not answer the last poll in time)"
            raise BootstrapTimeout(f"lookup of engine {engine_id!r} timed out after {timeout_s:.1f}s: {why}")
        stop.wait(min(delay, left))
        delay = min(delay * 1.5, 0.25)


def keep_round(infos: list, keep_one, failing: set, stop: threading.Event, logger: logging.Logger) -> bool:
    """One keepalive round: ``keep_one(info, (engine_id, tp_rank))`` for each rank; a failure is
    logged once, and its recovery. False once `stop` is set (the client is closing)."""
    for info in infos:
        if stop.is_set():
            return False
        key = (info.engine_id, info.tp_rank)
        try:
            keep_one(info, key)
        except BootstrapError as exc:
            if stop.is_set():
                return False
            if key not in failing:
                logger.warning("keepalive of %s rank %d failed: %s", info.engine_id, info.tp_rank, exc)
                failing.add(key)
            continue
        if key in failing:
            logger.info("keepalive of %s rank %d works again", *key)
            failing.discard(key)
    return True


class _Channel:
    """One DEALER socket, one request at a time (lock), reconnect after a timeout."""

    def __init__(self, ctx: zmq.Context, endpoint: str, token: bytes | None):
        self._ctx, self._endpoint, self._token = ctx, endpoint, token
        self._codec = m.reply_codec(token)
        self._plain = m.reply_codec(None)  # reads the server's unsigned auth refusal
        self._lock = threading.Lock()
        self._rids = itertools.count(1)
        self._sock: zmq.Socket | None = None

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.MAXMSGSIZE, m.MAX_REPLY + 1024)
            s.setsockopt(zmq.RECONNECT_IVL, 50)
            s.setsockopt(zmq.RECONNECT_IVL_MAX, 500)
            if "[" in self._endpoint:
                s.setsockopt(zmq.IPV6, 1)
            s.connect(self._endpoint)
            self._sock = s
        return self._sock

    def reset(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None

    def close(self) -> None:
        with self._lock:
            self.reset()

    def request(self, msg: m.Request, expect: type[m.Reply], timeout_s: float,
                cancel: threading.Event | None = None) -> m.Reply:
        """Send ``msg`` with a fresh request id and wait for its reply until the deadline.
        Raises BootstrapTimeout (socket reset), BootstrapAuthError or BootstrapError."""
        op = type(msg).__name__
        deadline = time.monotonic() + timeout_s
        with self._lock:
            rid = next(self._rids)
            frames = self._codec.encode(msgspec.structs.replace(msg, rid=rid))
            sock = self._socket()
            try:
                self._send(sock, frames, deadline, cancel)
                while True:
                    left = deadline - time.monotonic()
                    if cancel is not None and cancel.is_set():
                        raise BootstrapError(f"the client was closed during {op}", "closed")
                    if left <= 0:
                        raise BootstrapTimeout(f"bootstrap server {self._endpoint} did not "
                                               f"answer {op} within {timeout_s:.1f}s")
                    if not sock.poll(int(min(left, _POLL_SLICE_S) * 1000) + 1, zmq.POLLIN):
                        continue
                    try:
                        frames_in = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        continue
                    reply = self._read(frames_in, rid, op, expect)
                    if reply is not None:
                        return reply
            except BootstrapError as exc:
                if exc.kind in ("timeout", "closed"):
                    self.reset()  # a late reply must not reach the next request
                raise

    def _send(self, sock, frames, deadline, cancel) -> None:
        while True:
            try:
                sock.send_multipart(frames, zmq.NOBLOCK)
                return
            except zmq.Again:
                if cancel is not None and cancel.is_set():
                    raise BootstrapError("the client was closed", "closed") from None
                if time.monotonic() >= deadline:
                    raise BootstrapTimeout(f"cannot queue a request to {self._endpoint}") from None
                time.sleep(0.01)

    def _read(self, frames: list[bytes], rid: int, op: str,
              expect: type[m.Reply]) -> m.Reply | None:
        """The reply to request ``rid``, None for a stale or unreadable frame; raises for a
        refusal."""
        try:
            reply = self._codec.decode(frames)
        except WireError as exc:
            if exc.kind != "auth":
                log.debug("discarding a bad reply frame: %s", exc)
                return None
            try:  # not signed with our token: only the server's auth refusal is accepted
                plain = self._plain.decode(frames)
            except WireError:
                return None
            if plain.rid != rid:
                return None
            if isinstance(plain, m.Error) and plain.kind == "auth":
                raise BootstrapAuthError(f"bootstrap server {self._endpoint} refused {op}: "
                                         "our auth token is wrong") from None
            raise BootstrapAuthError(
                f"bootstrap server {self._endpoint} answered {op} without our auth token: it "
                "runs without a token or with another one") from None
        if reply.rid != rid:
            return None  # stale: an answer to a request we gave up on
        if isinstance(reply, m.Error):
            if reply.kind == "auth":
                raise BootstrapAuthError(f"bootstrap server {self._endpoint} refused {op}: "
                                         f"{reply.text or 'auth token required'} (set "
                                         "KVSTAGE_AUTH_TOKEN or pass a token)")
            raise BootstrapError(f"bootstrap server refused {op}: {reply.kind}: {reply.text}",
                                 reply.kind)
        if not isinstance(reply, expect):
            raise BootstrapError(f"bootstrap server answered {op} with {type(reply).__name__}",
                                 "malformed")
        return reply


class BootstrapClient:
    """Register, look up, heartbeat and deregister ranks at a bootstrap server.

    ``token`` is the shared secret as bytes (None: no auth; this class does not read the
    environment, use `kvstage.wire.load_token()` for that). ``request_timeout_s`` bounds every
    single request; `lookup` has its own overall deadline.
    """

    def __init__(self, addr: str, token: bytes | None = None, request_timeout_s: float = 2.0):
        if isinstance(token, str):
            token = token.encode()
        if token is not None and not token:
            raise ValueError("token must be non-empty or None")
        if request_timeout_s <= 0:
            raise ValueError("request_timeout_s must be > 0")
        self.addr = addr
        self.endpoint = parse_addr(addr)
        self.request_timeout_s = request_timeout_s
        self._token = token
        self._ctx = zmq.Context.instance()
        self._main = _Channel(self._ctx, self.endpoint, token)
        self._lock = threading.Lock()
        self._closed = False
        self._epochs: dict[tuple[str, int, int], int] = {}  # (engine, rank, incarnation) -> epoch
        self._keep: dict[tuple[str, int], RankInfo] = {}
        self._superseded: set[tuple[str, int]] = set()  # keepalive stops fighting for these
        self._keep_interval = 1.0
        self._keep_thread: threading.Thread | None = None
        self._stop = threading.Event()

    # ---- API ----------------------------------------------------------------------------

    def register(self, info: RankInfo) -> RankRecord:
        """Register (or idempotently re-register) a rank; returns its record with the epoch."""
        rec = self._register(self._main, info)
        with self._lock:
            self._superseded.discard((info.engine_id, info.tp_rank))
        return rec

    def lookup(self, engine_id: str, timeout_s: float = 30.0) -> list[RankRecord]:
        """All ranks of an engine, sorted by tp_rank, once every one of them is registered and
        live. Polls until ``timeout_s``; then raises BootstrapTimeout saying what is missing."""
        if not isinstance(engine_id, str) or not engine_id:
            raise ValueError("engine_id must be a non-empty str")

        def ask(left: float) -> tuple[list[RankRecord] | None, str]:
            rep = self._request(self._main, m.Lookup(engine_id=engine_id), m.LookupReply,
                                min(self.request_timeout_s, max(left, 0.05)))
            if rep.known and not rep.missing:
                return [RankRecord._from_wire(r) for r in rep.records], ""
            return None, self._incomplete(rep)
        return poll_lookup(engine_id, timeout_s, ask, self._stop, "the server")

    def deregister(self, engine_id: str, tp_rank: int, incarnation: int) -> None:
        """Remove a rank (no-op when the server does not hold this incarnation)."""
        with self._lock:
            self._keep.pop((engine_id, tp_rank), None)
        self._request(self._main, m.Deregister(engine_id=engine_id, tp_rank=tp_rank,
                                               incarnation=incarnation), m.DeregisterReply)

    def heartbeat(self, engine_id: str, tp_rank: int, incarnation: int) -> bool:
        """Refresh a rank's lease. False: the server does not hold it live (restarted, lease ran
        out, or another incarnation replaced it); register again, unless replaced."""
        return self._heartbeat(self._main, engine_id, tp_rank, incarnation) == "ok"

    def start_keepalive(self, info: RankInfo, interval_s: float = 1.0) -> None:
        """Heartbeat ``info`` every ``interval_s`` from a background thread; re-register when the
        server forgot it (restart, lease ran out). Several ranks may share one client."""
        if interval_s <= 0:
            raise ValueError("interval_s must be > 0")
        with self._lock:
            if self._closed:
                raise BootstrapError("the bootstrap client is closed", "closed")
            self._keep[(info.engine_id, info.tp_rank)] = info
            self._superseded.discard((info.engine_id, info.tp_rank))
            self._keep_interval = interval_s
            if self._keep_thread is None:
                self._keep_thread = threading.Thread(target=self._keepalive, daemon=True,
                                                     name="kvstage-bootstrap-keepalive")
                self._keep_thread.start()

    def on_gone(self, callback) -> None:
        """Nothing to subscribe to: the bootstrap server has no watch; a decode rank learns of a
        dead prefill rank from its own lease on the connection (bootstrap/rendezvous.py)."""

    def status(self) -> dict[str, Any]:
        """What the server knows: {"started_at", "lease_s", "auth", "limits", "counters",
        "ranks": [row dicts: engine_id, role, tp_size, tp_rank, epoch, incarnation,
        ctrl_endpoint, backend, age_s, stale, dp_rank]}."""
        rep = self._request(self._main, m.Status(), m.StatusReply)
        return {"started_at": rep.started_at, "lease_s": rep.lease_s, "auth": rep.auth,
                "limits": dict(rep.limits), "counters": dict(rep.counters),
                "ranks": [msgspec.structs.asdict(r) for r in rep.rows]}

    def close(self) -> None:
        """Stop the keepalive thread and close the sockets. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._keep_thread
            self._stop.set()
        if thread is not None:
            thread.join(timeout=self.request_timeout_s + 2.0)
        self._main.close()

    def __enter__(self) -> BootstrapClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- internals ----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._stop.is_set():  # set by close(); an Event, so no lock needed
            raise BootstrapError("the bootstrap client is closed", "closed")

    def _request(self, chan: _Channel, msg: m.Request, expect: type[R],
                 timeout_s: float | None = None) -> R:
        self._check_open()
        return chan.request(msg, expect,  # type: ignore[return-value]
                            self.request_timeout_s if timeout_s is None else timeout_s, self._stop)

    def _register(self, chan: _Channel, info: RankInfo) -> RankRecord:
        entry = info._entry()
        key = (info.engine_id, info.tp_rank, info.incarnation)
        with self._lock:
            hint = self._epochs.get(key, 0)
        rep = self._request(chan, m.Register(rank=entry, epoch_hint=hint), m.RegisterReply)
        rec = RankRecord._from_wire(rep.record)
        with self._lock:
            self._epochs.pop(key, None)
            self._epochs[key] = rec.epoch
            while len(self._epochs) > _MAX_EPOCH_HINTS:
                del self._epochs[next(iter(self._epochs))]
        return rec

    def _heartbeat(self, chan: _Channel, engine_id: str, tp_rank: int, incarnation: int) -> str:
        rep = self._request(chan, m.Heartbeat(engine_id=engine_id, tp_rank=tp_rank,
                                              incarnation=incarnation), m.HeartbeatReply)
        return rep.state

    @staticmethod
    def _incomplete(rep: m.LookupReply) -> str:
        if not rep.known:
            return f"engine {rep.engine_id!r} is unknown to the server (no rank registered)"
        have = [r.tp_rank for r in rep.records]
        text = (f"{rep.role} engine {rep.engine_id!r} tp_size={rep.tp_size} has ranks {have}, "
                f"missing ranks {rep.missing}")
        if rep.stale:
            text += f" (stale, no heartbeat: {rep.stale})"
        return text

    def _keepalive(self) -> None:
        chan = _Channel(self._ctx, self.endpoint, self._token)
        failing: set[tuple[str, int]] = set()      # log a failure once, and its recovery
        try:
            while True:
                with self._lock:
                    interval = self._keep_interval
                if self._stop.wait(interval):
                    return
                with self._lock:
                    infos = list(self._keep.values())
                if not keep_round(infos, lambda info, key: self._keep_one(chan, info, key), failing,
                                  self._stop, log):
                    return
        finally:
            chan.close()

    def _keep_one(self, chan: _Channel, info: RankInfo, key: tuple[str, int]) -> None:
        with self._lock:
            if key in self._superseded:
                return
        state = self._heartbeat(chan, info.engine_id, info.tp_rank, info.incarnation)
        if state == "superseded":
            log.error("%s rank %d: another incarnation holds this rank now; keepalive stops "
                      "re-registering it (register() again to take it back)", *key)
            with self._lock:
                self._superseded.add(key)
            return
        if state in ("unknown", "stale"):
            with self._lock:
                if self._keep.get(key) is not info:  # deregistered or replaced meanwhile
                    return
            rec = self._register(chan, info)
            log.info("re-registered %s rank %d (server said %s), epoch %d", *key, state,
                     rec.epoch)
