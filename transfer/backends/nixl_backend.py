"""NIXL (UCX) backend: one NIXL agent per Backend object, driven by its single owning thread.

Behaviour (measured facts in docs/backends.md):

- The agent is built with ``enable_prog_thread=False`` and the default (non-strict) thread sync
  mode: the object has ONE owning thread (the engine's backend thread), so nothing here locks.
  Progress only happens inside calls the owner makes: ``poll_write`` (``check_xfer_state``) on
  the writer, ``drain_tags``/``progress`` (``get_new_notifs``) on the target. Keep calling them.
- The tag travels as the write's NIXL notification. NIXL sends it only when the writer sees the
  handle complete, so a writer that stops polling a finished write also stops its tag.
- Identity = the agent metadata (``get_agent_metadata()``), taken at call time: call
  ``identity()`` after registering the memory peers will write to.
- Agent names carry a random suffix, so a restarted process is a new peer, never the old one.
- ``UCX_MODULES=^ib`` is set (when unset) before the first agent exists; without it every process
  that made a UCX backend exits with SIGSEGV at interpreter shutdown (docs/backends.md).
- NIXL's Python logger prints INFO lines on *stdout*; unless NIXL_LOG_LEVEL is set, this module
  lowers it to WARNING and moves its console handler to stderr.
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
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

# Must be in the environment before UCX is initialised by the first agent (docs/backends.md).
os.environ.setdefault("UCX_MODULES", "^ib")

from nixl._api import nixl_agent, nixl_agent_config  # noqa: E402  (after the env var above)

try:  # the exception types live in the bindings of whichever nixl-cuXX package is installed
    _bindings = sys.modules[nixl_agent.__module__.rsplit(".", 1)[0] + "._bindings"]
    _NotFound = _bindings.nixlNotFoundError
    _InvalidParam = _bindings.nixlInvalidParamError
    _RemoteDisconnect = _bindings.nixlRemoteDisconnectError
except (KeyError, AttributeError):  # pragma: no cover - other NIXL builds
    _NotFound = _InvalidParam = _RemoteDisconnect = ()


def _quiet_nixl_python_logging() -> None:
    """NIXL's logger writes INFO to stdout; keep stdout clean unless the user asked for logs."""
    if os.environ.get("NIXL_LOG_LEVEL"):
        return
    logger = logging.getLogger("nixl")
    if logger.level < logging.WARNING:
        logger.setLevel(logging.WARNING)
    for handler in logger.handlers:
        if isinstance(handler, logging.StreamHandler) and getattr(handler, "stream", None) is sys.stdout:
            handler.setStream(sys.stderr)


_quiet_nixl_python_logging()


def _describe(exc: BaseException) -> str:
    text = str(exc) or "(no message)"
    return f"{type(exc).__name__}: {text}"


class NixlBackend(Backend):
    """A Backend on one NIXL agent with the UCX plugin.

    Options: ``backends`` (NIXL plugin names, default ``["UCX"]``), ``num_threads`` (UCX worker
    threads, default 0 = NIXL's default). ``host`` is accepted for symmetry with Mooncake and is
    not used: UCX publishes its own worker addresses in the metadata (select interfaces with
    UCX_NET_DEVICES / UCX_TLS in the environment).
    """

    kind = "nixl"

    def __init__(
        self,
        name: str,
        host: str = "127.0.0.1",
        *,
        backends: Sequence[str] = ("UCX",),
        num_threads: int = 0,
    ):
        if not name or not isinstance(name, str):
            raise ValueError("name must be a non-empty str")
        os.environ.setdefault("UCX_MODULES", "^ib")
        self._name = f"{name}-{os.getpid()}-{secrets.token_hex(4)}"
        self.host = host
        self._plugins = list(backends)
        config = nixl_agent_config(
            enable_prog_thread=False,
            enable_listen_thread=False,
            backends=self._plugins,
            num_threads=num_threads,
        )
        try:
            self._agent = nixl_agent(self._name, config)
        except Exception as exc:
            raise BackendError(f"cannot create NIXL agent {self._name!r}: {_describe(exc)}") from exc
        missing = [b for b in self._plugins if b not in self._agent.backends]
        if missing:
            raise BackendError(f"NIXL plugin(s) {missing} not available (have {self._agent.plugin_list})")
        self._regs: dict[int, Registration] = {}
        self._index: dict[str, RangeIndex] = {k: RangeIndex() for k in MEMORY_KINDS}
        self._peers: set[str] = set()
        self._inflight: dict[int, WriteHandle] = {}  # id(handle) -> handle, not yet released
        self._abandoned: list[tuple[object, threading.Event]] = []  # (xfer handle, its "returned"): retry
        self._tags: list[ArrivedTag] = []  # notifications read by progress(), not yet drained
        self._closed = False
        close_at_exit(self)

    # ------------------------------------------------------------------ identity and memory
    @property
    def name(self) -> str:
        return self._name

    def identity(self) -> bytes:
        self._check_open()
        return bytes(self._agent.get_agent_metadata())

    def register(self, regions: Sequence[MemRegion]) -> Registration:
        self._check_open()
        regions = check_regions(regions)
        groups: dict[str, list[tuple[int, int, int]]] = {}
        for r in regions:
            groups.setdefault(r.kind, []).append((r.addr, r.length, r.device))
        done: list[tuple[str, object]] = []
        try:
            for kind, rows in groups.items():
                arr = np.array(rows, dtype=np.uint64)
                done.append((kind, self._agent.register_memory(arr, kind, backends=self._plugins)))
        except Exception as exc:
            for _, dlist in done:
                try:
                    self._agent.deregister_memory(dlist, backends=self._plugins)
                except Exception:
                    pass
            raise BackendError(
                f"NIXL could not register {len(regions)} region(s) ({', '.join(groups)}): {_describe(exc)}"
            ) from exc
        reg = Registration(regions=regions, handle=done, active=True)
        self._regs[id(reg)] = reg
        self._rebuild_index()
        return reg

    def deregister(self, registration: Registration) -> None:
        if not registration.active:
            return
        registration.active = False
        self._regs.pop(id(registration), None)
        self._rebuild_index()
        if self._closed and getattr(self, "_agent", None) is None:
            return
        errors = []
        done = cast("list[tuple[str, object]] | None", registration.handle)   # register()'s (kind, NIXL list)s
        for _, dlist in done or ():
            try:
                self._agent.deregister_memory(dlist, backends=self._plugins)
            except Exception as exc:
                errors.append(_describe(exc))
        if errors:
            raise BackendError(f"NIXL deregistration failed: {'; '.join(errors)}")

    def _rebuild_index(self) -> None:
        for kind in MEMORY_KINDS:
            self._index[kind] = RangeIndex(
                [(r.addr, r.length) for reg in self._regs.values() for r in reg.regions if r.kind == kind]
            )

    # ------------------------------------------------------------------ peers
    def connect(self, peer_identity: bytes) -> str:
        """Load a peer's metadata; return its agent name.

        Connecting again to a known peer replaces its metadata when none of our writes to it is
        in flight (NIXL itself only *adds* registrations when metadata is loaded twice, so memory
        the peer deregistered would otherwise stay writable from here). With writes in flight
        the new registrations are added and the old ones stay known until disconnect().
        """
        self._check_open()
        name = self._load(peer_identity)
        if name in self._peers and not any(h.peer == name for h in self._inflight.values()):
            try:
                self._agent.remove_remote_agent(name)
            except Exception:
                pass
            name = self._load(peer_identity)
        self._peers.add(name)
        return name

    def _load(self, peer_identity: bytes) -> str:
        try:
            name: str | bytes = self._agent.add_remote_agent(bytes(peer_identity))
        except Exception as exc:
            raise BackendError(f"cannot load peer metadata ({len(peer_identity)} bytes): {_describe(exc)}") from exc
        if isinstance(name, (bytes, bytearray)):  # NIXL 1.5 returns the agent name as bytes
            name = bytes(name).decode("utf-8", "replace")
        return name

    def disconnect(self, peer: str) -> None:
        """Forget a peer; idempotent. Our writes to it still in flight are released first
        (cancelled, see release_write): poll_write reports them FAILED."""
        if peer not in self._peers:
            return
        for h in [h for h in self._inflight.values() if h.peer == peer]:
            self.release_write(h)
        self._peers.discard(peer)
        try:
            self._agent.remove_remote_agent(peer)
        except Exception:
            pass  # the peer's metadata is gone either way; nothing a caller can do about it

    # ------------------------------------------------------------------ writes
    def post_write(
        self, peer: str, src: np.ndarray, dst: np.ndarray, tag: bytes, *, dst_kind: str | None = None,
        on_complete: Callable[[], None] | None = None,
    ) -> WriteHandle:
        self._check_open()
        if peer not in self._peers:
            raise BackendError(f"unknown peer {peer!r}: connect() its identity first")
        src, dst, tag = check_write_request(src, dst, tag)
        src_kind = self._source_kind(src)
        dkind = dst_kind or src_kind
        if dkind not in MEMORY_KINDS:
            raise ValueError(f"dst_kind must be one of {MEMORY_KINDS}, got {dst_kind!r}")
        try:
            local = self._agent.get_xfer_descs(src, src_kind)
            remote = self._agent.get_xfer_descs(dst, dkind)
            xfer = self._agent.initialize_xfer("WRITE", local, remote, peer, tag, backends=self._plugins)
        except _NotFound as exc:
            raise BackendError(
                f"write to {peer!r}: the destination ({len(dst)} rows, {dkind}) is not inside memory the peer"
                f" registered before publishing its identity ({_describe(exc)})"
            ) from exc
        except _InvalidParam as exc:
            raise BackendError(f"write to {peer!r}: invalid request ({_describe(exc)})") from exc
        except Exception as exc:
            raise BackendError(f"write to {peer!r}: NIXL rejected the request ({_describe(exc)})") from exc
        handle = WriteHandle(peer=peer, nbytes=int(src[:, 1].sum()), ndesc=len(src), handle=xfer)
        self._inflight[id(handle)] = handle
        try:
            state = self._agent.transfer(xfer)
        except Exception as exc:
            self._fail(handle, f"post failed: {_describe(exc)}")
            return handle
        self._apply(handle, state)
        return handle

    def _source_kind(self, src: np.ndarray) -> str:
        """The kind of registered memory every source row lies in (one pass per kind registered:
        a write's post runs right after a copy has evicted the caches, see DirectRowsCache)."""
        for kind in MEMORY_KINDS:
            if not len(self._index[kind]):
                continue
            outside = self._index[kind].outside(src)
            if not len(outside):
                return kind
            if len(outside) < len(src):   # partly in this kind: the rows that are not
                i = int(outside[0])
                raise BackendError(
                    f"source row {i} (addr {int(src[i, 0]):#x}, {int(src[i, 1])} bytes) is not inside"
                    f" registered {kind} memory ({len(outside)} such rows)"
                )
        raise BackendError(
            f"source row 0 (addr {int(src[0, 0]):#x}, {int(src[0, 1])} bytes) is not inside registered memory"
        )

    def _apply(self, handle: WriteHandle, state: str) -> None:
        if state == "DONE":
            handle.state = WriteState.DONE
        elif state == "ERR":
            self._fail(handle, "NIXL reported ERR for the transfer")

    def _fail(self, handle: WriteHandle, reason: str) -> None:
        handle.state = WriteState.FAILED
        handle.reason = f"nixl write to {handle.peer!r} failed: {reason}"

    def poll_write(self, handle: WriteHandle) -> WriteState:
        if handle.state is not WriteState.PENDING or handle.handle is None or self._closed:
            return handle.state
        try:
            state = self._agent.check_xfer_state(handle.handle)
        except _RemoteDisconnect as exc:
            self._fail(handle, f"peer disconnected ({_describe(exc)})")
            return handle.state
        except Exception as exc:
            self._fail(handle, _describe(exc))
            return handle.state
        self._apply(handle, state)
        return handle.state

    def release_write(self, handle: WriteHandle) -> None:
        """Free a write's NIXL handle; idempotent.

        On a PENDING write this abandons it: NIXL is asked to cancel the transfer (UCX cancels
        in-flight requests; on a frozen peer this returned at once in our runs) and the handle is
        marked FAILED ("released while pending"). Its tag is never sent (the notification goes
        out only when the writer sees completion), but the destination may hold some of the
        bytes. If NIXL refuses to cancel now, ``handle.extra["may_touch_memory"]`` is set, the
        NIXL handle is kept and released again by later progress() calls and by close(), and
        ``handle.extra["returned"]`` is a threading.Event set once that release succeeded (the
        same contract as Mooncake's).
        """
        xfer = handle.handle
        if xfer is None:
            return
        handle.handle = None
        self._inflight.pop(id(handle), None)
        if handle.state is WriteState.PENDING:
            self._fail(handle, "released while pending (abandoned)")
        if getattr(self, "_agent", None) is None:
            return
        try:
            self._agent.release_xfer_handle(xfer)
        except Exception:
            returned = threading.Event()
            handle.extra["may_touch_memory"] = True
            handle.extra["returned"] = returned
            self._abandoned.append((xfer, returned))

    def _retry_abandoned(self) -> None:
        still = []
        for xfer, returned in self._abandoned:
            try:
                self._agent.release_xfer_handle(xfer)
            except Exception:
                still.append((xfer, returned))
            else:
                returned.set()
        self._abandoned = still

    # ------------------------------------------------------------------ target side
    def progress(self) -> None:
        if self._closed:
            return
        if self._abandoned:
            self._retry_abandoned()
        notifs = self._agent.get_new_notifs()
        for peer, msgs in notifs.items():
            name = peer.decode("utf-8", "replace") if isinstance(peer, (bytes, bytearray)) else str(peer)
            self._tags.extend(ArrivedTag(peer=name, tag=bytes(m)) for m in msgs)

    def drain_tags(self) -> list[ArrivedTag]:
        self.progress()
        out, self._tags = self._tags, []
        return out

    # ------------------------------------------------------------------ life cycle
    def _check_open(self) -> None:
        if self._closed:
            raise BackendError(f"backend {self._name!r} is closed")

    def close(self) -> None:
        if self._closed:
            return
        try:
            for handle in list(self._inflight.values()):
                self.release_write(handle)
            for peer in list(self._peers):
                self.disconnect(peer)
            for reg in list(self._regs.values()):
                try:
                    self.deregister(reg)
                except BackendError:
                    pass
            if self._abandoned:
                self._retry_abandoned()
        finally:
            self._closed = True
            close_at_exit(self, live=False)
            self._tags = []
            # Drop the agent now (not at interpreter teardown); handles not yet released keep
            # the C++ agent alive through their own reference until they are collected.
            self._agent = None

    def __repr__(self) -> str:
        return f"NixlBackend(name={self._name!r}, peers={len(self._peers)}, closed={self._closed})"
