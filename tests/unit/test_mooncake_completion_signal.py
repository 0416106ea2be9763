"""A Mooncake write ends on its submit thread, which tells the owner (`on_complete`) instead of
being polled for: the owner's polling took CPU from Mooncake's own transfer threads. The submit
thread runs with a fake engine here; the real engine is exercised by the integration tests, the
owner's side by tests/unit/test_backend_owner_posting.py."""

from __future__ import annotations

import threading

from kvstage.transfer.backends.mooncake_backend import MooncakeBackend, _Job, _Submitter


class FakeEngine:
    def __init__(self, result: int = 0):
        self.result = result

    def batch_transfer_sync(self, peer, src, dst, lens, op, notify):
        return self.result


def test_the_submit_thread_signals_once_the_write_is_final():
    seen: list[tuple[bool, int | None]] = []
    signalled = threading.Event()
    job = _Job(("peer", [1], [2], [3], None, None), None)

    def on_complete():
        seen.append((job.done.is_set(), job.result))
        signalled.set()

    job.on_complete = on_complete
    sub = _Submitter(FakeEngine(result=-1), "peer", 1)
    try:
        sub.submit(job)
        assert signalled.wait(5)
    finally:
        assert sub.stop(5)
    assert seen == [(True, -1)]   # once, after done was set and the result is in


def test_a_failing_callback_loses_nothing():
    def boom():
        raise RuntimeError("the owner's loop stopped")

    sub = _Submitter(FakeEngine(), "peer", 1)
    try:
        jobs = [_Job(("peer", [1], [2], [3], None, None), boom) for _ in range(2)]
        for job in jobs:
            sub.submit(job)
        assert all(job.done.wait(5) for job in jobs)   # the thread lived on to run the second
    finally:
        assert sub.stop(5)
    assert [job.result for job in jobs] == [0, 0]


def test_mooncake_says_it_signals():
    assert MooncakeBackend.signals_completion is True
