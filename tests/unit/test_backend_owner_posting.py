"""BackendOwner tells the peer of a write before the backend takes it: a NIXL cma write
completes only once the target progresses its worker (docs/backends.md), so the decode rank
must already be polling when the copy inside the post ends. A fake backend records the order."""

import numpy as np
import pytest

from kvstage.transfer.backends.base import BackendError, WriteHandle, WriteState
from kvstage.transfer.engine.backend_owner import BackendOwner

ROW = np.zeros((1, 3), dtype=np.uint64)


class RecordingBackend:
    """post_write completes at once (a local copy) unless told to raise."""

    def __init__(self, log: list, raises: Exception | None = None):
        self.log, self.raises = log, raises

    def post_write(self, peer, src, dst, tag, dst_kind=None):
        self.log.append(("post_write", tag))
        if self.raises is not None:
            raise self.raises
        return WriteHandle(peer=peer, nbytes=8, ndesc=1, handle=object(), state=WriteState.DONE)

    def poll_write(self, h):
        return h.state

    def release_write(self, h):
        h.handle = None

    def drain_tags(self):
        return []

    def progress(self):
        pass


def submit(owner: BackendOwner, log: list, tag: bytes) -> None:
    owner.submit_write("peer", ROW, ROW, tag, lambda ok, reason: log.append(("done", tag, ok, reason)),
                       lambda: log.append(("announced", tag)))


def test_the_peer_is_told_before_the_backend_takes_the_write():
    log: list = []
    owner = BackendOwner(RecordingBackend(log))
    submit(owner, log, b"a")
    owner.step()
    assert log == [("announced", b"a"), ("post_write", b"a"), ("done", b"a", True, None)]


@pytest.mark.parametrize("error", [BackendError("refused"), RuntimeError("surprise")])
def test_a_post_that_fails_after_the_announcement_still_ends_the_write(error):
    log: list = []
    owner = BackendOwner(RecordingBackend(log, raises=error))
    submit(owner, log, b"a")
    owner.step()
    assert [e[0] for e in log] == ["announced", "post_write", "done"]
    assert log[-1][2] is False and str(error) in log[-1][3]
    assert not owner.pending


class PendingBackend(RecordingBackend):
    """Writes stay pending until the test completes them."""

    def post_write(self, peer, src, dst, tag, dst_kind=None):
        self.log.append(("post_write", tag))
        return WriteHandle(peer=peer, nbytes=8, ndesc=1, handle=object(), state=WriteState.PENDING)


def test_a_queued_write_is_postable_only_while_its_peer_has_none_in_flight():
    """The control loop does not sleep while in_flight().postable (transfer/protocol/quiet.py):
    a write queued behind a completion is posted by the next round at once."""
    log: list = []
    owner = BackendOwner(PendingBackend(log))
    submit(owner, log, b"a")
    submit(owner, log, b"b")
    assert owner.in_flight().postable == 2   # both queued, nothing in flight to the peer
    owner.step()                              # posts "a", still pending
    f = owner.in_flight()
    assert (f.writes, f.postable) == (2, 0)   # "b" waits for "a"
    owner.pending[0].handle.state = WriteState.DONE
    owner.step()                              # polling finds "a" complete after this step's post
    assert [e[1] for e in log if e[0] == "post_write"] == [b"a"]
    assert owner.in_flight().postable == 1
    owner.step()
    assert [e[1] for e in log if e[0] == "post_write"] == [b"a", b"b"]
    assert owner.in_flight().postable == 0


class SignallingBackend(RecordingBackend):
    """Completes a write only when the test says, then calls on_complete as Mooncake's thread would."""

    signals_completion = True

    def post_write(self, peer, src, dst, tag, *, dst_kind=None, on_complete=None):
        h = WriteHandle(peer=peer, nbytes=8, ndesc=1, handle=object())
        self.log.append((h, on_complete))
        return h


def test_the_owner_does_not_poll_a_write_whose_backend_signals_it():
    wakes: list[int] = []
    posted: list = []
    owner = BackendOwner(SignallingBackend(posted), wake=lambda: wakes.append(1))
    done: list[bool] = []
    owner.submit_write("peer", ROW, ROW, b"t", lambda ok, reason: done.append(ok))
    owner.step()
    f = owner.in_flight()
    assert (f.writes, f.signalled) == (0, 1)      # posted: nothing to poll, the loop may block
    handle, on_complete = posted[0]
    assert on_complete is not None and not wakes
    handle.state = WriteState.DONE
    on_complete()                                  # from the library's thread: wakes the loop
    assert wakes == [1]
    owner.step()
    assert done == [True] and owner.in_flight().signalled == 0
