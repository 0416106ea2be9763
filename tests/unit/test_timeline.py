"""Request timelines: the pure Timeline and its recorder, and the handles' stamps (init before
the event reaches the control thread, nothing after the end)."""

from __future__ import annotations

import pytest

from kvstage.transfer.engine.handles import KVReceiver, KVSender, RoomStatus
from kvstage.transfer.poll import KVPoll
from kvstage.transfer.protocol.actions import RoomTotals
from kvstage.transfer.timeline import PHASES, Timeline, TimelineRecorder


def test_segments_follow_time_order_and_skip_phases_that_did_not_happen():
    t = Timeline(created=10.0, metadata=10.5, init=10.2, first_write=11.0, last_write=11.5, ended=12.0)
    assert [n for n, _ in t.stamps()] == ["created", "init", "metadata", "first_write", "last_write", "ended"]
    assert t.segments() == [("created", 0.0), ("init", pytest.approx(0.2)), ("metadata", pytest.approx(0.3)),
                            ("first_write", pytest.approx(0.5)), ("last_write", pytest.approx(0.5)),
                            ("ended", pytest.approx(0.5))]
    assert sum(s for _, s in t.segments()) == pytest.approx(t.between("created", "ended"))
    assert t.between("init", "scattered") is None


def test_equal_stamps_keep_the_phase_order():
    t = Timeline(created=1.0, init=1.0, metadata=1.0)
    assert [n for n, _ in t.stamps()] == ["created", "metadata", "init"]
    assert Timeline().segments() == []


def test_recorder_keeps_first_stamps_and_last_writes_and_freezes_at_the_end():
    r = TimelineRecorder(created=1.0)
    r.stamp("first_write", 2.0)
    r.stamp("first_write", 3.0)        # the first write stays the first
    r.stamp("last_write", 2.0)
    r.stamp("last_write", 3.0)         # every write moves the last one
    r.stamp("created", 0.0)            # never moved
    r.stamp("ended", 4.0)
    r.stamp("last_write", 5.0)         # a write completing after the end is not part of the request
    r.stamp("scattered", 5.0)
    assert r.timeline() == Timeline(created=1.0, first_write=2.0, last_write=3.0, ended=4.0)
    with pytest.raises(ValueError, match="unknown phase"):
        r.stamp("landed", 1.0)
    assert set(PHASES) == set(Timeline.__dataclass_fields__)


@pytest.mark.parametrize("side", ["sender", "sender_late", "receiver"])
def test_init_is_stamped_before_the_control_thread_can_see_the_request(side):
    status = RoomStatus()
    seen = []

    def post(ev):   # what the control thread would find at the moment it gets the event
        seen.append(status.timeline.get("init"))

    if side == "sender":
        h = KVSender(post, 100, 7, 4, status)
        post(None)                                    # the manager posts NewSender after the handle exists
    elif side == "sender_late":
        h = KVSender(post, 100, 7, None, status)
        assert status.timeline.get("init") is None    # no page count yet: not inited
        h.init(4)
    else:
        h = KVReceiver(post, 100, 7, "p", status)
        h.init([1, 2])
    assert seen and all(t is not None for t in seen), seen
    status.update(KVPoll.Success, None, None, False, RoomTotals(64, 1, "direct"))
    t = h.metrics().timeline
    assert t.created <= t.init <= t.ended
    assert h.metrics().seconds == pytest.approx(t.ended - t.init)


def test_a_refused_init_stamps_nothing():
    status = RoomStatus()
    h = KVReceiver(lambda ev: None, 100, 7, "p", status)
    with pytest.raises(ValueError):
        h.init([500])                                 # outside the cache
    assert status.timeline.get("init") is None
