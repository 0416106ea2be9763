"""State pools: what a request carries besides its paged KV (aux rows, Mamba/linear-attention
states, sliding-window pages, indexer pools), registered beside K and V.

A pool is a list of tensors, each `[num_items, ...]`, all on one device (the pool is one memory
region, registered with its own kind: a host pool may sit beside a device KV cache), and a
sharding rule:
- "heads": dim 1 is this rank's share of the pool's heads, split across TP ranks exactly like
  KV heads (same mapping, replication and hetero-TP rules), over `heads` global heads (default:
  the model's KV heads). `blocks` splits that axis into sub-blocks sharded each on its own
  (GDN's conv state is [q | k | v]): a rank's share is then its slice of every block, one after
  another, so it is several ranges of the global axis;
- "replicated": every rank holds the whole item; one prefill rank writes each decode rank's copy.
Pools take part in the summary two peers compare before any byte moves (`PoolSpec`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass

import msgspec
import numpy as np
import torch

from ..bootstrap.wire import prebuild_struct_info

SHARDINGS = ("heads", "replicated")
#: Pool names kvstage keeps for a draft KV of its own geometry (draft_kv.py): the engine names
#: their items, a caller cannot.
DRAFT_POOL_PREFIX = "kvstage.draft."


class PoolSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What both sides must agree on for one pool (TP sizes may differ): per tensor, its dtype
    and the shape of one item past the head dimension (heads) or of the whole item (replicated)."""

    name: str
    sharding: str
    heads: int                  # global heads of a heads pool; 0 when replicated
    dtypes: list[str]
    rows: list[list[int]]
    blocks: list[int] = []      # global sizes of a heads pool's sub-blocks; [] means one block of `heads`

    def head_blocks(self) -> list[int]:
        """The global sizes of the sub-blocks each rank holds its share of (one for most pools)."""
        return list(self.blocks) or [self.heads]

    def row_bytes(self, tensor: int) -> int:
        """Bytes of one head of one item (heads) or of one item (replicated) of a tensor."""
        return math.prod(self.rows[tensor]) * torch.empty((), dtype=getattr(torch, self.dtypes[tensor])).element_size()


@dataclass
class StatePool:
    """A named pool's tensors as this rank holds them (see the module docstring).

    `StatePool(tensors, sharding=..., ...)`: the tensors are the one positional argument (as the
    README and docs/api.md show it); every option is keyword-only."""

    tensors: Sequence[torch.Tensor]
    _: KW_ONLY
    sharding: str = "replicated"
    heads: int | None = None
    blocks: Sequence[int] | None = None   # heads pools: global sub-block sizes along dim 1 (module docstring)
    own_writes: bool = False    # its items travel apart from the KV even when their memory kind is
                                # the KV's (docs/protocol.md "Regions and memory kinds"): what a
                                # host pool beside a device cache does, on any machine
    num_items: int = 0

    @property
    def device(self) -> torch.device:
        return self.tensors[0].device

    @property
    def kind(self) -> str:
        """The pool's memory kind: "VRAM" for CUDA memory, "DRAM" for host memory."""
        return memory_kind(self.device)

    def spec(self, name: str, layout) -> PoolSpec:
        """Validate against `layout` (this rank's TP size and rank); set num_items. Raises
        ValueError naming the pool and tensor."""
        where = f"pool {name!r}"
        if not isinstance(name, str) or not name:
            raise ValueError(f"pool names are non-empty strings, got {name!r}")
        if self.sharding not in SHARDINGS:
            raise ValueError(f"{where}: sharding must be one of {SHARDINGS}, got {self.sharding!r}")
        if not isinstance(self.tensors, (list, tuple)) or not self.tensors:
            raise ValueError(f"{where}: tensors must be a non-empty list of tensors")
        heads, blocks = 0, self._blocks(where, layout.tp_size)
        local = 0
        if self.sharding == "heads":
            default = sum(blocks) if blocks else layout.total_kv_heads
            heads = default if self.heads is None else self.heads
            if isinstance(heads, bool) or not isinstance(heads, int) or heads <= 0:
                raise ValueError(f"{where}: heads must be a positive int, got {heads!r}")
            if blocks and heads != sum(blocks):
                raise ValueError(f"{where}: heads={heads} but its blocks {blocks} add up to {sum(blocks)}")
            tp = layout.tp_size
            if heads % tp and tp % heads:
                raise ValueError(f"{where}: its {heads} heads do not divide by TP size {tp} (and TP is not a "
                                 f"multiple of them): heads sharding cannot split it")
            blocks = blocks if len(blocks) > 1 else []     # one block is the plain heads split
            local = sum(b // tp for b in blocks) if blocks else max(1, heads // tp)
        elif self.heads is not None:
            raise ValueError(f"{where}: heads is only for sharding='heads'")
        if not isinstance(self.own_writes, bool):
            raise ValueError(f"{where}: own_writes must be a bool, got {self.own_writes!r}")
        items, dtypes, rows = None, [], []
        for i, t in enumerate(self.tensors):
            at = f"{where} tensor {i}"
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{at} is {type(t).__name__}, expected a torch.Tensor")
            if t.device != self.tensors[0].device:
                raise ValueError(f"{at} is on {t.device}, tensor 0 on {self.tensors[0].device}: a pool is one memory "
                                 f"region (give tensors on another device a pool of their own)")
            if not t.is_contiguous():
                raise ValueError(f"{at} is not contiguous")
            if t.dim() < (2 if self.sharding == "heads" else 1):
                raise ValueError(f"{at} has shape {tuple(t.shape)}: [num_items, heads, ...] needed"
                                 if self.sharding == "heads" else f"{at} has no item dimension")
            if self.sharding == "heads" and t.shape[1] != local:
                raise ValueError(f"{at} has {t.shape[1]} heads in dim 1, this rank holds {local} of the pool's "
                                 f"{heads}" + (f" (its share of each block of {blocks})" if blocks else ""))
            if items is None:
                items = t.shape[0]
            elif t.shape[0] != items:
                raise ValueError(f"{at} has {t.shape[0]} items, tensor 0 has {items}")
            if items == 0:
                raise ValueError(f"{at} holds no items")
            dtypes.append(str(t.dtype).removeprefix("torch."))
            rows.append(list(t.shape[2:] if self.sharding == "heads" else t.shape[1:]))
        self.num_items = int(items)
        return PoolSpec(name=name, sharding=self.sharding, heads=heads, dtypes=dtypes, rows=rows, blocks=blocks)

    def _blocks(self, where: str, tp: int) -> list[int]:
        """`blocks` validated: positive ints; several blocks each divide by this rank's TP size (no
        replication inside a block)."""
        if self.blocks is None:
            return []
        if self.sharding != "heads":
            raise ValueError(f"{where}: blocks is only for sharding='heads'")
        blocks = list(self.blocks)
        if not blocks or any(isinstance(b, bool) or not isinstance(b, int) or b <= 0 for b in blocks):
            raise ValueError(f"{where}: blocks must be a non-empty list of positive ints, got {self.blocks!r}")
        for i, b in enumerate(blocks if len(blocks) > 1 else []):
            if b % tp:
                raise ValueError(f"{where}: block {i} of {b} heads does not divide by TP size {tp}: each "
                                 f"block is split across the ranks on its own")
        return blocks


def memory_kind(device: torch.device) -> str:
    """The backends' name for where `device`'s memory is: VRAM (CUDA) or DRAM (host)."""
    return "VRAM" if device.type == "cuda" else "DRAM"


def pool_mismatches(mine: Sequence[PoolSpec], theirs: Sequence[PoolSpec]) -> list[str]:
    """Readable differences between two ranks' pools; empty when they can exchange items."""
    a, b = {p.name: p for p in mine}, {p.name: p for p in theirs}
    out = [f"pool {n!r}: registered here only" for n in sorted(set(a) - set(b))]
    out += [f"pool {n!r}: registered at the peer only" for n in sorted(set(b) - set(a))]
    for n in sorted(set(a) & set(b)):
        for field in PoolSpec.__struct_fields__[1:]:
            if getattr(a[n], field) != getattr(b[n], field):
                out.append(f"pool {n!r} {field}: {getattr(a[n], field)!r} here vs {getattr(b[n], field)!r} at peer")
    return out


def check_items(name: str, items: object, pools: dict, side: str) -> np.ndarray:
    """One pool's item indices of a request, as int64; ValueError on bad input."""
    if isinstance(name, str) and name.startswith(DRAFT_POOL_PREFIX):
        raise ValueError(f"{side}: pool {name!r} is the draft KV's own: kvstage names its items from the pages sent")
    if name not in pools:
        raise ValueError(f"{side}: unknown pool {name!r} (registered: "
                         f"{sorted(n for n in pools if not n.startswith(DRAFT_POOL_PREFIX)) or 'none'})")
    arr = np.asarray(items)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(f"{side}: items of pool {name!r} must be a 1-D list of ints, got {items!r}")
    arr = arr.astype(np.int64)
    n = pools[name].num_items
    if arr.size and (arr.min() < 0 or arr.max() >= n):
        raise ValueError(f"{side}: an item of pool {name!r} is outside [0, {n}): {arr.tolist()}")
    if np.unique(arr).size != arr.size:
        raise ValueError(f"{side}: pool {name!r} names an item twice: {arr.tolist()}")
    return arr


def check_pool_items(pool_items: object, pools: dict, side: str) -> dict[str, np.ndarray]:
    """A request's {pool name: item indices}, validated against this rank's pools."""
    if pool_items is None:
        return {}
    if not isinstance(pool_items, dict):
        raise ValueError(f"{side}: pool_items must be a dict {{pool name: [items]}}, got {pool_items!r}")
    return {name: check_items(name, items, pools, side) for name, items in sorted(pool_items.items())}


prebuild_struct_info(globals())  # last: every Struct above is defined (see bootstrap.wire)
