"""The one thread that owns a backend object (NIXL agent or Mooncake engine).

Other threads never touch the backend: they post commands here (`call` waits for a result,
`submit_write` does not) and get completions back through callbacks run on this thread.
The thread drives progress itself: eagerly (short, backing-off sleeps) while writes are
pending or tags are expected, lazily otherwise.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..backends.base import ArrivedTag, Backend, BackendError, WriteHandle, WriteState

log = logging.getLogger(__name__)

MIN_SLEEP = 20e-6
MAX_EAGER_SLEEP = 1e-3
IDLE_WAIT = 50e-3  # nothing pending, no tags expected: wake for commands, else rarely
ABANDON_AFTER_DISCONNECT = 5.0


@dataclass(eq=False)  # identity, not field equality: fields hold numpy arrays
class _Write:
    peer: str
    src: np.ndarray
    dst: np.ndarray
    tag: bytes
    on_done: Callable[[bool, str | None], None]
    handle: WriteHandle | None = None
    disconnected_at: float | None = None


class BackendThread:
    def __init__(self, factory: Callable[[], Backend], on_tags: Callable[[list[ArrivedTag]], None],
                 name: str = "kvstage-backend"):
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._on_tags = on_tags
        self._pending: list[_Write] = []
        self._draining: list[_Write] = []  # released, but the library may still touch their memory
        self._eager_lock = threading.Lock()
        self._eager = 0
        self._fences: dict[str, float] = {}  # peer -> monotonic time its write lease ends (under _eager_lock)
        self._stopping = False
        self.backend: Backend | None = None
        started: Future = Future()
        self._thread = threading.Thread(target=self._run, args=(factory, started), name=name, daemon=True)
        self._thread.start()
        started.result()  # re-raises a failure to create the backend

    # -- API for other threads ------------------------------------------------------------------
    def call(self, fn: Callable[..., Any], *args: Any, timeout: float = 60.0) -> Any:
        """Run fn(backend, *args) on the owning thread and return its result (or raise)."""
        if not self._thread.is_alive():
            raise RuntimeError("the backend thread has stopped")
        fut: Future = Future()
        self._cmds.put(("call", fn, args, fut))
        return fut.result(timeout)

    def submit_write(self, peer: str, src: np.ndarray, dst: np.ndarray, tag: bytes,
                     on_done: Callable[[bool, str | None], None]) -> None:
        """Post one write; on_done(ok, reason) runs on this thread exactly once, when the
        backend no longer touches the source memory."""
        w = _Write(peer, src, dst, tag, on_done)
        if not self._thread.is_alive():
            self._finish(w, False, "the backend thread has stopped")
            return
        self._cmds.put(("write", w))

    def disconnect(self, peer: str) -> None:
        """Forget a peer (asynchronously); its pending writes fail."""
        self._cmds.put(("disconnect", peer))

    def fence(self, peer: str, until: float | None) -> None:
        """Writes to `peer` must not be driven after `until` (time.monotonic); None: no fence.
        The control thread moves it forward with every acknowledged heartbeat."""
        with self._eager_lock:
            if until is None:
                self._fences.pop(peer, None)
            else:
                self._fences[peer] = until

    def expect_tags(self, delta: int) -> None:
        """Count of reasons to drain notifications eagerly (rooms expecting writes)."""
        with self._eager_lock:
            self._eager = max(0, self._eager + delta)

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread.is_alive():
            self._cmds.put(("stop",))
            self._thread.join(timeout)

    # -- the owning thread ----------------------------------------------------------------------
    def _run(self, factory: Callable[[], Backend], started: Future) -> None:
        try:
            self.backend = factory()
        except BaseException as exc:  # noqa: BLE001 - handed to the constructor
            started.set_exception(exc)
            return
        started.set_result(None)
        sleep = MIN_SLEEP
        try:
            while not self._stopping:
                try:
                    sleep = self._iterate(sleep)
                except Exception:  # noqa: BLE001 - keep owning the backend; never die silently
                    log.exception("backend thread iteration failed")
                    time.sleep(MAX_EAGER_SLEEP)
        finally:
            self._shutdown()

    def _iterate(self, sleep: float) -> float:
        busy = self._commands(block=False)
        busy |= self._poll_writes()
        busy |= self._drain_released()
        busy |= self._drain()
        with self._eager_lock:
            eager = self._eager > 0
        if self._pending or self._draining or eager:
            sleep = MIN_SLEEP if busy else min(sleep * 2, MAX_EAGER_SLEEP)
            try:
                self.backend.progress()
            except Exception:  # noqa: BLE001 - progress errors surface on the writes
                log.debug("backend progress raised", exc_info=True)
            time.sleep(sleep)
            return sleep
        self._commands(block=True)
        return MIN_SLEEP

    def _commands(self, block: bool) -> bool:
        did = False
        while True:
            try:
                cmd = self._cmds.get(timeout=IDLE_WAIT) if block and not did else self._cmds.get_nowait()
            except queue.Empty:
                return did
            did = True
            kind = cmd[0]
            if kind == "call":
                _, fn, args, fut = cmd
                try:
                    fut.set_result(fn(self.backend, *args))
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(exc)
            elif kind == "write":
                self._post(cmd[1])
            elif kind == "disconnect":
                self._disconnect(cmd[1])
            elif kind == "stop":
                self._stopping = True
                return did

    def _post(self, w: _Write) -> None:
        try:
            w.handle = self.backend.post_write(w.peer, w.src, w.dst, w.tag)
        except BackendError as exc:
            self._finish(w, False, str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - any backend surprise fails only this write
            self._finish(w, False, f"{type(exc).__name__}: {exc}")
            return
        self._pending.append(w)

    def _poll_writes(self) -> bool:
        did = False
        now = time.monotonic()
        with self._eager_lock:
            fences = dict(self._fences)
        for w in list(self._pending):
            if now > fences.get(w.peer, now + 1):
                # the lease with this peer ran out (say this process was frozen): the peer may
                # have reused the target memory, so this write is never driven again
                self._give_up(w, "the write lease with the peer expired")
                did = True
                continue
            try:
                state = self.backend.poll_write(w.handle)
            except Exception as exc:  # noqa: BLE001
                w.handle.state, w.handle.reason = WriteState.FAILED, f"{type(exc).__name__}: {exc}"
                state = WriteState.FAILED
            if state is WriteState.PENDING:
                if w.disconnected_at is not None and now - w.disconnected_at > ABANDON_AFTER_DISCONNECT:
                    self._give_up(w, "peer disconnected")
                    did = True
                continue
            did = True
            self._pending.remove(w)
            self._release(w)
            self._finish(w, state is WriteState.DONE, w.handle.reason)
        return did

    def _drain(self) -> bool:
        try:
            tags = self.backend.drain_tags()
        except Exception:  # noqa: BLE001
            log.warning("draining notifications failed", exc_info=True)
            return False
        if tags:
            self._on_tags(tags)
        return bool(tags)

    def _disconnect(self, peer: str) -> None:
        now = time.monotonic()
        for w in self._pending:
            if w.peer == peer and w.disconnected_at is None:
                w.disconnected_at = now
        try:
            self.backend.disconnect(peer)
        except Exception:  # noqa: BLE001
            log.warning("disconnecting %s failed", peer, exc_info=True)

    def _release(self, w: _Write) -> None:
        try:
            self.backend.release_write(w.handle)
        except Exception:  # noqa: BLE001
            log.debug("releasing a write failed", exc_info=True)

    def _give_up(self, w: _Write, reason: str) -> None:
        """Stop waiting for a write. Its completion is reported only once the library is known
        to leave its memory alone (Mooncake cannot cancel a write already inside the engine):
        until then the source buffer stays with this write and nobody reuses it."""
        self._pending.remove(w)
        w.handle.reason = reason
        self._release(w)
        if w.handle.extra.get("may_touch_memory"):
            self._draining.append(w)
        else:
            self._finish(w, False, reason)

    def _drain_released(self) -> bool:
        done = [w for w in self._draining if w.handle.extra["returned"].is_set()]
        for w in done:
            self._draining.remove(w)
            self._finish(w, False, w.handle.reason)
        return bool(done)

    @staticmethod
    def _finish(w: _Write, ok: bool, reason: str | None) -> None:
        try:
            w.on_done(ok, None if ok else (reason or "write failed"))
        except Exception:  # noqa: BLE001
            log.exception("write completion callback raised")

    def _shutdown(self) -> None:
        for w in list(self._pending):
            self._give_up(w, "backend shutting down")
        deadline = time.monotonic() + 60
        while self._draining and time.monotonic() < deadline:  # close() would wait for them too
            self._drain_released()
            time.sleep(0.01)
        for w in self._draining:
            self._finish(w, False, "backend shutting down")
        self._draining.clear()
        # fail whatever is still queued, so no caller waits forever
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                break
            if cmd[0] == "call":
                cmd[3].set_exception(RuntimeError("backend thread stopped"))
            elif cmd[0] == "write":
                self._finish(cmd[1], False, "backend shutting down")
        if self.backend is not None:
            try:
                self.backend.close()
            except Exception:  # noqa: BLE001
                log.warning("closing the backend failed", exc_info=True)
