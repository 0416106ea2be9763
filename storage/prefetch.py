"""Prefetch sized by memory (pure): a prefetch from L3 never takes host memory the L2 pool needs.

SGLang asks the storage backend how many pages of a prefix it holds, then allocates that many
host pages from its L2 pool for the prefetch. `PrefetchBudget.grant` turns "the store has `hits`
pages" into "prefetch `granted` pages": at most what the pool has free beyond a reserve kept for
L2 (a fraction of the pool: pages written back from the GPU land there), never more than found.
A shrink is reported, in the `Grant` and in the running `PrefetchMetrics`, never silent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

__all__ = ["Grant", "GrantVerdict", "PrefetchBudget", "PrefetchMetrics"]


class GrantVerdict(Enum):
    FULL = "full"          # every page found is prefetched
    SHRUNK = "shrunk"      # fewer: the L2 pool's free memory beyond its reserve is the limit
    NONE = "none"          # nothing free beyond the reserve: no prefetch


@dataclass(frozen=True)
class Grant:
    requested: int
    granted: int
    verdict: GrantVerdict
    free_tokens: int
    reserve_tokens: int


@dataclass
class PrefetchMetrics:
    """Running totals, exported by the backend's get_stats()."""

    requests: int = 0
    pages_requested: int = 0
    pages_granted: int = 0
    shrunk: int = 0
    refused: int = 0
    last: Grant | None = field(default=None)

    def add(self, g: Grant) -> None:
        self.requests += 1
        self.pages_requested += g.requested
        self.pages_granted += g.granted
        self.shrunk += g.verdict is GrantVerdict.SHRUNK
        self.refused += g.verdict is GrantVerdict.NONE and g.requested > 0
        self.last = g

    def as_dict(self) -> dict:
        return {"prefetch_requests": self.requests, "prefetch_pages_requested": self.pages_requested,
                "prefetch_pages_granted": self.pages_granted, "prefetch_shrunk": self.shrunk,
                "prefetch_refused": self.refused}


@dataclass(frozen=True)
class PrefetchBudget:
    """`reserve_fraction` of the L2 pool (`pool_tokens`) stays free for L2; pages of `page_size`."""

    pool_tokens: int
    page_size: int
    reserve_fraction: float = 0.25

    def __post_init__(self) -> None:
        if self.page_size <= 0 or self.pool_tokens < 0:
            raise ValueError(f"page_size {self.page_size} and pool_tokens {self.pool_tokens} must be positive")
        if not 0.0 <= self.reserve_fraction < 1.0:
            raise ValueError(f"reserve_fraction must be in [0, 1), got {self.reserve_fraction}")

    @property
    def reserve_tokens(self) -> int:
        return int(self.pool_tokens * self.reserve_fraction)

    def grant(self, hits: int, free_tokens: int) -> Grant:
        """How many of `hits` pages to prefetch when the pool has `free_tokens` free now."""
        if hits < 0 or free_tokens < 0:
            raise ValueError(f"hits {hits} and free_tokens {free_tokens} must be >= 0")
        spare_pages = max(0, free_tokens - self.reserve_tokens) // self.page_size
        granted = min(hits, spare_pages)
        verdict = GrantVerdict.FULL if granted == hits else GrantVerdict.NONE if granted == 0 else GrantVerdict.SHRUNK
        return Grant(hits, granted, verdict, free_tokens, self.reserve_tokens)
