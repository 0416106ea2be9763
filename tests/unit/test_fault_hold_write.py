"""FaultPlan.hold_write_rooms: a chosen room's writes stay in flight for hold_write_s, then land.

Used by the SGLang adapter's deferred-release test to have a write land after its room failed.
The clock is the faults module's time.monotonic, replaced here so nothing sleeps.
"""

from __future__ import annotations

from test_dst_kind import DST, SRC, RecordingBackend

from kvstage.transfer.backends import WriteHandle, WriteState, faults
from kvstage.transfer.backends.faults import FaultPlan, FaultyBackend


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_held_write_reaches_the_backend_only_after_its_hold(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(faults.time, "monotonic", clock)
    be = RecordingBackend()
    faulty = FaultyBackend(be, FaultPlan(hold_write_rooms=[7], hold_write_s=2.0), room_of=lambda tag: tag[0])
    other = faulty.post_write("peer", SRC, DST, bytes([3]))
    held = faulty.post_write("peer", SRC, DST, bytes([7]), dst_kind="VRAM")
    assert be.posts == [("peer", None)]                     # room 3 went through, room 7 did not
    assert faulty.poll_write(other) is WriteState.DONE
    assert held.nbytes == 64 and faulty.poll_write(held) is WriteState.PENDING
    clock.now += 1.9
    assert faulty.poll_write(held) is WriteState.PENDING and len(be.posts) == 1
    clock.now += 0.2
    assert faulty.poll_write(held) is WriteState.DONE      # posted now, with its memory kind
    assert be.posts == [("peer", None), ("peer", "VRAM")]
    assert faulty.poll_write(held) is WriteState.DONE and len(be.posts) == 2   # posted once
    assert faulty.injected == {"held_write": 1}


def test_a_held_write_released_before_its_hold_never_lands(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(faults.time, "monotonic", clock)
    be = RecordingBackend()
    released: list[WriteHandle] = []
    be.release_write = released.append
    faulty = FaultyBackend(be, FaultPlan(hold_write_rooms=[7], hold_write_s=2.0), room_of=lambda tag: tag[0])
    held = faulty.post_write("peer", SRC, DST, bytes([7]))
    faulty.release_write(held)
    clock.now += 5
    assert be.posts == [] and released == []
    assert "may_touch_memory" not in held.extra


def test_without_room_of_nothing_is_held():
    be = RecordingBackend()
    faulty = FaultyBackend(be, FaultPlan(hold_write_rooms=[7], hold_write_s=2.0))
    h = faulty.post_write("peer", SRC, DST, bytes([7]))
    assert faulty.poll_write(h) is WriteState.DONE and len(be.posts) == 1
