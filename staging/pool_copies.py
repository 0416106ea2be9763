"""Copying state pool items between their tensors and a staged region (prefill: after the KV
bytes of the last piece; decode: out of the ring into this rank's items). Pool items are few and
small next to the KV pages, so plain torch indexing does it on either device."""

from __future__ import annotations

from typing import Sequence

import torch


def _rows(pools: dict, copy, items) -> tuple[torch.Tensor, torch.Tensor]:
    """The pool tensor and the index of the copy's items on its device."""
    seg = copy.segment
    t = pools[seg.pool].tensors[seg.tensor]
    return t, torch.as_tensor(items, dtype=torch.int64).to(t.device)


def gather_pools(pools: dict, copies: Sequence, out: torch.Tensor, offset: int, dst: bool = False) -> int:
    """Append each copy's source items (their head range, for a heads pool) to the uint8 `out`
    at byte `offset`, in order; returns the bytes written. `dst`: the destination side's items
    instead (the decode rank digesting what landed)."""
    pos = offset
    for c in copies:
        t, idx = _rows(pools, c, c.dst_items if dst else c.src_items)
        rows = t.index_select(0, idx)
        heads = c.segment.dst_heads if dst else c.segment.src_heads
        if heads is not None:
            rows = rows[:, heads[0]:heads[1]]
        data = rows.contiguous().view(-1).view(torch.uint8)
        if data.numel() != c.nbytes:
            raise ValueError(f"pool {c.segment.pool!r} tensor {c.segment.tensor}: {data.numel()} bytes, expected "
                             f"{c.nbytes}")
        out[pos:pos + c.nbytes].copy_(data)
        pos += c.nbytes
    return pos - offset


def scatter_pools(pools: dict, landed: Sequence[tuple[torch.Tensor, object]]) -> None:
    """Copy each landed block (a uint8 view of the ring) into its destination items."""
    for view, c in landed:
        t, idx = _rows(pools, c, c.dst_items)
        shape = (idx.numel(),) + tuple(t.shape[1:])
        heads = c.segment.dst_heads
        if heads is not None:
            shape = (idx.numel(), heads[1] - heads[0]) + tuple(t.shape[2:])
        rows = view.clone().view(t.dtype).view(shape)  # a copy: the block may sit at any byte offset
        if heads is None:
            t.index_copy_(0, idx, rows)
        else:
            t[idx, heads[0]:heads[1]] = rows
