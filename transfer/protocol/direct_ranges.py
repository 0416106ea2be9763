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


def token_rows(src: CacheGeometry, dst: CacheGeometry, src_slot: np.ndarray, dst_slot: np.ndarray,
               length: np.ndarray) -> TensorRows:
    """The ranges moving whole tokens inside one tensor: run i moves `length[i]` tokens from pool
    slot `src_slot[i]` on to slot `dst_slot[i]` on (consecutive slots on both sides), one range a
    run (decode context parallel: token_mapping.PairTokens' arrays). Both caches hold the same
    heads per token (MLA's one latent head)."""
    if src.token_stride != dst.token_stride or src.page_size != dst.page_size:
        raise ValueError(f"token runs between caches of different token or page sizes ({src.token_stride} vs "
                         f"{dst.token_stride} bytes a token)")
    stride = np.uint64(src.token_stride)
    return TensorRows(np.asarray(src_slot, dtype=np.uint64) * stride, np.asarray(dst_slot, dtype=np.uint64) * stride,
                      np.asarray(length, dtype=np.uint64) * stride)


def slot_rows(geo: CacheGeometry, slot: np.ndarray, length: np.ndarray) -> np.ndarray:
    """The N x 3 (address, length, device) rows of runs of whole tokens in every tensor of one
    cache, tensor by tensor (K of each layer, then V of each): run i is `length[i]` tokens from
    pool slot `slot[i]` on. Where a relayout's gathered tokens land (token_mapping.Relayout),
    in the order the gather wrote them."""
    stride = np.uint64(geo.token_stride)
    addr = np.asarray(geo.bases, dtype=np.uint64)[:, None] + (np.asarray(slot, dtype=np.uint64) * stride)[None, :]
    lengths = np.broadcast_to((np.asarray(length, dtype=np.uint64) * stride)[None, :], addr.shape)
    return _rows(addr, lengths, geo.device)


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


MAX_CACHED_ROWS = 1 << 14   # descriptor rows an entry keeps per side (x 24 bytes, ~0.4 MB): whole pages fit


@dataclass(frozen=True, eq=False)
class _Cached:
    src_pages: np.ndarray
    dst_pages: np.ndarray
    heads: tuple[tuple[int, int], tuple[int, int]]
    peer: object
    rows: TensorRows
    src_all: np.ndarray | None   # (num_kv, layers, ranges, 3): every tensor's rows; None over the cap
    dst_all: np.ndarray | None


class DirectRowsCache:
    """A layer-wise room's direct writes of one chunk move the same pages: the first computes
    the descriptor rows of every tensor of the chunk once, and each write takes its layers'
    rows by slicing (a write's control path runs right after a copy has evicted the CPU's
    caches, where every numpy call costs several times its warm time). Kept per (room,
    decode peer); an entry is used only for equal page lists (compared by value against the
    entry's own copies: the ops' arrays are new objects per write), the same heads and the same
    peer memory object (a reconnect brings a new one); `forget(room)` drops a room's entries
    when it is released. Entries over `max_rows` keep only the `TensorRows`."""

    def __init__(self, max_rows: int = MAX_CACHED_ROWS) -> None:
        self._rooms: dict[int, dict[int, _Cached]] = {}
        self.max_rows = max_rows

    def __len__(self) -> int:
        return sum(len(peers) for peers in self._rooms.values())

    def descriptors(self, room: int, peer_key: int, peer: object, *, src: CacheGeometry, dst: CacheGeometry,
                    src_pages: np.ndarray, dst_pages: np.ndarray, heads: tuple[tuple[int, int], tuple[int, int]],
                    src_layers: range, dst_layers: range) -> tuple[np.ndarray, np.ndarray]:
        """What `direct_descriptors(src.of_layers(src_layers), dst.of_layers(dst_layers), ...)`
        returns, from the (room, peer)'s entry when it matches."""
        peers = self._rooms.setdefault(room, {})
        hit = peers.get(peer_key)
        if not (hit is not None and hit.heads == heads and hit.peer is peer
                and np.array_equal(hit.src_pages, src_pages) and np.array_equal(hit.dst_pages, dst_pages)):
            rows = tensor_rows(src, dst, src_pages, dst_pages, heads[0], heads[1])
            keep = rows.lengths.size * max(len(src.bases), len(dst.bases)) <= self.max_rows
            hit = _Cached(np.array(src_pages), np.array(dst_pages), heads, peer, rows,
                          _every_tensor(src, rows.src_off, rows.lengths) if keep else None,
                          _every_tensor(dst, rows.dst_off, rows.lengths) if keep else None)
            peers[peer_key] = hit
        if hit.src_all is None or hit.dst_all is None:
            return rows_of(hit.rows, src.of_layers(src_layers), dst.of_layers(dst_layers))
        return _layers_of(hit.src_all, src, src_layers), _layers_of(hit.dst_all, dst, dst_layers)

    def forget(self, room: int) -> None:
        self._rooms.pop(room, None)


def _every_tensor(geo: CacheGeometry, offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The rows of every tensor of `geo`, as (num_kv, layers, ranges, 3)."""
    addr = np.asarray(geo.bases, dtype=np.uint64)[:, None] + offsets[None, :]
    rows = _rows(addr, np.broadcast_to(lengths[None, :], addr.shape), geo.device)
    return rows.reshape(geo.num_kv, len(geo.bases) // geo.num_kv, lengths.size, 3)


def _layers_of(every: np.ndarray, geo: CacheGeometry, layers: range) -> np.ndarray:
    """`every`'s rows of `layers` (K of each, then V of each), as `rows_of` orders them."""
    if layers.stop > every.shape[1] or layers.start < 0 or layers.step != 1:
        geo.of_layers(layers)   # raises the same error a direct computation would
        raise ValueError(f"layers {layers} of a cache with {every.shape[1]} layers")
    return every[:, layers.start:layers.stop].reshape(-1, 3)


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

