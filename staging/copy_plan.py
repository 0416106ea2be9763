"""What one gather or scatter copies, worked out once: the `CopyPlan` that the torch copies
(staging/gather_scatter.py) and the Triton kernel (staging/triton_kernels.py) both run from.

Gather and scatter are one copy in two directions between a rank's paged KV cache and a staging
region (layout: docs/staging_kernels.md, "The region layout")::

    region block b  <->  cache tensor b          (all K layers, then all V layers)
    region row j    <->  token j % page_size of cache page pages[j // page_size]
    region heads    <->  cache heads [h0, h1)

So the plan is the validated cache (`PreparedCache`, memoised by a `Planner`), the head range,
the page list (as consecutive runs or as an index tensor, validated and indexed once per room and
list: `plan_cache.PlanCache`) and the region; `Direction` says which side is read. Validation
lives here too, so both implementations raise the same errors.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import numpy as np
import torch

from .copy_units import Unit, unit_for
from .plan_cache import PageRun, PlanCache

__all__ = ["CheckedCache", "CopyPlan", "Direction", "PageRun", "Planner", "PlanCache", "PreparedCache", "check_heads",
           "check_int", "check_region", "region_nbytes"]

_data_ptr = torch.Tensor.data_ptr


class Direction(Enum):
    """Which way the bytes go."""

    GATHER = "gather"     # cache pages -> region
    SCATTER = "scatter"   # region -> cache pages (written, so the pages must be distinct)

    @property
    def region_name(self) -> str:
        """The region argument's name in the public calls (and in their error messages)."""
        return "out" if self is Direction.GATHER else "src"


def check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def region_nbytes(num_layers: int, has_v: bool, num_tokens: int, num_heads: int, head_dim: int,
                  elem_size: int) -> int:
    """Byte size of one writer's staging region: K (and V) x layers x tokens x heads x head_dim."""
    for name, val in (("num_layers", num_layers), ("num_tokens", num_tokens), ("num_heads", num_heads),
                      ("head_dim", head_dim), ("elem_size", elem_size)):
        check_int(name, val, 0)
    return (2 if has_v else 1) * num_layers * num_tokens * num_heads * head_dim * elem_size


@dataclass(frozen=True, kw_only=True)
class CheckedCache:
    """A validated KV cache: the per-layer tensors in region order (all K layers, then all V)."""

    tensors: tuple[torch.Tensor, ...]
    num_layers: int
    has_v: bool
    num_pages: int
    num_heads: int
    head_dim: int
    elem_size: int
    device: torch.device
    dtype: torch.dtype

    @property
    def row_bytes(self) -> int:
        return self.head_dim * self.elem_size


def _check_structure(k: Any, v: Any, page_size: Any, what: str) -> int:
    if isinstance(k, torch.Tensor) or not isinstance(k, Sequence) or len(k) == 0:
        raise ValueError(f"{what}: k must be a non-empty sequence of per-layer tensors")
    if v is not None:
        if isinstance(v, torch.Tensor) or not isinstance(v, Sequence):
            raise ValueError(f"{what}: v must be None (MLA) or a sequence of per-layer tensors")
        if len(v) != len(k):
            raise ValueError(f"{what}: v has {len(v)} layers but k has {len(k)}")
    return check_int("page_size", page_size, 1)


def _describe_cache(k: Sequence[Any], v: Sequence[Any] | None, page_size: int, what: str) -> CheckedCache:
    first = k[0]
    if not isinstance(first, torch.Tensor):
        raise ValueError(f"{what}: k[0] is a {type(first).__name__}, not a torch.Tensor")
    if first.dim() != 3:
        raise ValueError(f"{what}: k[0] must be [tokens, heads, head_dim], got shape {tuple(first.shape)}")
    tensors = list(k) + (list(v) if v is not None else [])
    for i, t in enumerate(tensors):
        name = f"k[{i}]" if i < len(k) else f"v[{i - len(k)}]"
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{what}: {name} is a {type(t).__name__}, not a torch.Tensor")
        if t.dtype != first.dtype:
            raise ValueError(f"{what}: dtype mismatch: {name} is {t.dtype}, k[0] is {first.dtype}")
        if t.device != first.device:
            raise ValueError(f"{what}: device mismatch: {name} is on {t.device}, k[0] on {first.device}")
        if t.shape != first.shape:
            raise ValueError(f"{what}: shape mismatch: {name} is {tuple(t.shape)}, k[0] is {tuple(first.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{what}: {name} must be contiguous")
    num_tokens, num_heads, head_dim = first.shape
    if num_tokens % page_size:
        raise ValueError(f"{what}: {num_tokens} tokens per layer is not a multiple of page_size={page_size}")
    return CheckedCache(tensors=tuple(tensors), num_layers=len(k), has_v=v is not None,
                        num_pages=num_tokens // page_size, num_heads=num_heads, head_dim=head_dim,
                        elem_size=first.element_size(), device=first.device, dtype=first.dtype)


def check_heads(heads: Any, num_heads: int, what: str) -> tuple[int, int]:
    try:
        h0, h1 = heads
    except (TypeError, ValueError):
        raise ValueError(f"{what}: heads must be a (start, stop) pair, got {heads!r}") from None
    h0 = check_int("heads[0]", h0, 0)
    h1 = check_int("heads[1]", h1, 0)
    if not h0 < h1 <= num_heads:
        raise ValueError(f"{what}: head range [{h0}, {h1}) is out of bounds for {num_heads} heads")
    return h0, h1


def check_region(region: object, device: torch.device, need: int, name: str, what: str) -> None:
    if not isinstance(region, torch.Tensor):
        raise ValueError(f"{what}: {name} must be a torch.Tensor, got {type(region).__name__}")
    if region.dtype != torch.uint8 or region.dim() != 1:
        raise ValueError(f"{what}: {name} must be a 1-D torch.uint8 tensor, got {region.dtype} "
                         f"of shape {tuple(region.shape)}")
    if not region.is_contiguous():
        raise ValueError(f"{what}: {name} must be contiguous")
    if region.device != device:
        raise ValueError(f"{what}: device mismatch: {name} is on {region.device}, the KV cache on {device}")
    if region.numel() < need:
        raise ValueError(f"{what}: {name} has {region.numel()} bytes, the region needs {need}")


class PreparedCache:
    """A validated cache and its views in `unit` words, memoised by a Planner.

    Holding the tensors keeps their ids unique while the entry exists, so (ids, data pointers)
    identify the same cache on the next call without re-validating it.
    """

    def __init__(self, cache: CheckedCache, page_size: int) -> None:
        self.cache = cache
        self.page_size = page_size
        self.ptrs = tuple(t.data_ptr() for t in cache.tensors)
        self.unit: Unit = unit_for(cache.row_bytes, cache.tensors)
        self.r = cache.row_bytes // self.unit.nbytes     # words per head row
        #: region bytes per token and head: K/V x layers x head row (region_nbytes without the checks)
        self.token_head_bytes = len(cache.tensors) * cache.row_bytes
        P, H, word = cache.num_pages, cache.num_heads, self.unit.dtype
        #: per tensor: [num_pages, page_size, heads, r]
        self.pages = [t.view(torch.uint8).view(word).view(P, page_size, H, self.r) for t in cache.tensors]
        #: per tensor: [num_pages, page_size * heads * r] (whole-page rows)
        self.rows = [pv.view(P, -1) for pv in self.pages]
        self._sliced: dict[tuple[int, int], list[torch.Tensor]] = {}
        #: data an implementation derives from this cache (the Triton address table), kept and
        #: dropped with this entry
        self.extras: dict[Hashable, object] = {}

    def valid(self) -> bool:
        """Every tensor still at the address it was validated at (map: no Python frame per tensor)."""
        return tuple(map(_data_ptr, self.cache.tensors)) == self.ptrs

    def sliced(self, h0: int, h1: int) -> list[torch.Tensor]:
        views = self._sliced.get((h0, h1))
        if views is None:
            views = self._sliced[(h0, h1)] = [pv[:, :, h0:h1] for pv in self.pages]
        return views


@dataclass(frozen=True, kw_only=True, slots=True)
class CopyPlan:
    """One validated gather or scatter: region block b <-> cache tensor b, region page position
    j <-> cache page `pages[j]`, region heads <-> cache heads [h0, h1). `pages` is the page list
    either as runs of consecutive pages (few runs: slice copies; () for an empty list) or as an
    index tensor (int64, on the cache's device)."""

    direction: Direction
    prep: PreparedCache
    h0: int
    h1: int
    n: int                                   # pages in the list
    pages: tuple[PageRun, ...] | torch.Tensor
    region: torch.Tensor                     # the uint8 region, validated; its first `nbytes` are copied
    nbytes: int

    @property
    def gather(self) -> bool:
        return self.direction is Direction.GATHER

    @property
    def whole(self) -> bool:
        """Every head of the cache: a page is one contiguous row."""
        return self.h1 - self.h0 == self.prep.cache.num_heads

    @property
    def blocks(self) -> int:
        return len(self.prep.cache.tensors)

    @property
    def block_bytes(self) -> int:
        return self.nbytes // self.blocks

    @property
    def rows(self) -> int:
        """Region rows (tokens) per block."""
        return self.n * self.prep.page_size


_MEMO_ENTRIES = 4


class Planner:
    """Makes CopyPlans; remembers the last few caches it validated (`forget()` drops them) and,
    in its `PlanCache`, the page lists of each room (`forget_room(room)` drops a room's).

    The base of every gatherer and scatterer. NOT thread-safe: one per thread (several may share
    one PlanCache: `plans=`).
    """

    def __init__(self, plans: PlanCache | None = None, *, caches_fixed: bool = False) -> None:
        """`caches_fixed`: the caller's cache tensors never move (the engine's caches, registered
        with the backend at start, as every transfer worker's): a call with the same k/v tuples
        as the last one then skips the address check of every tensor. A new tuple is validated
        either way."""
        self._fixed = caches_fixed
        self._memo: dict[tuple[object, ...], PreparedCache] = {}
        self._own_plans = plans is None
        self.plans = PlanCache() if plans is None else plans
        # the last call's (k, v, page_size) when k (and v) are tuples: the same tuple objects hold
        # the same tensors, so the next call with them skips building and hashing the memo key
        self._last: tuple[Any, Any, int, PreparedCache] | None = None

    def _prepare(self, k: Any, v: Any, page_size: Any, what: str) -> PreparedCache:
        last = self._last
        if (last is not None and k is last[0] and v is last[1] and type(page_size) is int
                and page_size == last[2] and (self._fixed or last[3].valid())):
            return last[3]
        page_size = _check_structure(k, v, page_size, what)
        key = (page_size, len(k), v is not None, *map(id, k), *(map(id, v) if v is not None else ()))
        prep = self._memo.get(key)
        if prep is None or not prep.valid():
            prep = PreparedCache(_describe_cache(k, v, page_size, what), page_size)
            if len(self._memo) >= _MEMO_ENTRIES:
                self._memo.clear()
            self._memo[key] = prep
        immutable = type(k) is tuple and (v is None or type(v) is tuple)
        self._last = (k, v, page_size, prep) if immutable else None
        return prep

    def _max_runs(self, direction: Direction, prep: PreparedCache, whole: bool) -> int:
        """How many runs of consecutive pages may replace the page index (0: never)."""
        return 0

    def plan(self, direction: Direction, k: Any, v: Any, pages: Any, page_size: Any, heads: Any,
             region: Any, room: Hashable | None = None) -> CopyPlan:
        """Validate one call (ValueError/TypeError naming what is wrong) and work out its copy.

        The page list is validated, indexed and (for a cache on a device) uploaded once per room
        and list value (`PlanCache`); `room` None is one more room (calls that name none)."""
        what = direction.value
        prep = self._prepare(k, v, page_size, what)
        cache = prep.cache
        h0, h1 = check_heads(heads, cache.num_heads, what)
        index = self.plans.pages(room, pages, cache.num_pages, what, unique=direction is Direction.SCATTER)
        n = index.n
        plan_pages: tuple[PageRun, ...] | torch.Tensor = ()
        if n:
            runs = index.runs(self._max_runs(direction, prep, h1 - h0 == cache.num_heads))
            plan_pages = runs if runs is not None else index.index(cache.device)
        nbytes = prep.token_head_bytes * n * prep.page_size * (h1 - h0)
        check_region(region, cache.device, nbytes, direction.region_name, what)
        return CopyPlan(direction=direction, prep=prep, h0=h0, h1=h1, n=n, pages=plan_pages, region=region,
                        nbytes=nbytes)

    def prepare(self, direction: Direction, k: Any, v: Any, pages: Any, page_size: Any, *, room: Hashable) -> bool:
        """Validate and index `pages` for `room` now (on a GPU: upload them), as the first call in
        `direction` on a piece of them would, so that call finds them kept (`PlanCache.prepare`).
        True when they were kept; False when a piece of them would be validated on its own (not
        a slice of a plain integer array, or a list that does not validate: that call says why)."""
        prep = self._prepare(k, v, page_size, direction.value)
        return self.plans.prepare(room, pages, prep.cache.num_pages, direction.value, prep.cache.device,
                                  unique=direction is Direction.SCATTER)

    def forget_room(self, room: Hashable) -> None:
        """Drop the page lists kept for `room` (it was released)."""
        self.plans.forget(room)

    def forget(self) -> None:
        """Drop the references this object holds to KV caches (and its own page lists)."""
        self._memo.clear()
        self._last = None
        if self._own_plans:
            self.plans.clear()
