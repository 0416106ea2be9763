"""Descriptor lists for the direct (non-staged) path, built with numpy, never per element.

Whole pages (equal TP, MLA): one range per run of pages that are consecutive on BOTH sides,
per layer and K/V. Head slices (different TP): one range per token, layer and K/V, because
in a token-major cache the heads of one token are the only contiguous bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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


@dataclass(frozen=True, eq=False)
class TensorRows:
    """What a direct write's descriptors add to each tensor's base address: per range, its
    offset inside a tensor on each side and its length. It depends on the pages and heads only,
    not on the layers, so a room's layer-wise writes of one chunk compute it once
    (`DirectRowsCache`) and each write only adds its own tensors' bases (`rows_of`)."""

    src_off: np.ndarray   # uint64, one per range
    dst_off: np.ndarray
    lengths: np.ndarray


def tensor_rows(src: CacheGeometry, dst: CacheGeometry, src_pages: np.ndarray, dst_pages: np.ndarray,
                src_heads: tuple[int, int], dst_heads: tuple[int, int]) -> TensorRows:
    """The ranges moving the given heads of the given pages inside one tensor (any tensor: every
    tensor of a cache has the same shape)."""
    if src.head_bytes != dst.head_bytes or src.page_size != dst.page_size:
        raise ValueError("head size or page size differ between the caches")
    nheads = src_heads[1] - src_heads[0]
    if nheads != dst_heads[1] - dst_heads[0] or nheads <= 0:
        raise ValueError(f"head ranges {src_heads} and {dst_heads} differ in size")
    if nheads == src.local_heads == dst.local_heads:   # whole pages: one range per run of pages
        s0, d0, n = page_runs(src_pages, dst_pages)
        return TensorRows(s0.astype(np.uint64) * np.uint64(src.page_stride),
                          d0.astype(np.uint64) * np.uint64(dst.page_stride),
                          (n * src.page_stride).astype(np.uint64))
    offs = np.arange(src.page_size, dtype=np.int64)   # head slices: one range per token
    s_tok = (np.asarray(src_pages, dtype=np.int64)[:, None] * src.page_size + offs).ravel()
    d_tok = (np.asarray(dst_pages, dtype=np.int64)[:, None] * dst.page_size + offs).ravel()
    return TensorRows(s_tok.astype(np.uint64) * np.uint64(src.token_stride) + np.uint64(src_heads[0] * src.head_bytes),
                      d_tok.astype(np.uint64) * np.uint64(dst.token_stride) + np.uint64(dst_heads[0] * dst.head_bytes),
                      np.full(s_tok.shape, nheads * src.head_bytes, dtype=np.uint64))


def rows_of(rows: TensorRows, src: CacheGeometry, dst: CacheGeometry) -> tuple[np.ndarray, np.ndarray]:
    """Source and destination N x 3 (address, length, device) arrays: `rows` in every tensor of
    the two caches, tensor by tensor (K of each layer, then V of each)."""
    if len(src.bases) != len(dst.bases):
        raise ValueError("the two caches have different numbers of tensors")
    src_b = np.asarray(src.bases, dtype=np.uint64)[:, None]
    dst_b = np.asarray(dst.bases, dtype=np.uint64)[:, None]
    s_addr = src_b + rows.src_off[None, :]
    lengths = np.broadcast_to(rows.lengths[None, :], s_addr.shape)
    return _rows(s_addr, lengths, src.device), _rows(dst_b + rows.dst_off[None, :], lengths, dst.device)


def direct_descriptors(src: CacheGeometry, dst: CacheGeometry, src_pages: np.ndarray, dst_pages: np.ndarray,
                       src_heads: tuple[int, int], dst_heads: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Source and destination N x 3 (address, length, device) arrays moving the given heads of
    the given pages, for every tensor (layer, K/V) of the two caches."""
    return rows_of(tensor_rows(src, dst, src_pages, dst_pages, src_heads, dst_heads), src, dst)


@dataclass(frozen=True, eq=False)
class _Cached:
    src_pages: np.ndarray
    dst_pages: np.ndarray
    heads: tuple[tuple[int, int], tuple[int, int]]
    peer: object
    rows: TensorRows


class DirectRowsCache:
    """The `TensorRows` of each (room, decode peer)'s current pages: a layer-wise room's writes
    of one chunk move the same pages, so all but the first skip the per-page work. An entry is
    used only for equal page lists (compared by value against the entry's own copies: the ops'
    arrays are new objects per write), the same heads and the same peer memory object (a
    reconnect brings a new one); `forget(room)` drops a room's entries when it is released."""

    def __init__(self) -> None:
        self._entries: dict[tuple[int, int], _Cached] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, room: int, peer_key: int, peer: object, src_pages: np.ndarray, dst_pages: np.ndarray,
            heads: tuple[tuple[int, int], tuple[int, int]], compute: Callable[[], TensorRows]) -> TensorRows:
        hit = self._entries.get((room, peer_key))
        if (hit is not None and hit.heads == heads and hit.peer is peer
                and np.array_equal(hit.src_pages, src_pages) and np.array_equal(hit.dst_pages, dst_pages)):
            return hit.rows
        rows = compute()
        self._entries[(room, peer_key)] = _Cached(np.array(src_pages), np.array(dst_pages), heads, peer, rows)
        return rows

    def forget(self, room: int) -> None:
        for key in [k for k in self._entries if k[0] == room]:
            del self._entries[key]


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

