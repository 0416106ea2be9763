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

from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING

import torch

from .draft_kv import draft_pool_name
from .pool_spec import SHARDINGS, PoolSpec

if TYPE_CHECKING:
    from .layout import KVLayout

__all__ = ["StatePool", "draft_pools", "memory_kind"]


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
    layer: int | None = None    # the model layer the pool belongs to (per-layer state under PP: a stage
                                # registers the pools of its own layers only); None: the request's
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

    def spec(self, name: str, layout: KVLayout) -> PoolSpec:
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
        layer = -1 if self.layer is None else self.layer
        stage = range(layout.layers.start, min(layout.layers.stop, layout.num_layers))   # its model layers
        if isinstance(layer, bool) or not isinstance(layer, int) or not (self.layer is None or layer in stage):
            raise ValueError(f"{where}: layer must be None or a model layer of this rank's stage "
                             f"[{stage.start}, {stage.stop}), got {self.layer!r}")
        if not isinstance(self.own_writes, bool):
            raise ValueError(f"{where}: own_writes must be a bool, got {self.own_writes!r}")
        items: int | None = None
        dtypes: list[str] = []
        rows: list[list[int]] = []
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
        assert items is not None   # the tensors are a non-empty list, each checked above
        self.num_items = int(items)
        return PoolSpec(name=name, sharding=self.sharding, heads=heads, dtypes=dtypes, rows=rows, blocks=blocks,
                        layer=layer)

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


def draft_pools(heads: int, draft_k: Sequence[torch.Tensor],
                draft_v: Sequence[torch.Tensor] | None, last_layer: int) -> dict[str, StatePool]:
    """One heads pool per draft entry of its own geometry: its K (and V) tensor, as the caller
    gives it ([num_pages * page_size, local draft heads, draft head_dim]): dim 0 is the token
    slot (the pool's item), dim 1 the rank's share of the draft's `heads` global heads. Each is
    bound to the model's `last_layer`, where the draft lives (the last PP stage), so only the
    writes of that layer carry it, to the decode rank holding that layer."""
    vs = list(draft_v) if draft_v is not None else [None] * len(draft_k)
    return {draft_pool_name(i): StatePool(tensors=[k] + ([v] if v is not None else []), sharding="heads",
                                          heads=heads, layer=last_layer)
            for i, (k, v) in enumerate(zip(draft_k, vs))}
