"""Mooncake TransferEngine backend (P2PHANDSHAKE; tcp by default, rdma where the hardware has it).

Behaviour (measured facts in docs/backends.md):

- The only Python call that carries a notify with a write is the *synchronous*
  ``batch_transfer_sync(..., TransferNotify(name, msg))``; it blocks (and spins a core) until the
  write completes, fails or times out. So ``post_write`` hands the call to a small per-peer
  submit thread (one by default) and returns at once; ``poll_write`` reads the result. The
  Mooncake C++ engine is used concurrently by these threads and by the owning thread (its
  Python binding releases the GIL and guards its segment cache with a mutex; concurrent use is
  exercised by the integration tests). Everything else is called by the single owning thread.
- Identity: a small JSON document ``{"kvstage": "mooncake/1", "name": "host:port", "regions":
  [[addr, length], ...], "instance": "<random hex>"}``. The name is
  ``f"{host}:{engine.get_rpc_port()}"``, the address Mooncake dials; ``regions`` lets the writer
  reject ranges outside the peer's registered memory with a BackendError before posting (Mooncake
  itself rejects them too, as a failed write); ``instance`` is drawn once per engine. A bare
  ``b"host:port"`` identity also works (no local range check, no instance check then).
- Mooncake keeps the segment descriptor of every segment name it wrote to for the life of the
  engine (its Python binding has no call that refreshes or drops it). A peer restarted on the
  same ``host:port`` is another engine with another data port and other memory, which the cached
  descriptor does not describe: every write to it under that name would fail. So each segment
  name written to remembers the engine instance it was written as, and a peer that is another
  instance at such a name is written to under another spelling of the same IPv4 address (octets
  in octal with more leading zeros: ``0177.00.00.01`` for ``127.0.0.1``), which Mooncake resolves
  to the same address and looks up afresh. A host that is not an IPv4 address has no such
  spellings: ``connect`` refuses that peer with a BackendError saying why (docs/operations.md,
  "A peer restarted on the same address").
- Tags are arbitrary bytes: sent as ``msg = "kvstage1:" + base64(tag)`` with ``name`` = this
  endpoint's name; ``drain_tags`` ignores notifies without that prefix (counted in
  ``ignored_notifies``).
- Environment, set before the engine exists and only when not already set:
  ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`` / ``MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER`` = 65535
  (batches over 1024 entries otherwise fail), ``MC_LOG_LEVEL`` = WARNING (glog INFO lines off;
  warnings and errors stay on stderr).
"""

from __future__ import annotations

import base64
import binascii
import importlib.metadata
import json
import logging
import os
import queue
import secrets
import threading
from collections.abc import Callable, Sequence
from typing import cast

import numpy as np

from .base import (
    MEMORY_KINDS,
    ArrivedTag,
    Backend,
    BackendError,
    MemRegion,
    RangeIndex,
    Registration,
    WriteHandle,
    WriteState,
    check_regions,
    check_write_request,
    close_at_exit,
)

ENV_DEFAULTS = {
    "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "65535",
    "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "65535",
    "MC_LOG_LEVEL": "WARNING",
}
for _k, _v in ENV_DEFAULTS.items():
    os.environ.setdefault(_k, _v)

from mooncake.engine import TransferEngine, TransferNotify, TransferOpcode  # noqa: E402

log = logging.getLogger(__name__)

TAG_PREFIX = "kvstage1:"
IDENTITY_FORMAT = "mooncake/1"


# (segment name, source addresses, destination addresses, lengths, TransferOpcode, TransferNotify)
_WriteArgs = tuple[str, list[int], list[int], list[int], object, object]


def _job_of(handle: WriteHandle) -> _Job | None:
    """The submit-thread job behind one of this backend's writes (None once released)."""
    return cast("_Job | None", handle.handle)   # this backend's WriteHandles carry its _Job


class _Job:
    """One write handed to a submit thread. `done` is set once `result`/`error` are final."""

    __slots__ = ("args", "done", "result", "error", "cancelled", "lock", "started", "on_complete")

    def __init__(self, args: _WriteArgs, on_complete: Callable[[], None] | None = None) -> None:
        self.args = args
        self.on_complete = on_complete   # called on the submit thread once done is set
        self.done = threading.Event()
        self.lock = threading.Lock()
        self.started = False
        self.cancelled = False
        self.result: int | None = None
        self.error: str | None = None

    def cancel(self) -> bool:
        """Cancel if not yet started; True when the write will never run."""
        with self.lock:
            if self.started:
                return False
            self.cancelled = True
        self.done.set()
        return True


MAX_BATCH_ENTRIES = 32768  # below the per-peer queue limits: a larger write runs as several batches


def _signal(job: _Job) -> None:
    """Tell the write's owner it is final; a failing callback (say, the owner's loop has
    stopped) loses nothing: the owner still finds the write done when it next polls."""
    if job.on_complete is not None:
        try:
            job.on_complete()
        except Exception:  # noqa: BLE001
            log.debug("a write's completion callback raised", exc_info=True)


class _Submitter:
    """A per-peer queue and its thread(s), each calling the blocking batch_transfer_sync.

    A write of more ranges than MAX_BATCH_ENTRIES runs as consecutive batches on the same thread;
    only the last one carries the notify, so the tag still arrives after every byte."""

    def __init__(self, engine: TransferEngine, peer: str, threads: int):
        self._engine = engine
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._stopping = False
        self._threads = [
            threading.Thread(target=self._run, name=f"kvstage-mooncake-{peer}-{i}", daemon=True)
            for i in range(threads)
        ]
        for t in self._threads:
            t.start()

    def submit(self, job: _Job) -> None:
        self._queue.put(job)

    def _run(self) -> None:
        engine = self._engine
        while True:
            job = self._queue.get()
            if job is None:
                return
            with job.lock:
                if job.cancelled:
                    continue
                job.started = True
            try:
                peer, src, dst, lens, op, notify = job.args
                n, result = len(src), 0
                for lo in range(0, n, MAX_BATCH_ENTRIES):
                    hi = min(n, lo + MAX_BATCH_ENTRIES)
                    result = int(engine.batch_transfer_sync(peer, src[lo:hi], dst[lo:hi], lens[lo:hi], op,
                                                            notify if hi == n else None))
                    if result != 0:
                        break
                job.result = result
            except BaseException as exc:  # noqa: BLE001 - reported through poll_write
                job.error = f"{type(exc).__name__}: {exc}"
            finally:
                job.done.set()
                _signal(job)

    def stop(self, timeout: float | None) -> bool:
        """Stop the threads after the job they are in; True when all have exited."""
        if not self._stopping:
            self._stopping = True
            for _ in self._threads:
                self._queue.put(None)
        for t in self._threads:
            t.join(timeout)
        return not any(t.is_alive() for t in self._threads)


def _parse_identity(identity: bytes) -> tuple[str, RangeIndex | None, str | None]:
    """(name, its registered ranges or None, its engine's instance or None)."""
    raw = bytes(identity)
    instance: str | None = None
    if raw.startswith(b"{"):
        try:
            doc = json.loads(raw.decode("utf-8"))
            if doc.get("kvstage") != IDENTITY_FORMAT:
                raise ValueError(f"unknown identity format {doc.get('kvstage')!r}")
            name = str(doc["name"])
            regions = [(int(a), int(n)) for a, n in doc.get("regions", [])]
            instance = str(doc["instance"]) if doc.get("instance") is not None else None
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
            raise BackendError(f"malformed Mooncake identity: {exc}") from exc
        index: RangeIndex | None = RangeIndex(regions)
    else:
        try:
            name = raw.decode("ascii")
        except UnicodeDecodeError as exc:
            raise BackendError("malformed Mooncake identity: not JSON and not 'host:port'") from exc
        index = None
    host, _, port = name.rpartition(":")
    if not host or not port.isdigit():
        raise BackendError(f"malformed Mooncake identity: peer name {name!r} is not 'host:port'")
    return name, index, instance


def respell(name: str, generation: int) -> str | None:
    """`name` ("host:port") for generation 0; for generation g >= 1 the same IPv4 address with
    every octet in octal behind g more leading zeros ("0177.00.00.01:port" for "127.0.0.1:port"
    at 1), a different string Mooncake resolves to the same address; None when the host is not
    a dotted IPv4 address (it has no such spellings)."""
    if generation == 0:
        return name
    host, _, port = name.rpartition(":")
    octets = host.split(".")
    if len(octets) != 4 or not all(o.isdigit() and int(o) < 256 for o in octets):
        return None
    return ".".join("0" * generation + format(int(o), "o") for o in octets) + ":" + port


BIND_ATTEMPTS = 5   # engines started while other processes take ports: a lost race is tried again


def start_engine(make: Callable[[], TransferEngine], host: str, protocol: str, device_name: str,
                 attempts: int = BIND_ATTEMPTS) -> TransferEngine:
    """A Mooncake TransferEngine initialized on `host` with the P2P handshake. Mooncake picks its
    RPC port itself; when another process took that port between Mooncake's pick and its bind
    ("bind: Address already in use"), a new engine is started, up to `attempts` in all. Any other
    failure, or the last lost race, raises BackendError with Mooncake's words."""
    for attempt in range(1, attempts + 1):
        engine = make()
        try:
            ret = engine.initialize(host, "P2PHANDSHAKE", protocol, device_name)
        except RuntimeError as exc:
            if "Address already in use" not in str(exc) or attempt == attempts:
                raise BackendError(f"Mooncake TransferEngine.initialize({host!r}, P2PHANDSHAKE, {protocol!r}) "
                                   f"failed (attempt {attempt} of {attempts}): {exc}") from exc
            log.warning("Mooncake's RPC port was taken before it bound it (%s); starting another engine "
                        "(attempt %d of %d)", exc, attempt + 1, attempts)
            continue
        if ret != 0:
            raise BackendError(f"Mooncake TransferEngine.initialize({host!r}, P2PHANDSHAKE, {protocol!r}) returned {ret}")
        return engine
    raise AssertionError("unreachable: the last attempt returns or raises")


def _build_memory_kinds() -> tuple[str, ...]:
    """DRAM only for the non-CUDA build (what CPU machines install): it can neither register
    device memory nor write into a peer's; both kinds for a CUDA build."""
    try:
        importlib.metadata.distribution("mooncake-transfer-engine-non-cuda")
    except importlib.metadata.PackageNotFoundError:
        return ("DRAM", "VRAM")
    return ("DRAM",)


class MooncakeBackend(Backend):
    """A Backend on one Mooncake TransferEngine (P2P handshake, no metadata server).

    Options: ``protocol`` ("tcp" default, or "rdma"), ``device_name`` (RDMA device filter, ""
    for all), ``submit_threads_per_peer`` (1: writes to one peer run one after another),
    ``stall_timeout_s`` (None keeps Mooncake's 30 s; otherwise sets MC_TCP_PROGRESS_TIMEOUT_SEC:
    how long a write that makes no progress, say to a frozen peer, holds its submit thread),
    ``transfer_timeout_s`` (the longest a whole write may take, however slowly it progresses;
    sets MC_TRANSFER_TIMEOUT, floored at 5 s by Mooncake; None: the larger of stall_timeout_s and
    Mooncake's default). Both are set for this process before the engine is created.
    """

    kind = "mooncake"
    signals_completion = True   # a write ends on its submit thread, which calls on_complete
    memory_kinds = _build_memory_kinds()

    def __init__(
        self,
        name: str,
        host: str = "127.0.0.1",
        *,
        protocol: str = "tcp",
        device_name: str = "",
        submit_threads_per_peer: int = 1,
        stall_timeout_s: float | None = None,
        transfer_timeout_s: float | None = None,
    ):
        if not name or not isinstance(name, str):
            raise ValueError("name must be a non-empty str")
        if submit_threads_per_peer < 1:
            raise ValueError("submit_threads_per_peer must be >= 1")
        for k, v in ENV_DEFAULTS.items():
            os.environ.setdefault(k, v)
        for label, value in (("stall_timeout_s", stall_timeout_s), ("transfer_timeout_s", transfer_timeout_s)):
            if value is not None and value <= 0:
                raise ValueError(f"{label} must be > 0")
        if stall_timeout_s is not None:
            os.environ["MC_TCP_PROGRESS_TIMEOUT_SEC"] = str(max(1, int(round(stall_timeout_s))))
        total = transfer_timeout_s if transfer_timeout_s is not None else (
            max(stall_timeout_s, 30.0) if stall_timeout_s is not None else None)
        if total is not None:
            os.environ["MC_TRANSFER_TIMEOUT"] = str(max(5, int(round(total))))
        self.label = name
        self.host = host
        self.protocol = protocol
        self._threads_per_peer = submit_threads_per_peer
        self._engine = start_engine(TransferEngine, host, protocol, device_name)
        self._name = f"{host}:{self._engine.get_rpc_port()}"
        self._instance = secrets.token_hex(8)   # tells this engine from a later one on the same address
        self._regs: dict[int, Registration] = {}
        self._index = RangeIndex()
        self._peers: dict[str, RangeIndex | None] = {}
        self._peer_instance: dict[str, str | None] = {}   # connected peers' engine instances
        self._route: dict[str, str] = {}              # connected peer -> the segment name its writes use
        self._cached: dict[str, str | None] = {}      # segment names written to -> the instance then
        self._submitters: dict[str, _Submitter] = {}
        self._retired: list[_Submitter] = []  # stopped by disconnect(); joined by close()
        self._inflight: dict[int, WriteHandle] = {}
        self.ignored_notifies = 0
        self._closed = False
        close_at_exit(self)

    # ------------------------------------------------------------------ identity and memory
    @property
    def name(self) -> str:
        return self._name

    def identity(self) -> bytes:
        self._check_open()
        regions = [[r.addr, r.length] for reg in self._regs.values() for r in reg.regions]
        doc = {"kvstage": IDENTITY_FORMAT, "name": self._name, "regions": regions, "instance": self._instance}
        return json.dumps(doc, separators=(",", ":")).encode("utf-8")

    def register(self, regions: Sequence[MemRegion]) -> Registration:
        self._check_open()
        regions = check_regions(regions)
        taken = {r.addr for reg in self._regs.values() for r in reg.regions}
        seen: set[int] = set()
        for r in regions:
            if r.addr in taken or r.addr in seen:
                # Mooncake keys registrations by start address: a second one would be undone by
                # the first deregistration.
                raise BackendError(f"address {r.addr:#x} is already registered with this Mooncake engine")
            seen.add(r.addr)
        addrs = [r.addr for r in regions]
        lengths = [r.length for r in regions]
        locations = {("*" if r.kind == "DRAM" else f"cuda:{r.device}") for r in regions}
        try:
            if len(locations) == 1:
                ret = self._engine.batch_register_memory(addrs, lengths, locations.pop())
            else:  # mixed kinds: one call per region, undone together on failure
                ret = 0
                for r in regions:
                    loc = "*" if r.kind == "DRAM" else f"cuda:{r.device}"
                    ret = self._engine.register_memory(r.addr, r.length, loc)
                    if ret != 0:
                        break
        except Exception as exc:
            self._undo(addrs)
            raise BackendError(f"Mooncake could not register {len(regions)} region(s): {exc}") from exc
        if ret != 0:
            self._undo(addrs)
            raise BackendError(f"Mooncake could not register {len(regions)} region(s): return code {ret}")
        reg = Registration(regions=regions, handle=addrs, active=True)
        self._regs[id(reg)] = reg
        self._rebuild_index()
        return reg

    def _undo(self, addrs: list[int]) -> None:
        try:
            self._engine.batch_unregister_memory(addrs)
        except Exception:
            pass

    def deregister(self, registration: Registration) -> None:
        if not registration.active:
            return
        registration.active = False
        self._regs.pop(id(registration), None)
        self._rebuild_index()
        if self._engine is None:
            return
        try:
            addrs = cast("list[int] | None", registration.handle)   # register() keeps the addresses there
            ret = self._engine.batch_unregister_memory(list(addrs or ()))
        except Exception as exc:
            raise BackendError(f"Mooncake deregistration failed: {exc}") from exc
        if ret != 0:
            raise BackendError(f"Mooncake deregistration failed: return code {ret}")

    def _rebuild_index(self) -> None:
        self._index = RangeIndex([(r.addr, r.length) for reg in self._regs.values() for r in reg.regions])

    # ------------------------------------------------------------------ peers
    def connect(self, peer_identity: bytes) -> str:
        """Know a peer; return its name. A peer that is another engine on an address this engine
        already wrote to (a rank restarted on the same host and RPC port) is written to under
        another spelling of the address; BackendError where the host has none (not IPv4)."""
        self._check_open()
        name, index, instance = _parse_identity(peer_identity)
        route = self._segment_name(name, instance)
        self._peers[name] = index
        self._peer_instance[name] = instance
        self._route[name] = route
        if name not in self._submitters:
            self._submitters[name] = _Submitter(self._engine, name, self._threads_per_peer)
        return name

    def _segment_name(self, name: str, instance: str | None) -> str:
        """The first spelling of `name` that Mooncake has not cached for another engine: one it
        never wrote to, or one it wrote to as this very `instance` (the peer came back)."""
        if instance is None:   # a bare identity: nothing to tell engines apart by
            return name
        for generation in range(len(self._cached) + 1):   # each spelling tried is in _cached but the last
            spelling = respell(name, generation)
            if spelling is None:
                raise BackendError(
                    f"the Mooncake peer at {name} is a new engine (a rank restarted on the same host and RPC "
                    f"port) where this engine wrote to an earlier one: Mooncake keeps the earlier engine's "
                    f"segment descriptor for that name for the life of this process (no call refreshes it), "
                    f"and a host that is not an IPv4 address has no other spelling to reach the new engine "
                    f"by; restart that rank so that it draws another RPC port (MC_MIN_RPC_PORT.."
                    f"MC_MAX_RPC_PORT), or restart this one")
            if self._cached.get(spelling, instance) == instance:
                return spelling
        raise AssertionError("unreachable: a spelling past every cached one is free")

    def disconnect(self, peer: str) -> None:
        """Forget a peer; idempotent.

        Its queued writes are cancelled (poll_write: FAILED, they never touch memory). A write
        already inside Mooncake cannot be stopped: it stays PENDING until Mooncake returns (for a
        frozen peer after its stall timeout) and poll_write then reports how it ended.
        """
        if peer not in self._peers:
            return
        for h in self._inflight.values():
            job = _job_of(h)
            if h.peer == peer and job is not None:
                job.cancel()
        del self._peers[peer]
        self._peer_instance.pop(peer, None)   # what Mooncake cached stays in _cached
        self._route.pop(peer, None)
        sub = self._submitters.pop(peer, None)
        if sub is not None:
            sub.stop(timeout=0)  # the threads exit after the call they are in
            self._retired.append(sub)

    # ------------------------------------------------------------------ writes
    def post_write(
        self, peer: str, src: np.ndarray, dst: np.ndarray, tag: bytes, *, dst_kind: str | None = None,
        on_complete: Callable[[], None] | None = None,
    ) -> WriteHandle:
        self._check_open()
        if peer not in self._peers:
            raise BackendError(f"unknown peer {peer!r}: connect() its identity first")
        src, dst, tag = check_write_request(src, dst, tag)
        # Mooncake writes name raw addresses, no memory kind: dst_kind is checked, then ignored
        if dst_kind is not None and dst_kind not in MEMORY_KINDS:
            raise ValueError(f"dst_kind must be one of {MEMORY_KINDS}, got {dst_kind!r}")
        outside = self._index.outside(src)
        if len(outside):
            i = int(outside[0])
            raise BackendError(
                f"source row {i} (addr {int(src[i, 0]):#x}, {int(src[i, 1])} bytes) is not inside registered"
                f" memory ({len(outside)} such rows)"
            )
        remote = self._peers[peer]
        if remote is not None:
            outside = remote.outside(dst)
            if len(outside):
                i = int(outside[0])
                raise BackendError(
                    f"write to {peer!r}: destination row {i} (addr {int(dst[i, 0]):#x}, {int(dst[i, 1])} bytes)"
                    f" is not inside memory the peer registered ({len(outside)} such rows)"
                )
        notify = TransferNotify(self._name, TAG_PREFIX + base64.b64encode(tag).decode("ascii"))
        job = _Job(
            (self._route[peer], src[:, 0].tolist(), dst[:, 0].tolist(), src[:, 1].tolist(), TransferOpcode.Write,
             notify),
            on_complete,
        )
        handle = WriteHandle(peer=peer, nbytes=int(src[:, 1].sum()), ndesc=len(src), handle=job)
        self._inflight[id(handle)] = handle
        self._cached.setdefault(self._route[peer], self._peer_instance.get(peer))   # Mooncake's cache from now on
        self._submitters[peer].submit(job)
        return handle

    def poll_write(self, handle: WriteHandle) -> WriteState:
        job = _job_of(handle)
        if handle.state is not WriteState.PENDING or job is None or not job.done.is_set():
            return handle.state
        if job.cancelled:
            handle.state = WriteState.FAILED
            handle.reason = f"mooncake write to {handle.peer!r} cancelled before it started (peer disconnected)"
        elif job.error is not None:
            handle.state = WriteState.FAILED
            handle.reason = f"mooncake write to {handle.peer!r} raised {job.error}"
        elif job.result == 0:
            handle.state = WriteState.DONE
        else:
            handle.state = WriteState.FAILED
            handle.reason = (
                f"mooncake write to {handle.peer!r} returned {job.result} (peer dead or unreachable,"
                " address rejected by the peer, or Mooncake timeout; Mooncake's log on stderr says which)"
            )
        return handle.state

    def release_write(self, handle: WriteHandle) -> None:
        """Forget a write; idempotent.

        On a PENDING write: if it has not started (queued behind another write to the same peer)
        it is cancelled and never touches memory. If it is already inside Mooncake it cannot be
        stopped: it runs to its end in its submit thread (for a frozen peer until Mooncake's stall
        timeout, 30 s by default) and may still read the source and write the destination, tag
        included. Either way the handle becomes FAILED ("released while pending"); in the second
        case ``handle.extra["may_touch_memory"]`` is True and ``handle.extra["returned"]`` is a
        threading.Event set once Mooncake has returned. To reuse the source memory safely, keep
        polling a PENDING write until it ends instead of releasing it (or wait for that event).
        """
        job = _job_of(handle)
        if job is None:
            return
        self.poll_write(handle)
        handle.handle = None
        self._inflight.pop(id(handle), None)
        if handle.state is WriteState.PENDING:
            cancelled = job.cancel()
            handle.state = WriteState.FAILED
            handle.extra["may_touch_memory"] = not cancelled
            if not cancelled:
                handle.extra["returned"] = job.done  # a threading.Event: set once Mooncake returns
            handle.reason = (
                f"mooncake write to {handle.peer!r} released while pending"
                + (" (cancelled before it started)" if cancelled else " (still running inside Mooncake)")
            )

    # ------------------------------------------------------------------ target side
    def drain_tags(self) -> list[ArrivedTag]:
        if self._closed:
            return []
        out = []
        for n in self._engine.get_notifies():
            try:
                name, msg = n.name, n.msg  # pybind decodes UTF-8: foreign notifies may not
            except UnicodeDecodeError:
                self.ignored_notifies += 1
                continue
            if not msg.startswith(TAG_PREFIX):
                self.ignored_notifies += 1
                continue
            try:
                tag = base64.b64decode(msg[len(TAG_PREFIX):], validate=True)
            except (binascii.Error, ValueError):
                self.ignored_notifies += 1
                continue
            out.append(ArrivedTag(peer=name, tag=tag))
        return out

    def progress(self) -> None:
        """Nothing to drive: Mooncake's own threads move the bytes and the notifies."""

    # ------------------------------------------------------------------ life cycle
    def _check_open(self) -> None:
        if self._closed:
            raise BackendError(f"backend {self._name!r} is closed")

    def close(self) -> None:
        """Release everything; idempotent.

        Queued writes are cancelled; a write already inside Mooncake is waited for (Mooncake
        bounds it: at most its timeout, 30 s by default, for a frozen peer), so no thread is
        inside the engine when it is dropped.
        """
        if self._closed:
            return
        self._closed = True
        close_at_exit(self, live=False)
        for handle in list(self._inflight.values()):
            self.release_write(handle)
        self._peers.clear()
        subs, self._submitters = list(self._submitters.values()), {}
        for sub in self._retired + subs:
            sub.stop(timeout=None)
        for reg in list(self._regs.values()):
            try:
                self.deregister(reg)
            except BackendError:
                pass
        self._engine = None

    def __del__(self) -> None:
        # Dropped without close(): let the idle submit threads end (they hold the engine).
        try:
            for sub in list(getattr(self, "_submitters", {}).values()):
                sub.stop(timeout=0)
        except Exception:  # pragma: no cover - best effort
            pass

    def __repr__(self) -> str:
        return f"MooncakeBackend(name={self._name!r}, peers={len(self._peers)}, closed={self._closed})"
