"""Ring allocator and watermark: worked examples and hypothesis state machines."""

import copy

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstage.transfer.protocol.ring import Region, RemoteWatermark, RingAllocator, TooLarge, Watermark, region_is_free


def overlap(a: Region, b: Region) -> bool:
    return a.offset < b.offset + b.nbytes and b.offset < a.offset + a.nbytes


def test_worked_example_wrap_and_watermark():
    r = RingAllocator(1000, align=100)
    a, b, c = r.allocate(400), r.allocate(400), r.allocate(300)
    assert (a.offset, b.offset) == (0, 400)
    assert (c.round, c.offset) == (1, 0)       # 300 does not fit the last 200: next round
    assert r.is_free(a) and r.is_free(b) and not r.is_free(c)
    assert r.free(b) is None                   # out of order: a is still the oldest
    assert r.watermark == Watermark(0, 0)
    assert r.free(a) == Watermark(1, 0)        # c is now the oldest live region
    assert r.is_free(c)
    assert r.free(c) == Watermark(2, 0)        # empty: clean restart at offset 0 of a new round
    d = r.allocate(1000)
    assert (d.round, d.offset) == (2, 0) and r.is_free(d)


def test_held_bytes_leave_out_regions_freed_behind_a_held_one():
    """live_bytes runs from the watermark to the head: a region freed behind one still held
    (a credit whose return is on its way) counts there, but nobody holds it."""
    r = RingAllocator(1000, align=100)
    a, b = r.allocate(300), r.allocate(200)
    assert (r.live_bytes, r.held_bytes) == (500, 500)
    r.free(b)
    assert (r.live_bytes, r.held_bytes) == (500, 300)
    r.free(a)
    assert (r.live_bytes, r.held_bytes) == (0, 0)


def test_too_large_and_bad_sizes():
    r = RingAllocator(1024, align=256)
    assert isinstance(r.allocate(1025), TooLarge)
    assert "can never fit" in str(r.allocate(5000))
    with pytest.raises(ValueError, match="cannot allocate 0 bytes"):
        r.allocate(0)
    with pytest.raises(ValueError, match="positive multiple of align=256"):
        RingAllocator(1000, align=256)
    with pytest.raises(KeyError, match="is not live"):
        r.free(Region(0, 256, 1024))


def test_alignment_rounds_regions():
    r = RingAllocator(4096, align=256)
    a = r.allocate(1)
    assert a.nbytes == 256 and r.allocate(10).offset == 256


def test_pages_fit_now_examples():
    r = RingAllocator(1000, align=1)
    assert r.pages_fit_now(100) == 10
    a = r.allocate(700)
    assert r.pages_fit_now(100) == 3
    r.allocate(300)
    assert r.pages_fit_now(100) == 0
    r.free(a)
    assert r.pages_fit_now(100) == 7          # next round, up to the live region at 700


def test_remote_watermark_is_monotonic_and_epoch_bound():
    rw = RemoteWatermark(epoch=7, size=1000)
    assert rw.update(7, Watermark(0, 500))
    assert not rw.update(7, Watermark(0, 400))   # backwards: ignored
    assert not rw.update(8, Watermark(5, 0))     # other epoch: ignored
    assert rw.allows(900, 600) and not rw.allows(900, 601)
    assert region_is_free(0, 1000, Watermark(0, 0), 1000)


class RingMachine(RuleBasedStateMachine):
    """Random allocate / free / write sequences; writers only write free regions."""

    def __init__(self):
        super().__init__()
        self.size = 4096
        self.ring = RingAllocator(self.size, align=64)
        self.live: list[Region] = []
        self.written: list[Region] = []  # live regions a writer has written into
        self.last_wm = 0

    @rule(n=st.integers(1, 5000))
    def allocate(self, n):
        res = self.ring.allocate(n)
        if n > self.size:
            assert isinstance(res, TooLarge)
            return
        assert isinstance(res, Region)
        assert res.offset + res.nbytes <= self.size, "regions never straddle the ring's end"
        assert res.nbytes >= n and res.nbytes % 64 == 0
        if self.live:
            assert res.start >= self.live[-1].end
        self.live.append(res)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 10**6))
    def write(self, i):
        region = self.live[i % len(self.live)]
        if self.ring.is_free(region) and region not in self.written:
            for other in self.written:
                assert not overlap(region, other), "a free region overlaps one being written"
            self.written.append(region)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 10**6))
    def free(self, i):
        region = self.live.pop(i % len(self.live))
        if region in self.written:
            self.written.remove(region)
        self.ring.free(region)

    @rule(pb=st.integers(1, 3000))
    def fit_now_is_exact(self, pb):
        k = self.ring.pages_fit_now(pb)
        if k:
            probe = copy.deepcopy(self.ring)
            assert probe.is_free(probe.allocate(k * pb))
        probe = copy.deepcopy(self.ring)
        res = probe.allocate((k + 1) * pb)
        assert isinstance(res, TooLarge) or not probe.is_free(res)

    @invariant()
    def watermark_monotonic_and_oldest(self):
        wm = self.ring.watermark.linear(self.size)
        assert wm >= self.last_wm
        self.last_wm = wm
        if self.live:
            assert wm == min(r.start for r in self.live)
            assert self.ring.is_free(min(self.live, key=lambda r: r.start)), "the oldest live region is always writable"

    @invariant()
    def free_regions_pairwise_disjoint(self):
        free = [r for r in self.live if self.ring.is_free(r)]
        for i, a in enumerate(free):
            for b in free[i + 1:]:
                assert not overlap(a, b)

    @invariant()
    def empty_ring_is_fully_reusable(self):
        if not self.live:
            assert self.ring.pages_fit_now(self.size) == 1
            assert self.ring.watermark.tail == 0 or self.ring.watermark == Watermark(0, 0)


TestRingMachine = RingMachine.TestCase
TestRingMachine.settings = settings(max_examples=300, stateful_step_count=60, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow])


@given(st.lists(st.integers(1, 1000), min_size=1, max_size=50), st.randoms())
@settings(max_examples=200, deadline=None)
def test_fully_freed_ring_is_reusable(sizes, rnd):
    r = RingAllocator(1024, align=8)
    regions = [x for x in (r.allocate(n) for n in sizes) if isinstance(x, Region)]
    rnd.shuffle(regions)
    for reg in regions:
        r.free(reg)
    assert r.live_regions == 0 and r.live_bytes == 0
    full = r.allocate(1024)
    assert full.offset == 0 and r.is_free(full)
