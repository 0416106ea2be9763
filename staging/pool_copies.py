"""Copying state pool items between their tensors and a staged region (prefill: after the KV
bytes of the last piece; decode: out of the ring into this rank's items).

Each pool tensor is seen once as bytes, `[num_items, item bytes]` (`PoolBytes`); a request's
copies then only index those views, which takes no torch op, and move every block in ONE op.
Every torch op releases the GIL and must win it back from the rank's other threads (the control
thread polls the backend while a transfer is on); the first version's ~9 ops per tensor took about
twice as long alone and 2.6x as long beside a polling thread (examples/bench_pool_copies.py,
docs/journal/benchmarks-2026-11.md "State pools"). The same code runs on either device (`torch._foreach_copy_`
is one kernel launch per list on a GPU).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:  # staging stays importable without the protocol package
    from ..transfer.protocol.pool_parts import PoolCopy, PoolSegment
    from ..transfer.state_pools import StatePool


class PoolBytes:
    """A rank's state pools with each tensor viewed once as uint8 `[num_items, item bytes]`."""

    def __init__(self, pools: Mapping[str, StatePool]) -> None:
        self._pools = pools
        self._rows: dict[tuple[str, int], torch.Tensor] = {}

    def across(self, pool: str, other: torch.device) -> bool:
        """Whether copies between `pool` and a staged region on `other` go through a bounce
        buffer: the pool is in another kind of memory (a host pool beside a device ring), or
        asks for it (`own_writes`, which makes CPU machines run the path GPU servers run)."""
        p = self._pools[pool]
        return p.tensors[0].device != other or bool(getattr(p, "own_writes", False))

    def span(self, segment: PoolSegment, heads: tuple[int, int] | None) -> tuple[torch.Tensor, int, int]:
        """The tensor's byte rows and the byte range [a, b) of `heads` (all of an item for None)
        within each row."""
        key = (segment.pool, segment.tensor)
        rows = self._rows.get(key)
        if rows is None:
            t = self._pools[segment.pool].tensors[segment.tensor]
            rows = self._rows[key] = t.reshape(t.shape[0], -1).view(torch.uint8)
        a, b = 0, rows.shape[1]
        if heads is not None:
            local = self._pools[segment.pool].tensors[segment.tensor].shape[1]
            per_head = rows.shape[1] // local
            a, b = heads[0] * per_head, heads[1] * per_head
        if b - a != segment.item_bytes:
            raise ValueError(f"pool {segment.pool!r} tensor {segment.tensor}: {b - a} bytes per item, expected "
                             f"{segment.item_bytes}")
        return rows, a, b


def _as_bytes(pools: PoolBytes | Mapping[str, StatePool]) -> PoolBytes:
    return pools if isinstance(pools, PoolBytes) else PoolBytes(pools)


def _item_rows(rows: torch.Tensor, items: np.ndarray | None, a: int, b: int,
               segment: PoolSegment) -> list[torch.Tensor]:
    """Each item's bytes [a, b) as a view (plain indexing: no torch op, no GIL hand-off)."""
    if items is None:
        raise ValueError(f"pool {segment.pool!r} tensor {segment.tensor}: the copy names no items on this side")
    n = rows.shape[0]
    out = []
    for i in items:
        i = int(i)
        if not 0 <= i < n:
            raise ValueError(f"pool {segment.pool!r} item {i} is out of range [0, {n})")
        out.append(rows[i, a:b])
    return out


def gather_pools(pools: PoolBytes | Mapping[str, StatePool], copies: Sequence[PoolCopy], out: torch.Tensor, offset: int, dst: bool = False) -> int:
    """Append each copy's source items (their head range, for a heads pool) to the uint8 `out`
    at byte `offset`, in order; returns the bytes written. `dst`: the destination side's items
    instead (the decode rank digesting what landed). `pools`: a PoolBytes (or the pools dict)."""
    pb = _as_bytes(pools)
    same: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])   # (destinations, sources) in one kind of memory
    across: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])   # through the bounce buffer
    pos = offset
    for c in copies:
        seg = c.segment
        rows, a, b = pb.span(seg, seg.dst_heads if dst else seg.src_heads)
        items = _item_rows(rows, c.dst_items if dst else c.src_items, a, b, seg)
        if len(items) * (b - a) != c.nbytes:
            raise ValueError(f"pool {seg.pool!r} tensor {seg.tensor}: {len(items) * (b - a)} bytes, expected "
                             f"{c.nbytes}")
        dsts, srcs = across if pb.across(seg.pool, out.device) else same
        for r in items:
            srcs.append(r)
            dsts.append(out[pos:pos + (b - a)])
            pos += b - a
    if same[1]:
        torch._foreach_copy_(*same)
    if across[1]:
        copy_across(*across)
    return pos - offset


@dataclass(frozen=True)
class LandedBlock:
    """One pool copy's bytes as they landed in a staged region."""

    view: torch.Tensor       # uint8 view of the region
    copy: PoolCopy           # the copy whose bytes these are


def scatter_pools(pools: PoolBytes | Mapping[str, StatePool], landed: Sequence[LandedBlock]) -> None:
    """Copy each landed block into its destination items."""
    pb = _as_bytes(pools)
    same: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])   # (destinations, sources) in one kind of memory
    across: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])   # through the bounce buffer
    for block in landed:
        view, c = block.view, block.copy
        seg = c.segment
        rows, a, b = pb.span(seg, seg.dst_heads)
        items = _item_rows(rows, c.dst_items, a, b, seg)
        if view.numel() != len(items) * (b - a):
            raise ValueError(f"pool {seg.pool!r} tensor {seg.tensor}: a landed block of {view.numel()} bytes "
                             f"for {len(items)} items of {b - a}")
        dsts, srcs = across if pb.across(seg.pool, view.device) else same
        for k, r in enumerate(items):
            dsts.append(r)
            srcs.append(view[k * (b - a):(k + 1) * (b - a)])
    if same[1]:
        torch._foreach_copy_(*same)
    if across[1]:
        copy_across(*across)


def copy_across(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """Copy uint8 blocks between two kinds of memory in a batch: through ONE contiguous bounce
    buffer on the host side (pinned when a GPU is on the other side, so the host-device leg is
    one asynchronous copy list on the current stream), never one synchronous copy per item. The
    current stream of a CUDA side is synchronized before returning (a stream, not the device),
    so the bytes are in place for the backend write or the request's Success that follows."""
    src_dev, dst_dev = srcs[0].device, dsts[0].device
    gpu = next((d for d in (src_dev, dst_dev) if d.type == "cuda"), None)
    host = src_dev if src_dev.type == "cpu" else dst_dev
    sizes = [s.numel() for s in srcs]
    bounce = torch.empty(sum(sizes), dtype=torch.uint8, device=host, pin_memory=gpu is not None and host.type == "cpu")
    parts = list(torch.split(bounce, sizes))
    if host == src_dev:    # host -> (device): gather on the host, then one copy list out
        torch.cat(srcs, out=bounce)
        torch._foreach_copy_(dsts, parts, non_blocking=gpu is not None)
    else:                  # device -> host: one copy list into the bounce, then spread on the host
        torch._foreach_copy_(parts, srcs, non_blocking=True)
        if gpu is not None:
            torch.cuda.current_stream(gpu).synchronize()
        torch._foreach_copy_(dsts, parts)
    if gpu is not None:
        torch.cuda.current_stream(gpu).synchronize()
