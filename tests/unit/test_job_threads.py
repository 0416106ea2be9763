"""The one worker loop of the staging threads (staging/job_threads.py). The declared interfaces
of the role's sides are checked in test_engine_parts.py."""

import gc
import threading
import time
import weakref

from kvstage.staging.job_threads import JobThreads


class Job:
    def __init__(self, n):
        self.n = n


def _wait(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_each_thread_makes_its_own_work_on_itself_and_every_job_queued_before_stop_is_done():
    made, done, lock = [], [], threading.Lock()

    def make_work(index, meter):
        made.append((index, threading.current_thread().name, meter.name))

        def work(job):
            with lock:
                done.append((index, job.n))
            return lambda: None
        return work

    threads = JobThreads([("t-a", "a"), ("t-b", "b")], make_work)
    for n in range(50):
        threads.submit(Job(n))
    threads.stop()
    assert sorted(made) == [(0, "t-a", "a"), (1, "t-b", "b")]
    assert sorted(n for _, n in done) == list(range(50))
    assert threads.count == 2 and [m.name for m in threads.meters] == ["a", "b"]
    assert all(m.wakeups >= 1 for m in threads.meters)


def test_a_job_is_let_go_before_its_outcome_is_reported():
    """A scatter job holds views of the ring: they must be gone when the region is reported free."""
    alive_at_report = []
    refs = []

    def make_work(index, meter):
        def work(job):
            refs.append(weakref.ref(job))
            ref = refs[-1]

            def report():
                gc.collect()
                alive_at_report.append(ref() is not None)
            return report
        return work

    threads = JobThreads([("t", "m")], make_work)
    threads.submit(Job(1))
    threads.submit(Job(2))
    _wait(lambda: len(alive_at_report) == 2)
    threads.stop()
    assert alive_at_report == [False, False]
