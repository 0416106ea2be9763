import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstage.transfer.protocol.decode.tracker import Outcome, RoomTracker


def staged_room():
    t = RoomTracker(10, {0: 100, 1: 100})
    p0 = t.expect_piece(0, 0, 0, 6, ring_start=0, writers=[0, 1])
    p1 = t.expect_piece(0, 1, 6, 4, ring_start=1200, writers=[0, 1])
    return t, p0, p1


def test_staged_any_order_and_completion():
    for order in itertools.permutations([(0, 0), (0, 1), (1, 0), (1, 1)]):
        t, p0, p1 = staged_room()
        landed = []
        for writer, idx in order:
            p = (p0, p1)[idx]
            a = t.arrive_staged(writer, 0, idx, p.page_start, p.num_pages, p.num_pages * 100, p.ring_start)
            assert a.outcome in (Outcome.ACCEPTED, Outcome.PIECE_LANDED)
            if a.outcome is Outcome.PIECE_LANDED:
                landed.append(a.piece)
        assert {p.index for p in landed} == {0, 1}
        assert not t.complete
        for p in landed:
            t.mark_scattered(p)
        assert t.complete and t.pages_done == 10


def test_staged_duplicates_and_mismatches():
    t, p0, _ = staged_room()
    ok = (0, 0, 0, 0, 6, 600, 0)
    assert t.arrive_staged(*ok).outcome is Outcome.ACCEPTED
    assert t.arrive_staged(*ok).outcome is Outcome.DUPLICATE
    bad = [
        ((0, 0, 0, 0, 5, 600, 0), "does not match"),
        ((0, 0, 0, 0, 6, 601, 0), "does not match"),
        ((0, 0, 0, 0, 6, 600, 64), "does not match"),
        ((2, 0, 0, 0, 6, 600, 0), "not a writer"),
        ((0, 3, 0, 0, 6, 600, 0), "no allocation"),
    ]
    for args, why in bad:
        a = t.arrive_staged(*args)
        assert a.outcome is Outcome.REJECTED and why in a.reason
    with pytest.raises(ValueError):
        t.mark_scattered(p0)  # writer 1 has not landed


def test_staged_planning_errors():
    t, _, _ = staged_room()
    with pytest.raises(ValueError, match="already planned"):
        t.expect_piece(1, 0, 5, 2, 0, [0, 1])
    t2 = RoomTracker(4, {0: 10})
    with pytest.raises(ValueError, match="outside"):
        t2.expect_piece(0, 0, 2, 3, 0, [0])
    with pytest.raises(ValueError, match="writers"):
        t2.expect_piece(0, 0, 0, 1, 0, [5])


def test_direct_coverage_duplicates_and_rejections():
    t = RoomTracker(8, {0: 10, 3: 20})
    assert t.arrive_direct(0, 0, 0, 8, 80).outcome is Outcome.ACCEPTED
    assert t.arrive_direct(0, 0, 0, 8, 80).outcome is Outcome.DUPLICATE
    assert not t.complete
    assert t.arrive_direct(3, 0, 0, 4, 79).outcome is Outcome.REJECTED
    assert t.arrive_direct(3, 0, 6, 4, 80).outcome is Outcome.REJECTED
    assert t.arrive_direct(9, 0, 0, 1, 20).outcome is Outcome.REJECTED
    assert t.arrive_direct(3, 0, 0, 4, 80).outcome is Outcome.ACCEPTED
    assert t.arrive_direct(3, 1, 2, 2, 40).outcome is Outcome.REJECTED  # overlap, not duplicate
    assert t.arrive_direct(3, 1, 4, 4, 80).outcome is Outcome.ACCEPTED
    assert t.complete


def chunking(n, rnd):
    cuts = sorted(rnd.sample(range(1, n), rnd.randint(0, min(n - 1, 6)))) if n > 1 else []
    bounds = [0] + cuts + [n]
    return [(a, b - a) for a, b in zip(bounds, bounds[1:])]


@given(st.integers(1, 60), st.integers(1, 4), st.randoms(use_true_random=False))
@settings(max_examples=200, deadline=None)
def test_direct_complete_exactly_when_all_landed(n, writers, rnd):
    t = RoomTracker(n, {w: 7 for w in range(writers)})
    events = [(w, c, s, k) for w in range(writers) for c, (s, k) in enumerate(chunking(n, rnd))]
    events += rnd.sample(events, min(3, len(events)))  # duplicates
    rnd.shuffle(events)
    seen = set()
    for e in events:
        assert not t.complete or e in seen
        out = t.arrive_direct(e[0], e[1], e[2], e[3], e[3] * 7).outcome
        assert out is (Outcome.DUPLICATE if e in seen else Outcome.ACCEPTED)
        seen.add(e)
    assert t.complete


def test_pp_writers_cover_only_their_stage_layers():
    """Writers 0 and 1 are two PP stages (layers [0, 2) and [2, 4)) of the same heads: each
    must cover its own layers of every page, never the other's, and the room is complete only
    when both did."""
    t = RoomTracker(2, {0: 400, 1: 400}, num_layers=4, writer_layers={0: range(0, 2), 1: range(2, 4)})
    assert t.writers_of(range(0, 2)) == [0] and t.writers_of(range(2, 3)) == [1] and t.writers_of(range(1, 3)) == []
    bad = t.arrive_direct(0, 0, 0, 2, 200, layers=range(2, 4))
    assert bad.outcome is Outcome.REJECTED and "its PP stage holds [0, 2)" in bad.reason
    assert t.arrive_direct(0, 0, 0, 2, 400, layers=range(0, 2)).outcome is Outcome.ACCEPTED
    assert not t.complete and t.pages_done == 0
    assert t.arrive_direct(1, 0, 0, 1, 200, layers=range(2, 4)).outcome is Outcome.ACCEPTED
    assert not t.complete and t.pages_done == 1
    assert t.arrive_direct(1, 1, 1, 1, 200, layers=range(2, 4)).outcome is Outcome.ACCEPTED
    assert t.complete and t.pages_done == 2
