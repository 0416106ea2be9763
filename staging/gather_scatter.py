"""Gather KV pages into a staging region, and scatter a region back into KV pages (torch).

The contract (see docs/staging_kernels.md)
------------------------------------------
A rank's KV cache is, per layer, one contiguous tensor of shape
``[num_pages * page_size, local_heads, head_dim]`` (token-major, "NHD"), of any dtype. K and V are
two lists of per-layer tensors; MLA caches have only K (``v is None``). A request's pages are a
list of page indices in request order.

A staging region written by ONE writer, for ``n`` pages and the head range ``[h0, h1)``, is::

    [K/V (K first; only K when v is None)][layer][token][head][head_dim]

where the tokens are the ``n * page_size`` tokens of the pages in list order and the heads are
the ``h1 - h0`` heads of the range; its size is `region_nbytes(...)`.

How (figures: examples/bench_gather.py, docs/staging_kernels.md)
-----------------------------------------------------------------
Both directions run the same `copy_plan.CopyPlan` (validated cache, head range, page list,
region) through one loop: gather reads the cache and writes the region, scatter the reverse.

Everything works on byte views of the caches, so every dtype (fp8 included) moves bit-exactly.
The bytes of one head row (``head_dim * elem_size``) are reinterpreted as the widest integer unit
that divides them and that every tensor involved is aligned to (int64 in practice;
`copy_units.unit_for`): torch's
index kernels move one element at a time, and 8-byte elements make ``index_copy_`` 2-7x and
whole-page ``index_select`` up to 1.7x faster than byte elements.

- gather, whole head set: ``index_select`` of whole pages straight into the region;
- gather, a head slice: ``index_select`` on the head-sliced page view straight into the region.
  It measured 1.2-5x faster than "whole pages into a temp, then copy the head slice out" with
  torch 2.13 here (the 1.5 GB/s once measured for the direct form is not reproduced,
  docs/staging_kernels.md), so no temp;
- scatter: ``index_copy_`` into the (head-sliced) page view of the destination cache. It writes
  exactly the bytes of the destination head range and nothing else, so several writers may
  scatter DIFFERENT head ranges of the SAME pages concurrently (the decode side does, with P > D).
  A read-modify-write of whole pages through a temp would race with them (and measured 1.4-6x
  slower); it is not used;
- consecutive pages: a scatter of at most two runs of consecutive pages uses plain slice copies
  instead of ``index_copy_`` (1.1-1.9x faster); so does a gather of ONE run where that measured
  faster (whole pages under 8 KiB; head slices of multi-token pages). With more runs the
  per-copy overhead loses. The slices of all blocks move in ONE torch call (``cat`` into the
  region, ``_foreach_copy_`` from it), not one per block: each call lets go of Python's lock and
  may wait to take it back;
- a region not aligned to the unit is staged through a reusable aligned temp, one (K/V, layer)
  block at a time, so misalignment costs one extra memcpy, not the slow byte-wide kernels.

On CUDA the copies are enqueued on the current stream and return before they finish:
synchronize the stream before handing the region to a transfer backend (or before reading a
scattered cache from another stream).

`Gatherer` and `Scatterer` own their reusable temp buffer and are NOT thread-safe by design: give
each transfer worker thread its own instance. Different instances may run concurrently; torch
releases the GIL during the copies.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Protocol

import torch

from .copy_plan import CopyPlan, Direction, PlanCache, Planner, PreparedCache, region_nbytes
from .copy_units import alignment
from .page_lists import PageList

__all__ = ["Gatherer", "GathersKV", "Scatterer", "ScattersKV", "PlanCache", "region_nbytes"]


class GathersKV(Protocol):
    """What gathers a cache's pages into a region: `Gatherer`, or the Triton kernels'
    `TritonGatherer` (staging/kernels.py picks one)."""

    def gather(self, k: Sequence[torch.Tensor], v: Sequence[torch.Tensor] | None, pages: PageList,
               page_size: int, heads: tuple[int, int], out: torch.Tensor, *, room: Hashable | None = None) -> int: ...


class ScattersKV(Protocol):
    """What scatters a region into a cache's pages: `Scatterer`, or `TritonScatterer`."""

    def scatter(self, src: torch.Tensor, k: Sequence[torch.Tensor], v: Sequence[torch.Tensor] | None,
                pages: PageList, page_size: int, heads: tuple[int, int], *, room: Hashable | None = None) -> int: ...

#: Plain slice copies replace the index kernels for page lists made of few runs of consecutive
#: pages: scatter for up to two runs, gather for ONE run (bench_gather.py: with more runs, one
#: copy per run loses to the index kernels). Gather only where it measured faster: whole pages
#: smaller than _GATHER_ROW_MIN_BYTES (larger ones: index_select, a memcpy per page, beats one
#: big copy_), and head slices of pages of more than one token.
_GATHER_MAX_RUNS = 1
_SCATTER_MAX_RUNS = 2
_GATHER_ROW_MIN_BYTES = 8192


def _gather_slices_win(whole: bool, page_size: int, page_bytes: int) -> bool:
    """Whether slice copies may replace index_select for a one-run gather (see above)."""
    return page_bytes < _GATHER_ROW_MIN_BYTES if whole else page_size > 1


class _TorchCopier(Planner):
    """Runs a CopyPlan with torch copies, in either direction; owns the reusable scratch buffer."""

    def __init__(self, plans: PlanCache | None = None, *, caches_fixed: bool = False) -> None:
        super().__init__(plans, caches_fixed=caches_fixed)
        self._temp: torch.Tensor | None = None

    @property
    def temp(self) -> torch.Tensor | None:
        """The current scratch buffer (None until first needed); exposed for tests and stats."""
        return self._temp

    def _scratch(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A scratch area of `nbytes`; grows when a larger one is needed, never per call."""
        t = self._temp
        if t is None or t.numel() < nbytes or t.device != device:
            t = self._temp = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return t[:nbytes]

    def forget(self) -> None:
        """Drop the scratch buffer and the references this object holds to KV caches."""
        super().forget()
        self._temp = None

    def _max_runs(self, direction: Direction, prep: PreparedCache, whole: bool) -> int:
        if direction is Direction.SCATTER:
            return _SCATTER_MAX_RUNS
        page_bytes = prep.page_size * prep.cache.num_heads * prep.cache.row_bytes
        return _GATHER_MAX_RUNS if _gather_slices_win(whole, prep.page_size, page_bytes) else 0

    def _copy(self, plan: CopyPlan) -> int:
        """One (K/V, layer) block at a time: index_select / index_copy_ by the page index, or one
        slice copy per run; through the scratch block when the region is not word-aligned."""
        total = plan.nbytes
        if total == 0:
            return 0
        prep, region, gather, pages = plan.prep, plan.region, plan.gather, plan.pages
        nblk, block, unit = plan.blocks, plan.block_bytes, prep.unit.dtype
        by_row = plan.whole and isinstance(pages, torch.Tensor)   # whole pages by index: one row per page
        caches = prep.rows if by_row else prep.pages if plan.whole else prep.sliced(plan.h0, plan.h1)
        shape = (plan.n, -1) if by_row else (plan.n, prep.page_size, plan.h1 - plan.h0, prep.r)
        staged = alignment(region) < prep.unit.nbytes
        if not staged and not isinstance(pages, torch.Tensor):
            return self._copy_runs(plan, caches, shape, total)
        parts: Sequence[torch.Tensor]
        if staged:
            tmp = self._scratch(block, prep.cache.device)
            parts = [tmp.view(unit).view(shape)] * nblk
        else:
            parts = region[:total].view(unit).view(nblk, *shape).unbind(0)
        with torch.no_grad():
            for i in range(nblk):
                if staged and not gather:
                    tmp.copy_(region[i * block: (i + 1) * block])
                part, cache = parts[i], caches[i]
                if isinstance(pages, torch.Tensor):
                    if gather:
                        torch.index_select(cache, 0, pages, out=part)
                    else:
                        cache.index_copy_(0, pages, part)
                else:
                    for run in pages:
                        at_cache = cache[run.page: run.page + run.length]
                        at_region = part[run.position: run.position + run.length]
                        if gather:
                            at_region.copy_(at_cache)
                        else:
                            at_cache.copy_(at_region)
                if staged and gather:
                    region[i * block: (i + 1) * block].copy_(tmp)
        return total

    @staticmethod
    def _copy_runs(plan: CopyPlan, caches: Sequence[torch.Tensor], shape: tuple[int, ...], total: int) -> int:
        """A page list of few runs, region aligned: every (K/V, layer) block's runs in ONE torch
        call (`cat` into the region, or `_foreach_copy_` from its split), not one `copy_` each.

        Each torch call lets go of Python's lock and must take it back; with another thread
        running Python meanwhile (the control thread, the other transfer worker), taking it back
        can wait up to `sys.getswitchinterval()` (5 ms). One call per block made a one-page
        gather of 64 blocks that many waits (docs/staging_kernels.md, "One call per copy");
        the views are cut with indexing, which keeps the lock."""
        runs = plan.pages
        assert not isinstance(runs, torch.Tensor)
        views = [cache[run.page: run.page + run.length] for cache in caches for run in runs]
        rows = plan.region[:total].view(plan.prep.unit.dtype).view(-1, *shape[1:])
        with torch.no_grad():
            if plan.gather:
                torch.cat(views, out=rows)
            else:
                torch._foreach_copy_(views, rows.split_with_sizes([run.length for run in runs] * len(caches)))
        return total


class Gatherer(_TorchCopier):
    """Gathers KV pages into staging regions. One per transfer worker thread: NOT thread-safe.

    It keeps a reusable scratch buffer and, to skip re-validating and re-viewing the same cache
    on every call, references to the last few caches it gathered from (`forget()` drops them).
    A remembered cache is recognised by its tensors' identities and addresses: a tensor
    reshaped in place at the same address (resize_, as_strided_) is not re-validated.
    """

    def gather(self, k: Sequence[torch.Tensor], v: Sequence[torch.Tensor] | None, pages: PageList,
               page_size: int, heads: tuple[int, int], out: torch.Tensor, *, room: Hashable | None = None) -> int:
        """Write the region of `pages` x `heads` of cache (k, v) into `out[:nbytes]`; return nbytes.

        `out` is a 1-D uint8 tensor on the cache's device (e.g. a StagingBuffer region); `heads`
        is the range [h0, h1) of this cache's local heads; `pages` may repeat a page. Raises
        ValueError naming what is wrong. `room`: the page list is validated and indexed once per
        room and list (`PlanCache`; `forget_room(room)` drops them).
        """
        return self._copy(self.plan(Direction.GATHER, k, v, pages, page_size, heads, out, room))


class Scatterer(_TorchCopier):
    """Scatters staging regions into KV pages. One per thread: NOT thread-safe.

    Writes exactly the bytes of the destination head range: concurrent scatters of disjoint head
    ranges of the same pages (from different Scatterer instances) are safe. Keeps a scratch
    buffer and references to the last few caches, like Gatherer.
    """

    def scatter(self, src: torch.Tensor, k: Sequence[torch.Tensor], v: Sequence[torch.Tensor] | None,
                pages: PageList, page_size: int, heads: tuple[int, int], *, room: Hashable | None = None) -> int:
        """Copy the region in `src[:nbytes]` into `pages` x `heads` of cache (k, v); return nbytes.

        `heads` is the range [h0, h1) of the DESTINATION cache's local heads; `pages` are
        destination page indices in request order and must be distinct. `room`: as for gather.
        """
        return self._copy(self.plan(Direction.SCATTER, k, v, pages, page_size, heads, src, room))
