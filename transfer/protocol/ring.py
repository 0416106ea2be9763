"""The decode staging ring: allocation in sequence, out-of-order frees, and the watermark.

Pure logic, no memory. Positions are linear byte counts that only grow: a region at linear
position `start` sits at physical offset `start % size` in round `start // size`. The allocator
hands out regions in increasing linear order, ahead of free space if need be; a region never
straddles the end of the ring (the tail of a round is skipped instead).

The watermark (round, tail) is the position of the oldest live region, or the allocation head
when nothing is live. It never moves backwards within an epoch (one decode incarnation).

A writer may write region R once ``R.end <= watermark + size`` (`region_is_free`): every live
region then lies in [watermark, R.start) and all of it together with R spans at most one ring,
so no two of them share a byte. When the ring empties, the next allocation starts at offset 0
of a fresh round (a clean restart, no fragmentation).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import NamedTuple


class Watermark(NamedTuple):
    round: int
    tail: int

    def linear(self, size: int) -> int:
        return self.round * size + self.tail


@dataclass(frozen=True, slots=True)
class Region:
    start: int   # linear position
    nbytes: int
    size: int    # ring size, to derive the physical place

    @property
    def end(self) -> int:
        return self.start + self.nbytes

    @property
    def round(self) -> int:
        return self.start // self.size

    @property
    def offset(self) -> int:
        """Physical byte offset inside the ring."""
        return self.start % self.size


class TooLarge(NamedTuple):
    """Allocation result for a region that can never fit the ring."""

    nbytes: int
    size: int

    def __str__(self) -> str:
        return f"{self.nbytes} bytes can never fit a {self.size}-byte staging ring"


def region_is_free(start: int, nbytes: int, watermark: Watermark, size: int) -> bool:
    """The writer's predicate: may bytes [start, start + nbytes) be written now?"""
    return start + nbytes <= watermark.linear(size) + size


def align_up(n: int, align: int) -> int:
    return -(-n // align) * align


class RingAllocator:
    """Allocates page-granular regions of one decode ring and computes its watermark."""

    def __init__(self, size: int, align: int = 256):
        if size <= 0:
            raise ValueError(f"ring size must be positive, got {size}")
        if align <= 0 or size % align:
            raise ValueError(f"ring size {size} must be a positive multiple of align={align}")
        self.size = size
        self.align = align
        self._head = 0                      # next linear position to allocate from
        self._order: deque[int] = deque()   # starts of not-yet-trimmed regions, allocation order
        self._live: dict[int, Region] = {}  # start -> region
        self._watermark = Watermark(0, 0)
        self.high_water = 0                 # most bytes between watermark and head (backlog included)

    # -- queries --------------------------------------------------------------------------
    @property
    def watermark(self) -> Watermark:
        return self._watermark

    @property
    def live_regions(self) -> int:
        return len(self._live)

    @property
    def live_bytes(self) -> int:
        """Bytes between the watermark and the head: what is not reusable yet, including
        regions reserved ahead of free space (so it can exceed the ring's size)."""
        return self._head - self._watermark.linear(self.size) if self._live else 0

    @property
    def held_bytes(self) -> int:
        """Bytes of the regions not freed yet, without the freed ones between them and the
        watermark (`live_bytes` counts those too: a region freed behind one still held is not
        reusable yet, but nobody holds it)."""
        return sum(r.nbytes for r in self._live.values())

    @property
    def occupied_bytes(self) -> int:
        """How much of the ring itself is held by live regions (at most its size)."""
        return min(self.live_bytes, self.size)

    def holds(self, start: int) -> bool:
        """Whether a region starting at linear position `start` is allocated (not freed yet)."""
        return start in self._live

    def is_free(self, region: Region) -> bool:
        return region_is_free(region.start, region.nbytes, self._watermark, self.size)

    def _placement(self, nbytes: int) -> int:
        """Where a region of `nbytes` would start: here, or at the next round if it would wrap."""
        off = self._head % self.size
        if off + nbytes > self.size:
            return self._head - off + self.size
        return self._head

    def pages_fit_now(self, page_bytes: int) -> int:
        """How many whole pages of `page_bytes` one region could hold and be writable at once."""
        if page_bytes <= 0:
            raise ValueError("page_bytes must be positive")
        limit = self._watermark.linear(self.size) + self.size  # a free region must end by here
        off = self._head % self.size
        here = min(limit - self._head, self.size - off)           # without wrapping
        wrapped = min(limit - (self._head - off + self.size), self.size)  # at the next round
        best = max(here, wrapped, 0)
        pages = best // page_bytes
        # the aligned size must still fit where it would be placed
        while pages and not self._fits_now(pages * page_bytes):
            pages -= 1
        return pages

    def fits_now(self, nbytes: int) -> bool:
        """Whether a region of `nbytes` allocated now would be free at once (written without
        waiting for the watermark)."""
        return self._fits_now(nbytes)

    def _fits_now(self, nbytes: int) -> bool:
        nbytes = align_up(nbytes, self.align)
        if nbytes > self.size:
            return False
        return region_is_free(self._placement(nbytes), nbytes, self._watermark, self.size)

    # -- decisions ------------------------------------------------------------------------
    def allocate(self, nbytes: int) -> Region | TooLarge:
        """Reserve the next region of `nbytes` (rounded up to `align`); it may not be free yet."""
        if nbytes <= 0:
            raise ValueError(f"cannot allocate {nbytes} bytes")
        rounded = align_up(nbytes, self.align)
        if rounded > self.size:
            return TooLarge(nbytes, self.size)
        start = self._placement(rounded)
        region = Region(start, rounded, self.size)
        # an empty ring always restarts at offset 0 (see free), so the watermark already
        # equals the head there and allocating never has to move it
        assert self._live or start == self._watermark.linear(self.size)
        self._head = start + rounded
        self._order.append(start)
        self._live[start] = region
        self.high_water = max(self.high_water, self.live_bytes)
        return region

    def free(self, region: Region) -> Watermark | None:
        """Release a region (any order). Returns the new watermark when it moved, else None."""
        if self._live.get(region.start) != region:
            raise KeyError(f"region at {region.start} (+{region.nbytes}) is not live")
        del self._live[region.start]
        while self._order and self._order[0] not in self._live:
            self._order.popleft()
        if self._order:
            new = self._order[0]
        else:
            # empty ring: restart cleanly at offset 0 of the next round
            off = self._head % self.size
            if off:
                self._head += self.size - off
            new = self._head
        wm = Watermark(new // self.size, new % self.size)
        if wm == self._watermark:
            return None
        assert wm.linear(self.size) > self._watermark.linear(self.size), "watermark moved backwards"
        self._watermark = wm
        return wm


class RemoteWatermark:
    """A writer's view of one decode ring's watermark: monotonic within the ring's epoch."""

    def __init__(self, epoch: int, size: int):
        self.epoch = epoch
        self.size = size
        self.current = Watermark(0, 0)

    def update(self, epoch: int, wm: Watermark) -> bool:
        """Apply a published watermark; returns True when it advanced. Stale ones are ignored."""
        if epoch != self.epoch:
            return False
        if wm.linear(self.size) <= self.current.linear(self.size):
            return False
        self.current = wm
        return True

    def allows(self, start: int, nbytes: int) -> bool:
        return region_is_free(start, nbytes, self.current, self.size)
