"""Prefill sends that must wait for GPU work, waited on off the scheduler's thread.

Under SGLang's overlap schedule a prefill rank may send a request's cached prefix while the
previous forward pass may still be writing those pages: SGLang records a CUDA event and puts it
on the sender (`_early_send_wait_event`), and a backend must wait for it before it reads the
pages. With `supports_host_tensor_indices`, SGLang also hands the page indices as a pinned host
tensor that an asynchronous copy is still filling, with an `indices_event` to wait for before
they are read. kvstage's `KVSender.send` reads the indices and hands the chunk to kvstage's
control thread at once, on the caller's thread, so the adapter waits first, on a thread of its
own: the scheduler never blocks on the GPU.

`SendGate` is that thread: it runs queued jobs one at a time in submission order. A request's
sends (`RequestSends`) run at once on the caller's thread while none waits; from the first send
with an event on, each of its sends goes through the gate, so a request's chunks reach kvstage
in the order SGLang sent them. Nothing here imports SGLang.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger("kvstage.sglang")

Run = Callable[[Any, Any], str | None]   # (kv_indices, state_indices) -> failure reason or None


class SendGate:
    """One daemon thread running submitted jobs in order; it blocks on its queue when idle."""

    def __init__(self, name: str = "kvstage-send-gate"):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def close(self, timeout: float = 5.0) -> None:
        """Stop after the jobs already queued (each of them checks its own request first)."""
        self._jobs.put(None)
        self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job()
            except Exception:  # noqa: BLE001 - a job reports its own request's failure; never stop
                log.exception("a gated kvstage send raised")


class RequestSends:
    """The sends of one request. `run` does the send proper (reads the indices, calls kvstage)
    and returns a failure reason or None; `abort` aborts the kvstage request. A failure on the
    gate's thread is kept for the caller's next poll (`failure`)."""

    def __init__(self, gate: SendGate | None, run: Run, abort: Callable[[], None]):
        self._gate, self._run, self._abort = gate, run, abort
        self._lock = threading.Lock()      # a gated run against cancel(): none after it
        self._queued = 0
        self._cancelled = False
        self.failure: str | None = None

    def send(self, kv_indices: Any, state_indices: Any, events: Sequence[Any]) -> str | None:
        """Send now (returns `run`'s failure) or, with events to wait for or earlier sends of
        this request still queued, queue it on the gate (returns None)."""
        with self._lock:
            if self._cancelled or self.failure is not None:   # ended, or failed on the gate
                return None
            gated = self._gate is not None and (bool(events) or self._queued > 0)
            if gated:
                self._queued += 1
        if not gated:
            return self._run(kv_indices, state_indices)
        self._gate.submit(lambda: self._gated(kv_indices, state_indices, tuple(events)))
        return None

    def cancel(self) -> None:
        """The request ended here (abort, clear): queued sends are dropped."""
        with self._lock:
            self._cancelled = True

    def _gated(self, kv_indices: Any, state_indices: Any, events: tuple) -> None:
        failure = None
        try:
            for event in events:
                if self._cancelled:       # an ended request does not wait (SGLang's rule too)
                    break
                event.synchronize()
            with self._lock:
                if not self._cancelled and self.failure is None:
                    failure = self._run(kv_indices, state_indices)
        except Exception as exc:  # noqa: BLE001 - the request fails with the reason
            failure = f"waiting for SGLang's event before a send: {type(exc).__name__}: {exc}"
        finally:
            with self._lock:
                self._queued -= 1
        if failure is not None and self.failure is None:
            with self._lock:
                self.failure = failure
            try:
                self._abort()
            except Exception:  # noqa: BLE001 - the manager closed: the request failed anyway
                log.debug("aborting after a failed gated send raised", exc_info=True)
