"""Fused Triton gather/scatter: ONE kernel launch per staging region, on the GPU.

Same contract and bytes as the torch reference (`gather_scatter.Gatherer` / `Scatterer`, see
docs/staging_kernels.md): the region of ``n`` pages and the head range ``[h0, h1)`` is
``[K/V][layer][token][head][head_dim]``. The torch path issues one copy per (K/V, layer)
block; here one launch covers every block, so a 64-layer chunk is 1 launch instead of 128.

The kernels are written around a generic "row": a row of a ``[rows, heads, row_words]``
tensor, addressed by an item index list and `items_per_index` rows per item (a KV page of
``page_size`` tokens; a state pool would pass 1). For each block ``b`` (one tensor, its base
address in an int64 table) and each region row ``j``::

    src row = index[j // items_per_index] * items_per_index + j % items_per_index
    region[b, j, :] <-> tensor_b[src row, h0:h1, :]     (h1 - h0) * row_words words

A head row is reinterpreted as the widest machine word (int64/int32/int16/int8) that divides
``head_dim * elem_size`` and that every tensor and the region are aligned to, so any dtype
(fp8 included) moves bit-exactly and whole words at a time (`copy_units.unit_for`).

Launch geometry: grid ``(cdiv(rows, BLOCK_R), blocks)``; each program copies a tile of
``BLOCK_R`` region rows, looping over the row's ``(h1 - h0) * row_words`` words in
``BLOCK_W``-wide steps (`_blocks_for`).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from .copy_units import unit_for
from .gather_scatter import _check_heads, _check_pages, _check_region, _Worker, region_nbytes

__all__ = ["TritonGatherer", "TritonScatterer", "gather_rows_kernel", "scatter_rows_kernel", "tile_shape",
           "interpreted"]

#: a tile is at most this many words (BLOCK_R * BLOCK_W): 32 KiB of int64 per program
_TILE_WORDS = 4096
_MAX_BLOCK_W = 1024
_NUM_WARPS = 4


@triton.jit
def _tile_offsets(index_ptr, rows, items_per_index, heads, h0, span, row_words, pid_r, blk,
                  BLOCK_R: tl.constexpr):
    """Word offsets of a tile's rows: in the (head-sliced) tensor row and in the region."""
    j = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = j < rows
    item = tl.load(index_ptr + j // items_per_index, mask=ok, other=0).to(tl.int64)
    row = item * items_per_index + j % items_per_index
    tensor_off = (row * heads + h0) * row_words
    region_off = (blk.to(tl.int64) * rows + j) * span
    return tensor_off, region_off, ok


@triton.jit
def gather_rows_kernel(table_ptr, region_ptr, index_ptr, rows, items_per_index, heads, h0, span, row_words,
                       BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
    """region[blk, j, :span] = tensor_blk[row(j), h0:h0 + span / row_words, :] (in words)."""
    pid_r = tl.program_id(0)
    blk = tl.program_id(1)
    base = tl.load(table_ptr + blk).to(tl.pointer_type(region_ptr.dtype.element_ty))
    src_off, dst_off, ok = _tile_offsets(index_ptr, rows, items_per_index, heads, h0, span, row_words,
                                         pid_r, blk, BLOCK_R)
    for w0 in range(0, span, BLOCK_W):
        w = w0 + tl.arange(0, BLOCK_W)
        m = ok[:, None] & (w < span)[None, :]
        x = tl.load(base + src_off[:, None] + w[None, :], mask=m)
        tl.store(region_ptr + dst_off[:, None] + w[None, :], x, mask=m)


@triton.jit
def scatter_rows_kernel(table_ptr, region_ptr, index_ptr, rows, items_per_index, heads, h0, span, row_words,
                        BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
    """tensor_blk[row(j), h0:h0 + span / row_words, :] = region[blk, j, :span]; nothing else."""
    pid_r = tl.program_id(0)
    blk = tl.program_id(1)
    base = tl.load(table_ptr + blk).to(tl.pointer_type(region_ptr.dtype.element_ty))
    dst_off, src_off, ok = _tile_offsets(index_ptr, rows, items_per_index, heads, h0, span, row_words,
                                         pid_r, blk, BLOCK_R)
    for w0 in range(0, span, BLOCK_W):
        w = w0 + tl.arange(0, BLOCK_W)
        m = ok[:, None] & (w < span)[None, :]
        x = tl.load(region_ptr + src_off[:, None] + w[None, :], mask=m)
        tl.store(base + dst_off[:, None] + w[None, :], x, mask=m)


def interpreted() -> bool:
    """Whether the kernels above run under Triton's CPU interpreter (TRITON_INTERPRET=1)."""
    return not isinstance(gather_rows_kernel, triton.runtime.JITFunction)


def tile_shape(span: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_W) for rows of `span` words: the whole row in one step up to
    _MAX_BLOCK_W words, and as many rows as fit in a tile of _TILE_WORDS words."""
    block_w = min(triton.next_power_of_2(max(span, 1)), _MAX_BLOCK_W)
    return max(1, _TILE_WORDS // block_w), block_w


class _TritonWorker(_Worker):
    """Validation and the per-cache address table; the reference's checks, memo and messages."""

    def _launch(self, kernel, what: str, k, v, pages, page_size, heads, region, name: str) -> int:
        prep = self._prepare(k, v, page_size, what)
        cache = prep.cache
        h0, h1 = _check_heads(heads, cache.num_heads, what)
        pg = _check_pages(pages, cache.num_pages, cache.device, what, unique=what == "scatter", max_runs=0)
        total = region_nbytes(cache.num_layers, cache.has_v, pg.n * prep.page_size, h1 - h0, cache.head_dim,
                              cache.elem_size)
        _check_region(region, cache.device, total, name, what)
        if total == 0:
            return 0
        unit = unit_for(cache.row_bytes, (*cache.tensors, region))  # the region's alignment too: no scratch copy
        w, word = unit.nbytes, unit.dtype
        table = prep.extras.get("triton_table")
        if table is None:  # data_ptr of every tensor, region order (all K layers, then all V)
            table = prep.extras["triton_table"] = torch.tensor(
                [t.data_ptr() for t in cache.tensors], dtype=torch.int64, device=cache.device)
        row_words = cache.row_bytes // w
        rows = pg.n * prep.page_size
        span = (h1 - h0) * row_words
        block_r, block_w = tile_shape(span)
        grid = (triton.cdiv(rows, block_r), len(cache.tensors))
        with torch.no_grad(), _on(cache.device):
            kernel[grid](table, region[:total].view(word), pg.index, rows, prep.page_size, cache.num_heads, h0,
                         span, row_words, BLOCK_R=block_r, BLOCK_W=block_w, num_warps=_NUM_WARPS)
        return total


def _on(device: torch.device):
    """Launch on the cache's GPU (Triton launches on the current device)."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


class TritonGatherer(_TritonWorker):
    """`Gatherer` with one fused launch per region. One per worker thread: NOT thread-safe."""

    def gather(self, k, v, pages, page_size: int, heads: tuple[int, int], out: torch.Tensor) -> int:
        """Same arguments, checks, result and return value as `Gatherer.gather`. Queued on the
        current stream: synchronize before handing `out` to a backend."""
        return self._launch(gather_rows_kernel, "gather", k, v, pages, page_size, heads, out, "out")


class TritonScatterer(_TritonWorker):
    """`Scatterer` with one fused launch per region; writes only the destination head range."""

    def scatter(self, src: torch.Tensor, k, v, pages, page_size: int, heads: tuple[int, int]) -> int:
        """Same arguments, checks, result and return value as `Scatterer.scatter`."""
        return self._launch(scatter_rows_kernel, "scatter", k, v, pages, page_size, heads, src, "src")
