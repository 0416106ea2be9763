"""Prefill, direct path: waits on the caller's readiness objects (`send(..., ready=event)`) off
the control thread, which posts direct writes and must never block on a GPU.

One thread on a job queue (staging/job_threads.py): it calls `synchronize()` on each object of a
job, then hands the job's event to the control thread: `LayersReady` for a write, which is
posted then (or failed with the exception's text), `UnitReady` for a batching room's held unit
(write_batching.py). Staged pieces are waited on by their transfer worker instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ...staging.job_threads import JobThreads
from ...staging.thread_meter import ThreadMeter
from ...staging.workers import wait_ready


@dataclass(frozen=True, kw_only=True)
class ReadyJob:
    """Wait for `ready`, then post `event(error)` (error: None, or why waiting failed)."""

    ready: tuple[object, ...]
    event: Callable[[str | None], object]


class ReadyWaiter:
    def __init__(self, post: Callable[[object], None]):
        self._post = post
        self._thread: JobThreads[ReadyJob] = JobThreads([("kvstage-ready", "ready")], self._worker, "ready")
        self.meter = self._thread.meters[0]

    def submit(self, job: ReadyJob) -> None:
        self._thread.submit(job)

    def stop(self, timeout: float = 10.0) -> None:
        self._thread.stop(timeout)

    def _worker(self, index: int, meter: ThreadMeter) -> Callable[[ReadyJob], Callable[[], None]]:
        def work(job: ReadyJob) -> Callable[[], None]:
            error: str | None = None
            try:
                wait_ready(job.ready)
            except Exception as exc:  # noqa: BLE001 - fails the write (and its room), not the thread
                error = f"waiting for the layers to be ready failed: {type(exc).__name__}: {exc}"
            event = job.event(error)
            return lambda: _post_quietly(self._post, event)

        return work


def _post_quietly(post: Callable[[object], None], event: object) -> None:
    try:
        post(event)
    except RuntimeError:  # the control thread stopped: it failed and released every room itself
        pass
