"""State pools for the PD driver: built from a geometry spec, items handed out like pages, and a
per-request byte pattern the prefill side writes into its items and the decode side checks in
its own (each rank holds its share of a heads pool, so both derive it from the global item).

Geometry spec: {"aux": {"sharding": "replicated", "items": 16, "tensors": [["float32", [4]],
["int32", [2]]]}, "mamba": {"sharding": "heads", "heads": 8, "items": 8, "tensors": [["float32",
[16, 4]]]}}: per tensor its dtype and the shape of one item past the head dimension (heads) or
of the whole item (replicated). A heads pool may give "blocks" instead of "heads" (global sizes of
sub-blocks sharded each on its own, GDN's conv state: `StatePool(blocks=...)`). A pool may give
"layer": the model layer it belongs to (a hybrid model's per-layer state, `StatePool(layer=...)`):
only a rank whose PP stage holds that layer registers it.
"""

from __future__ import annotations

import math
import random
import zlib

import numpy as np
import torch

from kvstage import StatePool


def make_pools(spec: dict, layout) -> dict:
    pools = {}
    stage = range(layout.layers.start, min(layout.layers.stop, layout.num_layers))
    for name, p in sorted(spec.items()):
        if p.get("layer") is not None and p["layer"] not in stage:
            continue   # another PP stage's layer: that stage registers it
        blocks = p.get("blocks")
        heads = (sum(blocks) if blocks else p.get("heads", layout.total_kv_heads)) if p["sharding"] == "heads" else None
        local = [_local_heads(heads, blocks, layout.tp_size)] if heads else []
        device = torch.device(p.get("device", "cpu"))   # a pool may sit on another device than the KV
        tensors = [torch.zeros((p["items"], *local, *shape), dtype=getattr(torch, dtype), device=device).zero_()
                   for dtype, shape in p["tensors"]]
        pools[name] = StatePool(
            tensors=tensors,
            sharding=p["sharding"],
            heads=heads,
            blocks=blocks,
            own_writes=bool(p.get("own_writes", False)),
            layer=p.get("layer"),
        )
    return pools


def _local_heads(heads: int, blocks: list | None, tp: int) -> int:
    return sum(b // tp for b in blocks) if blocks else max(1, heads // tp)


class Items:
    """Free item slots of every pool of one rank, taken at random like a serving engine's."""

    def __init__(self, pools: dict, rng: random.Random):
        self.free = {name: list(range(p.tensors[0].shape[0])) for name, p in pools.items()}
        self.rng = rng

    def take(self, counts: dict) -> dict | None:
        if any(len(self.free[n]) < c for n, c in counts.items()):
            return None
        out = {}
        for n, c in sorted(counts.items()):
            picked = self.rng.sample(self.free[n], c)
            self.free[n] = [i for i in self.free[n] if i not in picked]
            out[n] = picked
        return out

    def give(self, items: dict) -> None:
        for n, picked in items.items():
            self.free[n] += picked


def _global_item(pool: StatePool, name: str, tensor: int, key: int, j: int, layout) -> torch.Tensor:
    """Request item j of one pool tensor as the whole model holds it: [heads, row bytes] for a
    heads pool, [item bytes] when replicated."""
    t = pool.tensors[tensor]
    row = math.prod(t.shape[2:] if pool.sharding == "heads" else t.shape[1:]) * t.element_size()
    seed = zlib.crc32(repr((name, tensor, key, j)).encode())
    g = torch.Generator().manual_seed(seed)
    if pool.sharding == "heads":
        return torch.randint(0, 256, (pool.heads, row), generator=g, dtype=torch.uint8)
    return torch.randint(0, 256, (row,), generator=g, dtype=torch.uint8)


def _mine(pool: StatePool, whole: torch.Tensor, layout) -> torch.Tensor:
    """This rank's share of a global item."""
    if pool.sharding != "heads":
        return whole
    if pool.blocks and len(pool.blocks) > 1:     # its slice of every block, one after another
        parts, at = [], 0
        for b in pool.blocks:
            n = b // layout.tp_size
            parts.append(whole[at + layout.tp_rank * n : at + (layout.tp_rank + 1) * n])
            at += b
        return torch.cat(parts).reshape(-1)
    local = max(1, pool.heads // layout.tp_size)
    first = layout.tp_rank // max(1, layout.tp_size // pool.heads) * local
    return whole[first : first + local].reshape(-1)


def fill(pools: dict, items: dict, key: int, layout) -> None:
    for name, picked in items.items():
        pool = pools[name]
        for ti, t in enumerate(pool.tensors):
            flat = t.view(t.shape[0], -1).view(torch.uint8)
            for j, item in enumerate(picked):
                flat[item] = _mine(pool, _global_item(pool, name, ti, key, j, layout), layout).to(t.device)


def check(pools: dict, items: dict, key: int, layout) -> str | None:
    for name, picked in items.items():
        pool = pools[name]
        for ti, t in enumerate(pool.tensors):
            flat = t.view(t.shape[0], -1).view(torch.uint8)
            for j, item in enumerate(picked):
                want = _mine(pool, _global_item(pool, name, ti, key, j, layout), layout)
                got = flat[item].cpu()
                if not torch.equal(got, want):
                    bad = int(np.count_nonzero((got != want).numpy()))
                    return f"pool {name!r} tensor {ti} item {item} (request item {j}): {bad} bytes wrong"
    return None
