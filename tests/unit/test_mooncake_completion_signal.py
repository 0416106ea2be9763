"""A Mooncake write ends on its submit thread, which tells the owner (`on_complete`) instead of
being polled for: the owner's polling took CPU from Mooncake's own transfer threads. The submit
thread runs with a fake engine here; the real engine is exercised by the integration tests."""

from __future__ import annotations

import threading

import numpy as np

from kvstage.transfer.backends.base import WriteHandle, WriteState
from kvstage.transfer.backends.mooncake_backend import MooncakeBackend, _Job, _Submitter
from kvstage.transfer.engine.backend_owner import BackendOwner

ROW = np.zeros((1, 3), dtype=np.uint64)


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


class SignallingBackend:
    """Completes a write only when the test says, then calls on_complete as Mooncake's thread would."""

    signals_completion = True

    def __init__(self):
        self.posted: list = []

    def post_write(self, peer, src, dst, tag, *, dst_kind=None, on_complete=None):
        h = WriteHandle(peer=peer, nbytes=8, ndesc=1, handle=object())
        self.posted.append((h, on_complete))
        return h

    def poll_write(self, h):
        return h.state

    def release_write(self, h):
        h.handle = None

    def drain_tags(self):
        return []

    def progress(self):
        pass


def test_the_owner_does_not_poll_a_write_whose_backend_signals_it():
    wakes: list[int] = []
    backend = SignallingBackend()
    owner = BackendOwner(backend, wake=lambda: wakes.append(1))
    done: list[bool] = []
    owner.submit_write("peer", ROW, ROW, b"t", lambda ok, reason: done.append(ok))
    owner.step()
    f = owner.in_flight()
    assert (f.writes, f.signalled) == (0, 1)      # posted: nothing to poll, the loop may block
    handle, on_complete = backend.posted[0]
    assert on_complete is not None and not wakes
    handle.state = WriteState.DONE
    on_complete()                                  # from the library's thread: wakes the loop
    assert wakes == [1]
    owner.step()
    assert done == [True] and owner.in_flight().signalled == 0


def test_mooncake_says_it_signals():
    assert MooncakeBackend.signals_completion is True
