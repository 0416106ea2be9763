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
Everything works on byte views of the caches, so every dtype (fp8 included) moves bit-exactly.
The bytes of one head row (``head_dim * elem_size``) are reinterpreted as the widest integer unit
that divides them and that every tensor involved is aligned to (int64 in practice): torch's
index kernels move one element at a time, and 8-byte elements make ``index_copy_`` 2-7x and
whole-page ``index_select`` up to 1.7x faster than byte elements.

- gather, whole head set: ``index_select`` of whole pages straight into the region;
- gather, a head slice: ``index_select`` on the head-sliced page view straight into the region.
  It measured 1.2-5x faster than "whole pages into a temp, then copy the head slice out" with
  torch 2.13 here (the 1.5 GB/s once measured for the direct form is not reproduced, docs/staging_kernels.md), so no temp;
- scatter: ``index_copy_`` into the (head-sliced) page view of the destination cache. It writes
  exactly the bytes of the destination head range and nothing else, so several writers may
  scatter DIFFERENT head ranges of the SAME pages concurrently (the decode side does, with P > D).
  A read-modify-write of whole pages through a temp would race with them (and measured 1.4-6x
  slower); it is not used;
- consecutive pages: a scatter of at most two runs of consecutive pages uses plain slice copies
  instead of ``index_copy_`` (1.1-1.9x faster); so does a gather of ONE run where that measured
  faster (whole pages under 8 KiB; head slices of multi-token pages). With more runs the
  per-copy overhead loses;
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

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from .copy_units import alignment, unit_for
from .page_lists import check_pages

__all__ = ["region_nbytes", "Gatherer", "Scatterer"]

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


def _check_int(name: str, value, minimum: int) -> int:
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
        _check_int(name, val, 0)
    return (2 if has_v else 1) * num_layers * num_tokens * num_heads * head_dim * elem_size


@dataclass(frozen=True)
class _Cache:
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


def _check_structure(k, v, page_size, what: str) -> int:
    if isinstance(k, torch.Tensor) or not isinstance(k, Sequence) or len(k) == 0:
        raise ValueError(f"{what}: k must be a non-empty sequence of per-layer tensors")
    if v is not None:
        if isinstance(v, torch.Tensor) or not isinstance(v, Sequence):
            raise ValueError(f"{what}: v must be None (MLA) or a sequence of per-layer tensors")
        if len(v) != len(k):
            raise ValueError(f"{what}: v has {len(v)} layers but k has {len(k)}")
    return _check_int("page_size", page_size, 1)


def _describe_cache(k, v, page_size: int, what: str) -> _Cache:
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
    return _Cache(tuple(tensors), len(k), v is not None, num_tokens // page_size, num_heads, head_dim,
                  first.element_size(), first.device, first.dtype)


def _check_heads(heads, num_heads: int, what: str) -> tuple[int, int]:
    try:
        h0, h1 = heads
    except (TypeError, ValueError):
        raise ValueError(f"{what}: heads must be a (start, stop) pair, got {heads!r}") from None
    h0 = _check_int("heads[0]", h0, 0)
    h1 = _check_int("heads[1]", h1, 0)
    if not h0 < h1 <= num_heads:
        raise ValueError(f"{what}: head range [{h0}, {h1}) is out of bounds for {num_heads} heads")
    return h0, h1


@dataclass(frozen=True)
class _Pages:
    n: int
    index: torch.Tensor | None      # int64 on the cache's device; None when `runs` replace it
    runs: tuple[tuple[int, int, int], ...] | None  # (position in list, first page, length)


def _check_pages(pages, num_pages: int, device: torch.device, what: str, unique: bool,
                 max_runs: int) -> _Pages:
    host = check_pages(pages, num_pages, what, unique=unique)
    n = int(host.shape[0])
    if n == 0:
        return _Pages(0, None, ())
    breaks = np.flatnonzero(np.diff(host) != 1) + 1 if max_runs > 0 else None
    if breaks is not None and breaks.shape[0] + 1 <= max_runs:
        starts = [0, *breaks.tolist()]
        ends = [*breaks.tolist(), n]
        return _Pages(n, None, tuple((s, int(host[s]), e - s) for s, e in zip(starts, ends)))
    index = torch.from_numpy(np.ascontiguousarray(host))
    if index.device != device:
        index = index.to(device)
    return _Pages(n, index, None)


class _Prepared:
    """A validated cache and its views in `unit` elements, memoised by the Gatherer/Scatterer.

    Holding the tensors keeps their ids unique while the entry exists, so (ids, data pointers)
    identify the same cache on the next call without re-validating it.
    """

    def __init__(self, cache: _Cache, page_size: int) -> None:
        self.cache = cache
        self.page_size = page_size
        self.ptrs = tuple(t.data_ptr() for t in cache.tensors)
        unit = unit_for(cache.row_bytes, cache.tensors)
        self.w, self.unit = unit.nbytes, unit.dtype
        self.r = cache.row_bytes // self.w
        P, H = cache.num_pages, cache.num_heads
        #: per tensor: [num_pages, page_size, heads, r]
        self.pages = [t.view(torch.uint8).view(self.unit).view(P, page_size, H, self.r) for t in cache.tensors]
        #: per tensor: [num_pages, page_size * heads * r] (whole-page rows)
        self.rows = [pv.view(P, -1) for pv in self.pages]
        self._sliced: dict[tuple[int, int], list[torch.Tensor]] = {}
        #: data other implementations derive from this cache (the Triton address table), kept
        #: and dropped with this entry
        self.extras: dict[str, object] = {}

    def valid(self) -> bool:
        return all(t.data_ptr() == p for t, p in zip(self.cache.tensors, self.ptrs))

    def sliced(self, h0: int, h1: int) -> list[torch.Tensor]:
        views = self._sliced.get((h0, h1))
        if views is None:
            views = self._sliced[(h0, h1)] = [pv[:, :, h0:h1] for pv in self.pages]
        return views


def _check_region(region, device: torch.device, need: int, name: str, what: str) -> None:
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


_MEMO_ENTRIES = 4


class _Worker:
    """Shared by Gatherer and Scatterer: the reusable scratch buffer and the prepared caches."""

    def __init__(self) -> None:
        self._temp: torch.Tensor | None = None
        self._memo: dict[tuple, _Prepared] = {}

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

    def _prepare(self, k, v, page_size, what: str) -> _Prepared:
        page_size = _check_structure(k, v, page_size, what)
        key = (page_size, len(k), v is not None, *map(id, k), *(map(id, v) if v is not None else ()))
        prep = self._memo.get(key)
        if prep is not None and prep.valid():
            return prep
        prep = _Prepared(_describe_cache(k, v, page_size, what), page_size)
        if len(self._memo) >= _MEMO_ENTRIES:
            self._memo.clear()
        self._memo[key] = prep
        return prep

    def forget(self) -> None:
        """Drop the scratch buffer and the references this object holds to KV caches."""
        self._temp = None
        self._memo.clear()


class Gatherer(_Worker):
    """Gathers KV pages into staging regions. One per transfer worker thread: NOT thread-safe.

    It keeps a reusable scratch buffer and, to skip re-validating and re-viewing the same cache
    on every call, references to the last few caches it gathered from (`forget()` drops them).
    A remembered cache is recognised by its tensors' identities and addresses: a tensor
    reshaped in place at the same address (resize_, as_strided_) is not re-validated.
    """

    def gather(self, k: Sequence[torch.Tensor], v: Sequence[torch.Tensor] | None, pages: torch.Tensor,
               page_size: int, heads: tuple[int, int], out: torch.Tensor) -> int:
        """Write the region of `pages` x `heads` of cache (k, v) into `out[:nbytes]`; return nbytes.

        `out` is a 1-D uint8 tensor on the cache's device (e.g. a StagingBuffer region); `heads`
        is the range [h0, h1) of this cache's local heads; `pages` may repeat a page. Raises
        ValueError naming what is wrong.
        """
        what = "gather"
        prep = self._prepare(k, v, page_size, what)
        cache = prep.cache
        h0, h1 = _check_heads(heads, cache.num_heads, what)
        whole = h1 - h0 == cache.num_heads
        slices = _gather_slices_win(whole, prep.page_size, prep.page_size * cache.num_heads * cache.row_bytes)
        pg = _check_pages(pages, cache.num_pages, cache.device, what, unique=False,
                          max_runs=_GATHER_MAX_RUNS if slices else 0)
        ps, hh, n, r, unit = prep.page_size, h1 - h0, pg.n, prep.r, prep.unit
        total = region_nbytes(cache.num_layers, cache.has_v, n * ps, hh, cache.head_dim, cache.elem_size)
        _check_region(out, cache.device, total, "out", what)
        if total == 0:
            return 0
        nblk = len(cache.tensors)
        block = total // nblk
        srcs = prep.pages if whole else prep.sliced(h0, h1)
        staged = alignment(out) < prep.w
        # whole pages by index: one row per page; otherwise [n, page_size, heads, r]
        shape = (n, -1) if whole and pg.runs is None else (n, ps, hh, r)
        if staged:
            tmp = self._scratch(block, cache.device)
            dsts = [tmp.view(unit).view(shape)] * nblk
        else:
            dsts = out[:total].view(unit).view(nblk, *shape).unbind(0)
        with torch.no_grad():
            for i in range(nblk):
                dst = dsts[i]
                if pg.runs is not None:
                    src = srcs[i]
                    for pos, start, length in pg.runs:
                        dst[pos: pos + length].copy_(src[start: start + length])
                else:
                    torch.index_select(prep.rows[i] if whole else srcs[i], 0, pg.index, out=dst)
                if staged:
                    out[i * block: (i + 1) * block].copy_(tmp)
        return total


class Scatterer(_Worker):
    """Scatters staging regions into KV pages. One per thread: NOT thread-safe.

    Writes exactly the bytes of the destination head range: concurrent scatters of disjoint head
    ranges of the same pages (from different Scatterer instances) are safe. Keeps a scratch
    buffer and references to the last few caches, like Gatherer.
    """

    def scatter(self, src: torch.Tensor, k: Sequence[torch.Tensor], v: Sequence[torch.Tensor] | None,
                pages: torch.Tensor, page_size: int, heads: tuple[int, int]) -> int:
        """Copy the region in `src[:nbytes]` into `pages` x `heads` of cache (k, v); return nbytes.

        `heads` is the range [h0, h1) of the DESTINATION cache's local heads; `pages` are
        destination page indices in request order and must be distinct.
        """
        what = "scatter"
        prep = self._prepare(k, v, page_size, what)
        cache = prep.cache
        h0, h1 = _check_heads(heads, cache.num_heads, what)
        pg = _check_pages(pages, cache.num_pages, cache.device, what, unique=True, max_runs=_SCATTER_MAX_RUNS)
        ps, hh, n, r, unit = prep.page_size, h1 - h0, pg.n, prep.r, prep.unit
        total = region_nbytes(cache.num_layers, cache.has_v, n * ps, hh, cache.head_dim, cache.elem_size)
        _check_region(src, cache.device, total, "src", what)
        if total == 0:
            return 0
        nblk = len(cache.tensors)
        block = total // nblk
        whole = hh == cache.num_heads
        dsts = prep.pages if whole else prep.sliced(h0, h1)
        staged = alignment(src) < prep.w
        shape = (n, -1) if whole and pg.runs is None else (n, ps, hh, r)
        if staged:
            tmp = self._scratch(block, cache.device)
            parts = [tmp.view(unit).view(shape)] * nblk
        else:
            parts = src[:total].view(unit).view(nblk, *shape).unbind(0)
        with torch.no_grad():
            for i in range(nblk):
                if staged:
                    tmp.copy_(src[i * block: (i + 1) * block])
                part = parts[i]
                if pg.runs is not None:
                    dst = dsts[i]
                    for pos, start, length in pg.runs:
                        dst[start: start + length].copy_(part[pos: pos + length])
                else:
                    (prep.rows[i] if whole else dsts[i]).index_copy_(0, pg.index, part)
        return total
