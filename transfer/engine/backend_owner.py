"""Ownership of a backend object (NIXL agent or Mooncake engine) by exactly one thread.

The control thread owns the backend once it runs (before, the thread setting the rank up does,
and after it stopped, the one tearing it down: a hand-over ordered by thread start and join).
It calls `step()` in its loop: queued commands run, pending writes are polled, arrived tags are
returned. Other threads (the transfer workers) never touch the backend: `submit_write` queues
the write and wakes the owner; `call` from another thread queues a function and waits for it.
Neither this module nor its users rely on the GIL: the queue and the lock are the only shared
state.

A write's completion callback runs exactly once, and only when the library no longer touches
its memory: a Mooncake write cannot be cancelled once inside the engine, so a write given up on
(deadline, lost peer, closing) is kept until Mooncake has returned.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import numpy as np

from ...hop_trace import TRACE, Hop
from ..backends.base import ArrivedTag, Backend, BackendError, WriteHandle, WriteState
from ..protocol.quiet import InFlight

log = logging.getLogger(__name__)

ABANDON_AFTER_DISCONNECT = 5.0

T = TypeVar("T")
if TYPE_CHECKING:   # typing's own from Python 3.11; annotations only, never evaluated
    from typing_extensions import TypeVarTuple, Unpack

    Ts = TypeVarTuple("Ts")


@dataclass(eq=False, kw_only=True)  # identity, not field equality: fields hold numpy arrays
class _Write:
    peer: str
    src: np.ndarray
    dst: np.ndarray
    tag: bytes
    on_done: Callable[[bool, str | None], None]
    handle: WriteHandle | None = None
    disconnected_at: float | None = None
    on_posted: Callable[[], object] | None = None
    dst_kind: str | None = None   # the peer memory's kind ("DRAM"/"VRAM"), see Backend.post_write
    room: int | None = None       # the request it belongs to (for the hop trace only)


class Step(NamedTuple):
    """What one round of step() did."""

    tags: list[ArrivedTag]     # notifications of writes that landed here
    progressed: bool           # whether anything happened (a command, a post, a completion, a tag)


@dataclass(frozen=True)
class _Call:
    """Another thread's call(): fn(backend, *args) on the owner, its result into `fut`."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    fut: Future[Any]


class BackendOwner:
    def __init__(self, backend: Backend, wake: Callable[[], None] | None = None):
        self.backend = backend
        self._wake = wake or (lambda: None)
        self._cmds: queue.SimpleQueue[_Call | _Write] = queue.SimpleQueue()   # from other threads
        self._lock = threading.Lock()
        self._fences: dict[str, float] = {}      # peer -> monotonic time its write lease ends
        self._owner: int | None = threading.get_ident()  # the constructing thread, until adopt()
        self._closed = False
        self.pending: list[_Write] = []
        self._to_post: collections.deque[_Write] = collections.deque()  # the owner's own, one per step
        self.draining: list[_Write] = []          # given up on, but the library may still touch them
        self.expecting = 0                        # writes announced towards us, tags not in (owner thread only)
        # a backend that says when a write completes (Mooncake) wakes the owner instead of being
        # polled: the polling took CPU from its transfer threads (docs/architecture.md)
        self._signalled = bool(getattr(backend, "signals_completion", False))

    # -- ownership -----------------------------------------------------------------------------
    def adopt(self) -> None:
        """The calling thread becomes the owner (the control thread when it starts, the closing
        thread once the control thread has stopped). Only call it when the previous owner is
        done with the backend: thread start and join order the hand-over."""
        self._owner = threading.get_ident()

    def release_ownership(self) -> None:
        """Nobody owns it until the next adopt(); other threads' requests wait in the queue."""
        self._owner = None

    def _mine(self) -> bool:
        return self._owner == threading.get_ident()

    # -- for any thread -------------------------------------------------------------------------
    def call(self, fn: Callable[[Backend, Unpack[Ts]], T], *args: Unpack[Ts], timeout: float = 60.0) -> T:
        """Run fn(backend, *args) on the owning thread and return its result (or raise)."""
        if self._mine():
            return fn(self.backend, *args)
        fut: Future[T] = Future()
        self._cmds.put(_Call(fn, args, fut))
        self._wake()
        return fut.result(timeout)

    def submit_write(self, peer: str, src: np.ndarray, dst: np.ndarray, tag: bytes,
                     on_done: Callable[[bool, str | None], None],
                     on_posted: Callable[[], object] | None = None, *, dst_kind: str | None = None,
                     room: int | None = None) -> None:
        """Post one write; on_done(ok, reason) runs on the owner exactly once, when the backend no
        longer touches the source memory. on_posted() runs on the owner just before the backend
        takes the write (a write may wait its turn behind an earlier one to the same peer first;
        a post that then fails still ends in on_done(False, ...)). dst_kind is
        the memory kind the peer advertised for `dst` (NIXL describes the remote side with it);
        `room` names the write's request in the hop trace (hop_trace.py)."""
        w = _Write(peer=peer, src=src, dst=dst, tag=tag, on_done=on_done, on_posted=on_posted, dst_kind=dst_kind,
                   room=room)
        if self._closed:
            _finish(w, False, "the backend is closed")
        elif self._mine():
            # posted by step(), one per loop, and only once the previous write to the same peer
            # completed: a transport that pushes data inline (UCX over TCP) then never makes the
            # control thread wait for more than one write's worth, so heartbeats keep flowing
            self._to_post.append(w)
        else:
            if TRACE.on:
                TRACE.hop(Hop.EVENT_QUEUED, room, "backend write")
            self._cmds.put(w)
            self._wake()

    def draining_bytes(self) -> int:
        """Source bytes of the writes given up on that the library may still read (their staging
        buffers and pages are not reused yet). The owner thread."""
        return sum(int(w.src[:, 1].sum()) for w in self.draining)

    def fence(self, peer: str, until: float | None) -> None:
        """Writes to `peer` are not driven after `until` (time.monotonic); None: no fence."""
        with self._lock:
            if until is None:
                self._fences.pop(peer, None)
            else:
                self._fences[peer] = until

    # -- the owner --------------------------------------------------------------------------------
    def in_flight(self) -> InFlight:
        """What the owner must poll for (protocol/quiet.py decides how often)."""
        polled = 0 if self._signalled else len(self.pending)
        return InFlight(writes=polled + len(self._to_post), expected=self.expecting, draining=len(self.draining),
                        postable=self._postable(), signalled=len(self.pending) - polled)

    def _postable(self) -> int:
        """Queued writes whose peer has no write of ours in flight (`_post_next` takes one)."""
        if not self._to_post:
            return 0
        busy_peers = {w.peer for w in self.pending}
        return sum(w.peer not in busy_peers for w in self._to_post)

    def step(self) -> Step:
        """One round of progress on the owning thread."""
        busy = self._commands()
        busy |= self._post_next()
        busy |= self._poll_writes()
        busy |= self._drain_released()
        tags: list[ArrivedTag] = []
        try:
            tags = self.backend.drain_tags()
        except Exception:  # noqa: BLE001 - a bad notification must not stop the rank
            log.warning("draining notifications failed", exc_info=True)
        if self.pending or self.expecting:
            try:
                self.backend.progress()
            except Exception:  # noqa: BLE001 - progress errors surface on the writes
                log.debug("backend progress raised", exc_info=True)
        return Step(tags, busy or bool(tags))

    def _post_next(self) -> bool:
        """Post the first queued write whose peer has no write of ours in flight."""
        busy_peers = {w.peer for w in self.pending}
        for w in self._to_post:
            if w.peer not in busy_peers:
                self._to_post.remove(w)
                self._post(w)
                return True
        return False

    def disconnect(self, peer: str) -> None:
        now = time.monotonic()
        for w in self.pending:
            if w.peer == peer and w.disconnected_at is None:
                w.disconnected_at = now
        try:
            self.backend.disconnect(peer)
        except Exception:  # noqa: BLE001
            log.warning("disconnecting %s failed", peer, exc_info=True)

    def abort_writes(self, drain_s: float = 60.0) -> None:
        """Fail every write (queued, pending, given up on), waiting (bounded) for those the library
        may still touch: afterwards no write of this rank is in flight and every buffer is free."""
        self._closed = True
        self._commands()
        while self._to_post:
            _finish(self._to_post.popleft(), False, "backend shutting down")
        for w in list(self.pending):
            self._give_up(w, "backend shutting down")
        deadline = time.monotonic() + drain_s
        try:
            while self.draining and time.monotonic() < deadline:
                self._drain_released()
                time.sleep(0.01)  # the library returns on its own threads: nothing to wait on
        finally:
            for w in self.draining:
                _finish(w, False, "backend shutting down")
            self.draining.clear()
        while True:  # nobody may wait forever on a command queued meanwhile
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Call):
                cmd.fut.set_exception(RuntimeError("the backend is closed"))
            else:
                _finish(cmd, False, "backend shutting down")

    def close(self) -> None:
        """abort_writes(), then close the backend (its remaining registrations go with it), even
        if aborting raised."""
        try:
            self.abort_writes()
        finally:
            try:
                self.backend.close()
            except Exception:  # noqa: BLE001
                log.warning("closing the backend failed", exc_info=True)

    # -- internals ----------------------------------------------------------------------------------
    def _commands(self) -> bool:
        did = False
        while True:  # (after abort_writes a queued write fails at once: see submit_write)
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return did
            did = True
            if isinstance(cmd, _Call):
                try:
                    cmd.fut.set_result(cmd.fn(self.backend, *cmd.args))
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    cmd.fut.set_exception(exc)
            else:
                if TRACE.on:
                    TRACE.hop(Hop.EVENT_TAKEN, cmd.room, "backend write")
                self._post(cmd)

    def _post(self, w: _Write) -> None:
        # the peer is told first: NIXL over cma completes a write only once the target has
        # progressed its worker, so a target already polling when the copy ends lets the write
        # complete as the post returns (docs/backends.md, "A write completes when the target polls")
        if w.on_posted is not None:
            try:
                w.on_posted()
            except Exception:  # noqa: BLE001
                log.exception("write posted callback raised")
        if TRACE.on:
            TRACE.hop(Hop.BACKEND_POST, w.room, f"{int(w.src[:, 1].sum())} bytes in {len(w.src)} ranges")
        try:
            if self._signalled:
                w.handle = self.backend.post_write(w.peer, w.src, w.dst, w.tag, dst_kind=w.dst_kind,
                                                   on_complete=self._wake)
            else:
                w.handle = self.backend.post_write(w.peer, w.src, w.dst, w.tag, dst_kind=w.dst_kind)
        except BackendError as exc:
            _finish(w, False, str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - any backend surprise fails only this write
            _finish(w, False, f"{type(exc).__name__}: {exc}")
            return
        self.pending.append(w)
        # a local copy (NIXL over cma) is often complete when the post returns: report it now, so
        # its transfer worker gathers its next piece while the next write is being posted
        self._poll_one(w, time.monotonic(), {})

    def _poll_writes(self) -> bool:
        did = False
        now = time.monotonic()
        with self._lock:
            fences = dict(self._fences)
        for w in list(self.pending):
            did |= self._poll_one(w, now, fences)
        return did

    def _poll_one(self, w: _Write, now: float, fences: dict[str, float]) -> bool:
        """Drive one pending write; True when it finished (or was given up on)."""
        if now > fences.get(w.peer, now + 1):
            # the lease with this peer ran out (say this process was frozen): the peer may have
            # reused the target memory, so this write is never driven again
            self._give_up(w, "the write lease with the peer expired")
            return True
        handle = _handle(w)
        try:
            state = self.backend.poll_write(handle)
        except Exception as exc:  # noqa: BLE001
            handle.state, handle.reason = WriteState.FAILED, f"{type(exc).__name__}: {exc}"
            state = WriteState.FAILED
        if state is WriteState.PENDING:
            if w.disconnected_at is not None and now - w.disconnected_at > ABANDON_AFTER_DISCONNECT:
                self._give_up(w, "peer disconnected")
                return True
            return False
        self.pending.remove(w)
        self._release(w)
        if state is not WriteState.DONE and handle.extra.get("may_touch_memory"):
            self.draining.append(w)  # failed (say the peer was disconnected) but may still land
        else:
            _finish(w, state is WriteState.DONE, handle.reason)
        return True

    def _give_up(self, w: _Write, reason: str) -> None:
        self.pending.remove(w)
        _handle(w).reason = reason
        self._release(w)
        if _handle(w).extra.get("may_touch_memory"):
            self.draining.append(w)
        else:
            _finish(w, False, reason)

    def _drain_released(self) -> bool:
        done = [w for w in self.draining if self._returned(w)]
        for w in done:
            self.draining.remove(w)
            _finish(w, False, _handle(w).reason)
        return bool(done)

    def _returned(self, w: _Write) -> bool:
        """Whether the library let go of a write it may have touched. A backend that gives no
        `returned` event breaks its contract: the write is kept (memory safety first) until
        abort_writes' bounded wait, and said once."""
        ev = _handle(w).extra.get("returned")
        if ev is None:
            if not _handle(w).extra.get("_no_event_logged"):
                _handle(w).extra["_no_event_logged"] = True
                log.error("backend %s gave no 'returned' event for a write it may still touch; it is kept "
                          "until the backend closes", type(self.backend).__name__)
            return False
        try:
            return bool(ev.is_set())
        except Exception:  # noqa: BLE001
            log.exception("checking whether a write was returned failed")
            return False

    def _release(self, w: _Write) -> None:
        try:
            self.backend.release_write(_handle(w))
        except Exception:  # noqa: BLE001
            log.debug("releasing a write failed", exc_info=True)


def _handle(w: _Write) -> WriteHandle:
    """A posted write's handle (every pending or draining write was posted)."""
    assert w.handle is not None, "a write that was never posted"
    return w.handle


def _finish(w: _Write, ok: bool, reason: str | None) -> None:
    if TRACE.on:
        TRACE.hop(Hop.BACKEND_DONE, w.room, "ok" if ok else f"failed: {reason}")
    try:
        w.on_done(ok, None if ok else (reason or "write failed"))
    except Exception:  # noqa: BLE001
        log.exception("write completion callback raised")
