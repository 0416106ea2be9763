"""The pure decisions of a quiet engine (transfer/protocol/quiet.py): what is in flight, how long
the control thread blocks, and which announced writes a decode rank still waits for."""

import pytest

from kvstage.transfer.protocol.quiet import (
    DRAIN_WAIT,
    MAX_EAGER_WAIT,
    MIN_EAGER_WAIT,
    Activity,
    Announcement,
    Arrival,
    ExpectedWrites,
    InFlight,
    activity,
    next_wait,
)


def test_activity_is_the_most_urgent_thing_in_flight():
    assert activity(InFlight()) is Activity.QUIET
    assert activity(InFlight(draining=1)) is Activity.DRAINING
    assert activity(InFlight(expected=2, draining=1)) is Activity.EXPECTED
    assert activity(InFlight(writes=1, expected=2, draining=1)) is Activity.WRITES


def test_quiet_blocks_until_the_tick_and_never_for_a_negative_time():
    assert next_wait(Activity.QUIET, last=MIN_EAGER_WAIT, progressed=True, now=10.0, next_tick=10.07) == pytest.approx(0.07)
    assert next_wait(Activity.QUIET, last=0.0, progressed=False, now=10.2, next_tick=10.1) == 0.0


def test_in_flight_polls_soon_after_progress_and_backs_off_to_the_cap():
    w = next_wait(Activity.EXPECTED, last=MAX_EAGER_WAIT, progressed=True, now=0.0, next_tick=1.0)
    assert w == MIN_EAGER_WAIT
    seen = []
    for _ in range(10):
        w = next_wait(Activity.WRITES, last=w, progressed=False, now=0.0, next_tick=1.0)
        seen.append(w)
    assert seen[0] == 2 * MIN_EAGER_WAIT and seen[-1] == MAX_EAGER_WAIT and seen == sorted(seen)
    assert next_wait(Activity.WRITES, last=MAX_EAGER_WAIT, progressed=False, now=0.99995, next_tick=1.0) < 1e-4


def test_a_postable_write_is_posted_without_a_sleep():
    for act in (Activity.WRITES, Activity.EXPECTED):
        assert next_wait(act, last=MAX_EAGER_WAIT, progressed=False, now=0.0, next_tick=1.0, postable=True) == 0.0
    assert next_wait(Activity.WRITES, last=0.0, progressed=True, now=0.0, next_tick=1.0) == MIN_EAGER_WAIT


def test_draining_polls_now_and_then():
    assert next_wait(Activity.DRAINING, last=0.0, progressed=True, now=0.0, next_tick=1.0) == DRAIN_WAIT
    assert next_wait(Activity.DRAINING, last=0.0, progressed=True, now=0.0, next_tick=0.001) == 0.001


def test_expected_writes_count_announced_tags_not_in():
    e = ExpectedWrites()
    assert [e.announce(7, (1, 0, 0)), e.announce(7, (2, 0, 0)), e.announce(8, (1, 0, 0))] == [Announcement.ACCEPTED] * 3
    assert e.announce(7, (1, 0, 0)) is Announcement.REPEATED
    assert e.outstanding == 3
    assert e.landed(7, (1, 0, 0)) is Arrival.EXPECTED
    assert e.landed(7, (1, 0, 0)) is Arrival.REPEATED
    assert e.outstanding == 2
    e.forget(7)
    assert e.outstanding == 1 and e.rooms() == 1
    e.forget(8)
    assert e.outstanding == 0 and e.rooms() == 0


def test_a_tag_before_its_announcement_leaves_nothing_outstanding():
    e = ExpectedWrites()
    assert e.landed(3, (1, 2, 0)) is Arrival.UNANNOUNCED
    assert e.announce(3, (1, 2, 0)) is Announcement.AFTER_TAG   # the late message of a write already in
    assert e.outstanding == 0
    e.forget(3)
    assert e.rooms() == 0
