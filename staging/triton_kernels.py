"""Fused Triton gather/scatter: ONE kernel launch per staging region, on the GPU.

Same contract and bytes as the torch reference (`gather_scatter.Gatherer` / `Scatterer`, see
docs/staging_kernels.md): the region of ``n`` pages and the head range ``[h0, h1)`` is
``[K/V][layer][token][head][head_dim]``. The torch path issues one copy per (K/V, layer)
block; here one launch covers every block, so a 64-layer chunk is 1 launch instead of 128.
Both run from the same `copy_plan.CopyPlan`; here it becomes a `KernelLaunch`.

One kernel serves both directions: ``GATHER`` is a compile-time constant (``tl.constexpr``),
so each direction compiles to its own specialised kernel with no run-time branch.

The kernel is written around a generic "row": a row of a ``[rows, heads, row_words]``
tensor, addressed by an item index list and `items_per_index` rows per item (a KV page of
``page_size`` tokens; a state pool would pass 1). For each block ``b`` (one tensor, its base
address in an int64 table) and each region row ``j``::

    tensor row = index[j // items_per_index] * items_per_index + j % items_per_index
    region[b, j, :] <-> tensor_b[tensor row, h0:h1, :]     (h1 - h0) * row_words words

A head row is reinterpreted as the widest machine word (int64/int32/int16/int8) that divides
``head_dim * elem_size`` and that every tensor and the region are aligned to, so any dtype
(fp8 included) moves bit-exactly and whole words at a time (`copy_units.unit_for`).

Launch geometry: grid ``(cdiv(rows, BLOCK_R), blocks)``; each program copies a tile of
``BLOCK_R`` region rows, looping over the row's ``(h1 - h0) * row_words`` words in
``BLOCK_W``-wide steps (`tile_shape`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .copy_plan import CopyPlan, Direction, Planner
from .copy_units import Unit, alignment, unit_for
from .page_lists import PageList

__all__ = ["KernelLaunch", "TritonGatherer", "TritonScatterer", "copy_rows_kernel", "interpreted", "kernel_launch",
           "tile_shape"]

#: a tile is at most this many words (BLOCK_R * BLOCK_W): 32 KiB of int64 per program
_TILE_WORDS = 4096
_MAX_BLOCK_W = 1024
_NUM_WARPS = 4


# Triton has no type information, and it reads the kernel's annotations itself (tl.constexpr, or
# none: a value it specialises on), so the kernel's other arguments stay unannotated
@triton.jit  # type: ignore[untyped-decorator]
def copy_rows_kernel(table_ptr, region_ptr, index_ptr, rows, items_per_index, heads, h0, span,  # type: ignore[no-untyped-def]
                     row_words, GATHER: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
    """GATHER: region[blk, j, :span] = tensor_blk[row(j), h0:h0 + span / row_words, :] (in words);
    otherwise the reverse, writing those words of the tensor and nothing else."""
    pid_r = tl.program_id(0)
    blk = tl.program_id(1)
    base = tl.load(table_ptr + blk).to(tl.pointer_type(region_ptr.dtype.element_ty))
    j = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = j < rows
    item = tl.load(index_ptr + j // items_per_index, mask=ok, other=0).to(tl.int64)
    row = item * items_per_index + j % items_per_index
    tensor_at = base + ((row * heads + h0) * row_words)[:, None]
    region_at = region_ptr + ((blk.to(tl.int64) * rows + j) * span)[:, None]
    if GATHER:
        src, dst = tensor_at, region_at
    else:
        src, dst = region_at, tensor_at
    for w0 in range(0, span, BLOCK_W):
        w = w0 + tl.arange(0, BLOCK_W)
        m = ok[:, None] & (w < span)[None, :]
        tl.store(dst + w[None, :], tl.load(src + w[None, :], mask=m), mask=m)


def interpreted() -> bool:
    """Whether the kernel above runs under Triton's CPU interpreter (TRITON_INTERPRET=1)."""
    return not isinstance(copy_rows_kernel, triton.runtime.JITFunction)


def tile_shape(span: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_W) for rows of `span` words: the whole row in one step up to
    _MAX_BLOCK_W words, and as many rows as fit in a tile of _TILE_WORDS words."""
    block_w = min(triton.next_power_of_2(max(span, 1)), _MAX_BLOCK_W)
    return max(1, _TILE_WORDS // block_w), block_w


@dataclass(frozen=True, kw_only=True)
class KernelLaunch:
    """A CopyPlan as the kernel's arguments; calling it launches the kernel once (on the current
    device and stream)."""

    grid: tuple[int, int]
    table: torch.Tensor        # int64 data_ptr of each block's tensor
    region: torch.Tensor       # the region's bytes viewed as words
    index: torch.Tensor
    rows: int
    items_per_index: int
    heads: int
    h0: int
    span: int
    row_words: int
    gather: bool
    block_r: int
    block_w: int

    def __call__(self) -> None:
        copy_rows_kernel[self.grid](self.table, self.region, self.index, self.rows, self.items_per_index, self.heads,
                                    self.h0, self.span, self.row_words, GATHER=self.gather, BLOCK_R=self.block_r,
                                    BLOCK_W=self.block_w, num_warps=_NUM_WARPS)


@dataclass(frozen=True, kw_only=True)
class _Geometry:
    """A cache's head range in words of one size, as the kernel takes it."""

    table: torch.Tensor      # int64 data_ptr of every tensor, region order (all K layers, then all V)
    row_words: int
    span: int
    block_r: int
    block_w: int


def _geometry(plan: CopyPlan, unit: Unit) -> _Geometry:
    """The geometry of the plan's cache and head range in `unit` words: worked out once per
    cache, head range and word, kept with the memoised cache."""
    prep = plan.prep
    key = ("triton_geometry", plan.h0, plan.h1, unit.nbytes)
    geo = prep.extras.get(key)
    if not isinstance(geo, _Geometry):
        cache = prep.cache
        table = prep.extras.get("triton_table")
        if not isinstance(table, torch.Tensor):
            table = torch.tensor([t.data_ptr() for t in cache.tensors], dtype=torch.int64, device=cache.device)
            prep.extras["triton_table"] = table
        row_words = cache.row_bytes // unit.nbytes
        span = (plan.h1 - plan.h0) * row_words
        block_r, block_w = tile_shape(span)
        geo = _Geometry(table=table, row_words=row_words, span=span, block_r=block_r, block_w=block_w)
        prep.extras[key] = geo
    return geo


def kernel_launch(plan: CopyPlan) -> KernelLaunch:
    """The launch that carries out `plan` (a non-empty one). The word is the plan's cache word,
    narrowed when the region is less aligned (there is no scratch copy here)."""
    if not isinstance(plan.pages, torch.Tensor) or plan.n == 0:
        raise ValueError("a kernel launch needs a page index of at least one page (a plan without runs)")
    prep = plan.prep
    unit = prep.unit
    if alignment(plan.region) < unit.nbytes:
        unit = unit_for(prep.cache.row_bytes, (*prep.cache.tensors, plan.region))
    geo = _geometry(plan, unit)
    rows = plan.n * prep.page_size
    region = plan.region if plan.region.numel() == plan.nbytes else plan.region[:plan.nbytes]
    return KernelLaunch(grid=(-(-rows // geo.block_r), len(prep.cache.tensors)), table=geo.table,
                        region=region.view(unit.dtype), index=plan.pages, rows=rows,
                        items_per_index=prep.page_size, heads=prep.cache.num_heads, h0=plan.h0, span=geo.span,
                        row_words=geo.row_words, gather=plan.direction is Direction.GATHER, block_r=geo.block_r,
                        block_w=geo.block_w)


def _on(device: torch.device) -> AbstractContextManager[object]:
    """Launch on the cache's GPU (Triton launches on the current device)."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


class _TritonCopier(Planner):
    """Plans with the reference's checks, memo and messages (page runs never replace the index),
    then one launch."""

    def _copy(self, plan: CopyPlan) -> int:
        if plan.nbytes == 0:
            return 0
        launch = kernel_launch(plan)
        with _on(plan.prep.cache.device):   # a Triton launch records nothing for autograd: no no_grad
            launch()
        return plan.nbytes


class TritonGatherer(_TritonCopier):
    """`Gatherer` with one fused launch per region. One per worker thread: NOT thread-safe."""

    def gather(self, k: Sequence[torch.Tensor], v: Sequence[torch.Tensor] | None, pages: PageList, page_size: int,
               heads: tuple[int, int], out: torch.Tensor, *, room: Hashable | None = None) -> int:
        """Same arguments, checks, result and return value as `Gatherer.gather`. Queued on the
        current stream: synchronize before handing `out` to a backend."""
        return self._copy(self.plan(Direction.GATHER, k, v, pages, page_size, heads, out, room))


class TritonScatterer(_TritonCopier):
    """`Scatterer` with one fused launch per region; writes only the destination head range."""

    def scatter(self, src: torch.Tensor, k: Sequence[torch.Tensor], v: Sequence[torch.Tensor] | None, pages: PageList,
                page_size: int, heads: tuple[int, int], *, room: Hashable | None = None) -> int:
        """Same arguments, checks, result and return value as `Scatterer.scatter`."""
        return self._copy(self.plan(Direction.SCATTER, k, v, pages, page_size, heads, src, room))
