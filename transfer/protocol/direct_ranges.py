"""Descriptor lists for the direct (non-staged) path, built with numpy, never per element.

Whole pages (equal TP, MLA): one range per run of pages that are consecutive on BOTH sides,
per layer and K/V. Head slices (different TP): one range per token, layer and K/V, because
in a token-major cache the heads of one token are the only contiguous bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from .messages import PoolMemory
from .pool_parts import PoolCopy


@dataclass(frozen=True)
class CacheGeometry:
    """Addresses of one rank's KV cache: per-tensor base addresses (K layers, then V layers)."""

    bases: tuple[int, ...]
    page_size: int
    token_stride: int   # bytes per token: local_heads * head_bytes
    head_bytes: int
    device: int = 0

    num_kv: int = 1     # tensors per layer: 2 (K and V) or 1 (MLA latent, or K/V fused)

    def of_layers(self, layers: range) -> CacheGeometry:
        """The geometry of `layers` only (K of each, then V of each): a layer-wise write."""
        per, odd = divmod(len(self.bases), self.num_kv)
        if odd or layers.stop > per:
            raise ValueError(f"layers {layers} of a cache with {len(self.bases)} tensors, {self.num_kv} per layer")
        if len(layers) == per:
            return self
        keep = [kv * per + i for kv in range(self.num_kv) for i in layers]
        return replace(self, bases=tuple(self.bases[i] for i in keep))

    @property
    def page_stride(self) -> int:
        return self.page_size * self.token_stride

    @property
    def local_heads(self) -> int:
        return self.token_stride // self.head_bytes


def page_runs(src_pages: np.ndarray, dst_pages: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(src starts, dst starts, lengths) of maximal runs consecutive on both sides."""
    src = np.asarray(src_pages, dtype=np.int64)
    dst = np.asarray(dst_pages, dtype=np.int64)
    if src.shape != dst.shape or src.ndim != 1:
        raise ValueError(f"page lists differ in shape: {src.shape} vs {dst.shape}")
    if src.size == 0:
        empty = np.empty(0, dtype=np.int64)
        return empty, empty, empty
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [src.size])))
    return src[starts], dst[starts], lengths


def direct_descriptors(src: CacheGeometry, dst: CacheGeometry, src_pages: np.ndarray, dst_pages: np.ndarray,
                       src_heads: tuple[int, int], dst_heads: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Source and destination N x 3 (address, length, device) arrays moving the given heads of
    the given pages, for every tensor (layer, K/V) of the two caches."""
    if len(src.bases) != len(dst.bases):
        raise ValueError("the two caches have different numbers of tensors")
    if src.head_bytes != dst.head_bytes or src.page_size != dst.page_size:
        raise ValueError("head size or page size differ between the caches")
    nheads = src_heads[1] - src_heads[0]
    if nheads != dst_heads[1] - dst_heads[0] or nheads <= 0:
        raise ValueError(f"head ranges {src_heads} and {dst_heads} differ in size")
    src_b = np.asarray(src.bases, dtype=np.uint64)[:, None]
    dst_b = np.asarray(dst.bases, dtype=np.uint64)[:, None]
    whole = nheads == src.local_heads == dst.local_heads
    if whole:
        s0, d0, n = page_runs(src_pages, dst_pages)
        s_addr = src_b + (s0.astype(np.uint64) * np.uint64(src.page_stride))[None, :]
        d_addr = dst_b + (d0.astype(np.uint64) * np.uint64(dst.page_stride))[None, :]
        lengths = np.broadcast_to((n * src.page_stride).astype(np.uint64)[None, :], s_addr.shape)
    else:
        offs = np.arange(src.page_size, dtype=np.int64)
        s_tok = (np.asarray(src_pages, dtype=np.int64)[:, None] * src.page_size + offs).ravel()
        d_tok = (np.asarray(dst_pages, dtype=np.int64)[:, None] * dst.page_size + offs).ravel()
        s_addr = src_b + (s_tok.astype(np.uint64) * np.uint64(src.token_stride)
                          + np.uint64(src_heads[0] * src.head_bytes))[None, :]
        d_addr = dst_b + (d_tok.astype(np.uint64) * np.uint64(dst.token_stride)
                          + np.uint64(dst_heads[0] * dst.head_bytes))[None, :]
        lengths = np.full(s_addr.shape, nheads * src.head_bytes, dtype=np.uint64)
    return _rows(s_addr, lengths, src.device), _rows(d_addr, lengths, dst.device)


def _rows(addr: np.ndarray, lengths: np.ndarray, device: int) -> np.ndarray:
    out = np.empty((addr.size, 3), dtype=np.uint64)
    out[:, 0] = addr.ravel()
    out[:, 1] = lengths.ravel()
    out[:, 2] = device
    return out


def direct_nbytes(num_tensors: int, num_pages: int, page_size: int, nheads: int, head_bytes: int) -> int:
    return num_tensors * num_pages * page_size * nheads * head_bytes


def pool_descriptor_parts(local: dict[str, Any], peer_pools: Sequence[PoolMemory],
                          copies: Sequence[PoolCopy]) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """Per copy, (pool name, src rows, dst rows): one range per pool item (its head range, for a
    heads pool, is contiguous in the item), each row on its own pool's device. `local`: this
    rank's pools by name; `peer_pools`: the decode rank's PoolMemory list."""
    where = {p.name: p for p in peer_pools}
    out: list[tuple[str, np.ndarray, np.ndarray]] = []
    for c in copies:
        seg = c.segment
        pool = local[seg.pool]
        t = pool.tensors[seg.tensor]
        mem = where.get(seg.pool)
        if mem is None:
            raise ValueError(f"the decode rank did not advertise pool {seg.pool!r}")
        s_base = t.data_ptr() + (seg.src_heads[0] * t.stride(1) * t.element_size() if seg.src_heads else 0)
        d_base = mem.addrs[seg.tensor] + (seg.dst_heads[0] * mem.head_strides[seg.tensor] if seg.dst_heads else 0)
        s_addr = np.uint64(s_base) + np.asarray(c.src_items, dtype=np.uint64) * np.uint64(t.stride(0) * t.element_size())
        d_addr = np.uint64(d_base) + np.asarray(c.dst_items, dtype=np.uint64) * np.uint64(mem.item_strides[seg.tensor])
        lengths = np.full(s_addr.shape, seg.item_bytes, dtype=np.uint64)
        s_dev = (t.device.index or 0) if t.device.type == "cuda" else 0
        out.append((seg.pool, _rows(s_addr, lengths, s_dev), _rows(d_addr, lengths, mem.device)))
    return out

