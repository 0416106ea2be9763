"""Who a decode rank tells that its ring's watermark moved (transfer/protocol/decode/watermark_fanout.py):
a writer hears the watermark before its grant, and a move only when it may unblock one of its
regions; the rest of the fleet hears nothing."""

from kvstage.transfer.protocol.decode.watermark_fanout import WatermarkFanout

SIZE = 1000


def test_a_writer_is_told_before_its_first_grant_and_not_again_for_the_same_position():
    f = WatermarkFanout()
    assert f.before_grant(7, 0)
    assert not f.before_grant(7, 0)
    assert f.before_grant(7, 300)        # the watermark moved since


def test_a_move_reaches_only_the_writers_whose_granted_regions_it_may_unblock():
    f = WatermarkFanout()
    for p in (1, 2, 3):
        f.before_grant(p, 0)
    # 1 holds a region ending past what it was told (blocked); 2's region was writable already;
    # 3 has nothing pending; 4 never asked, and its region lies past the start view (told nothing: tell it)
    pending = [(1, 1500), (2, 900), (4, 1200)]
    assert f.publish(pending, 600, SIZE) == [1, 4]
    assert f.publish(pending, 700, SIZE) == []       # 1 was told 600: its region is writable now
    assert f.publish([(1, 1800)], 800, SIZE) == [1]  # a new blocked region of 1
    f.forget(1)
    assert f.before_grant(1, 800)                    # a new connection starts from nothing told


def test_moves_that_unblock_none_of_a_writers_regions_are_not_sent_to_it():
    """A ring that stalled and then moves in small steps: the writer blocked far behind hears only
    the step that makes its region writable, one message rather than one per step."""
    f = WatermarkFanout()
    f.before_grant(1, 0)
    f.before_grant(2, 0)
    pending = [(1, 1300), (2, 1900)]       # writable from 300 and from 900
    told = [f.publish(pending, linear, SIZE) for linear in range(100, 1001, 100)]
    assert told == [[], [], [1], [], [], [], [], [], [2], []]
    assert f.publish(pending, 1000, SIZE) == []
