"""Decode side, staged path: how a chunk its writers ask ring space for becomes pieces, each in
a ring region of its own. A piece holds as many pages as every writer's part lets fit its
staging buffer and the cap (in the layers the chunk carries), no more than the ring has free
now; the last piece of the request also holds each writer's state pool block, and is split
further when pages and blocks together would not fit. Pure: the tracker says the bytes, the
ring allocator hands out the regions."""

from __future__ import annotations

from dataclasses import dataclass

from ..pieces import plan_pieces
from ..ring import Region, RingAllocator, TooLarge
from .plan import RoomPlan
from .tracker import RoomTracker


@dataclass(frozen=True)
class PlannedPiece:
    page_start: int
    num_pages: int
    region: Region


@dataclass(frozen=True)
class PiecesRefused:
    """Not even one page fits beside the pool blocks: the room fails (a staging failure)."""

    reason: str


def chunk_pieces(tracker: RoomTracker, plan: RoomPlan, ring: RingAllocator, *, page_start: int, num_pages: int,
                 layers: range) -> list[PlannedPiece] | PiecesRefused:
    """The pieces of the chunk of `num_pages` pages from `page_start` in `layers`, their ring
    regions allocated, in page order."""
    writers = tracker.writers_of(layers)   # PP: the ranks of the stage holding these layers
    part_bytes = [tracker.bytes_of(w, 1, layers) for w in writers]
    page_bytes = sum(part_bytes)
    planned = plan_pieces(page_start, num_pages, plan.piece_pages(part_bytes), ring.pages_fit_now(page_bytes))
    # PP: the stage's writers end their layers here alike: the last page of their last layer
    # carries their pools (of their layers; with this rank's last layer, of no layer too)
    final = tracker.final(page_start, num_pages, layers, writer=writers[0])
    extra = sum(tracker.final_extra.get(w, 0) for w in writers) if final else 0
    if extra:  # the last piece also holds every writer's pool block: it may need fewer pages
        planned = fit_pools(tracker, plan, planned, layers, writers)
        if not planned:
            return PiecesRefused(f"the state pool items of this request ({extra} bytes with one page) do not fit the "
                                 f"staging ring ({plan.ring_size} bytes) or a prefill worker buffer "
                                 f"({plan.buffer_bytes} bytes)")
    out = []
    for start, count in planned:
        last = tracker.final(start, count, layers, writer=writers[0])
        region = ring.allocate(count * page_bytes + (extra if last else 0))
        if isinstance(region, TooLarge):  # piece_pages makes this impossible
            raise AssertionError(str(region))
        out.append(PlannedPiece(start, count, region))
    return out


def fit_pools(tracker: RoomTracker, plan: RoomPlan, planned: list[tuple[int, int]], layers: range,
               writers: list[int]) -> list[tuple[int, int]]:
    """Split the last piece so its pages and every writer's pool block fit the ring and each
    writer's part its buffer; [] when not even one page does."""
    start, count = planned[-1]
    extra = {w: tracker.final_extra.get(w, 0) for w in writers}
    wpb = {w: tracker.bytes_of(w, 1, layers) for w in writers}
    total = sum(wpb.values())
    fits = [n for n in range(count, 0, -1)
            if n * total + sum(extra.values()) <= plan.ring_size
            and all(n * wpb[w] + extra.get(w, 0) <= plan.buffer_bytes for w in wpb)]
    if not fits:
        return []
    n = fits[0]
    return planned[:-1] + ([(start, count - n)] if n < count else []) + [(start + count - n, n)]
