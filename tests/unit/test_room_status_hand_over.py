"""RoomStatus gives the interpreter away right after it woke a caller blocked in wait(), and
only then (transfer/engine/handles.py): not when nobody waits, not on a change nobody waits for."""

from __future__ import annotations

import threading
import time

from kvstage.transfer.engine.handles import RoomStatus
from kvstage.transfer.poll import KVPoll


def _ended(st: RoomStatus) -> bool:
    return st.state in (KVPoll.Success, KVPoll.Failed)


def _blocked_waiter(status: RoomStatus) -> tuple[threading.Thread, list[bool]]:
    """A caller thread blocked in status.wait(ended), once this returns."""
    got: list[bool] = []
    t = threading.Thread(target=lambda: got.append(status.wait(_ended, timeout=30)), daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while status._waiting == 0:   # the condition itself: the caller is inside wait()
        assert time.monotonic() < deadline, "the waiter never got into wait()"
        time.sleep(0.001)
    return t, got


def test_a_waiting_caller_woken_by_the_end_gets_the_interpreter_once():
    handed: list[int] = []
    status = RoomStatus(hand_over=lambda: handed.append(1))
    t, got = _blocked_waiter(status)
    status.update(KVPoll.Transferring, None, None, False)   # nothing a waiter waits for
    assert handed == []
    status.update(KVPoll.Success, None, None, False)
    t.join(10)
    assert got == [True] and handed == [1]
    assert status._waiting == 0


def test_nobody_waiting_no_hand_over():
    handed: list[int] = []
    status = RoomStatus(hand_over=lambda: handed.append(1))
    status.update(KVPoll.Transferring, None, None, False)
    status.update(KVPoll.Success, None, None, False)
    status.update(KVPoll.Success, None, None, True)
    assert handed == []


def test_a_release_wakes_a_waiter_too():
    handed: list[int] = []
    status = RoomStatus(hand_over=lambda: handed.append(1))
    got: list[bool] = []
    t = threading.Thread(target=lambda: got.append(status.wait(lambda st: st.released, timeout=30)), daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while status._waiting == 0:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    status.update(KVPoll.Failed, "gone", "peer_lost", True)
    t.join(10)
    assert got == [True] and handed == [1]


def test_a_wait_that_times_out_leaves_no_waiter_counted():
    handed: list[int] = []
    status = RoomStatus(hand_over=lambda: handed.append(1))
    assert status.wait(_ended, timeout=0.01) is False
    status.update(KVPoll.Success, None, None, False)
    assert handed == []
