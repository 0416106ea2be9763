"""The one worker loop of the staging threads: the prefill transfer workers and the
decode scatter thread (both in workers.py) each run it.

Threads block on one job queue; each takes a job, does it, and reports the outcome only after it
let go of the job (a scatter job holds views of the ring: they are dropped before the control
thread is told the ring region is free). `stop()` puts one stop mark per thread, so every job
queued before it is done first. Per-thread state (a staging buffer, a gatherer or scatterer
instance) is made on the thread itself, after its meter started.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from ..hop_trace import TRACE, Hop
from .thread_meter import ThreadMeter

J = TypeVar("J")

Report = Callable[[], None]   # tells the control thread how a job went
# work(job) -> its report; `work` belongs to one thread and may keep state across jobs
Work = Callable[[J], Report]


class JobThreads(Generic[J]):
    """`names`: (thread name, meter name) per thread; `make_work(i, meter)` runs first on thread
    i and returns that thread's `work`."""

    def __init__(self, names: Sequence[tuple[str, str]], make_work: Callable[[int, ThreadMeter], Work[J]],
                 queue_name: str = "jobs"):
        self.queue_name = queue_name   # in the hop trace (hop_trace.py)
        self._jobs: queue.SimpleQueue[J | None] = queue.SimpleQueue()
        self._make_work = make_work
        self.meters = [ThreadMeter(meter) for _, meter in names]
        self._threads = [threading.Thread(target=self._run, args=(i, m), name=thread, daemon=True)
                         for i, ((thread, _), m) in enumerate(zip(names, self.meters))]
        for t in self._threads:
            t.start()

    @property
    def count(self) -> int:
        return len(self._threads)

    def submit(self, job: J) -> None:
        if TRACE.on:
            TRACE.hop(Hop.EVENT_QUEUED, getattr(job, "room", None), f"{self.queue_name} {type(job).__name__}")
        self._jobs.put(job)

    def stop(self, timeout: float = 10.0) -> None:
        for _ in self._threads:
            self._jobs.put(None)
        for t in self._threads:
            t.join(timeout)

    def _run(self, index: int, meter: ThreadMeter) -> None:
        meter.started()
        try:
            work = self._make_work(index, meter)
            while True:
                job = self._jobs.get()
                meter.wake()
                if job is None:
                    return
                if TRACE.on:
                    TRACE.hop(Hop.EVENT_TAKEN, getattr(job, "room", None), f"{self.queue_name} {type(job).__name__}")
                report = work(job)
                del job   # nothing of the job outlives its work: then its outcome is told
                report()
        finally:
            meter.stopped()
