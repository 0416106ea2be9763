"""An engine's paged KV cache as the engine lays it out (`EngineCache`), turned into kvstage's
layout and buffers as views of the same memory (never a copy). Pure: arithmetic and views.

For a head-major page format (page_format.py), kvstage's layout has page_size 1 and a "head
row" of page_size x head_dim elements (x2 with K/V fused): rank r's heads [h0, h1) of one page
are then ONE contiguous run, so a hetero-TP head split writes one descriptor per page and tensor
(token-major: one per token), and the staging gather moves whole head pages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .kv_buffers import KVBuffers
from .layout import KVLayout
from .page_format import PageFormat, parse_page_format
from .state_pools import StatePool


@dataclass(frozen=True, kw_only=True)
class EngineCache:
    """One rank's KV-cache geometry in the engine's own terms: `block_size` tokens per page,
    `head_dim` elements per head and token (per K or V), `page_format` the per-layer shapes."""

    page_format: PageFormat
    num_layers: int
    total_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int
    tp_size: int
    tp_rank: int
    mla: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "page_format", parse_page_format(self.page_format))

    def kv_layout(self) -> KVLayout:
        """kvstage's layout of this cache (ValueError naming the field if it is not valid)."""
        fmt = self.page_format
        if not fmt.head_major:
            return KVLayout(num_layers=self.num_layers, total_kv_heads=self.total_kv_heads, head_dim=self.head_dim,
                            dtype=self.dtype, page_size=self.block_size, tp_size=self.tp_size,
                            tp_rank=self.tp_rank, mla=self.mla)
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {self.block_size!r}")
        if isinstance(self.head_dim, bool) or not isinstance(self.head_dim, int) or self.head_dim <= 0:
            raise ValueError(f"head_dim must be a positive int, got {self.head_dim!r}")
        row = self.block_size * self.head_dim * (2 if fmt.kv_fused else 1)
        return KVLayout(num_layers=self.num_layers, total_kv_heads=self.total_kv_heads, head_dim=row,
                        dtype=self.dtype, page_size=1, tp_size=self.tp_size, tp_rank=self.tp_rank, mla=self.mla,
                        page_format=fmt)

    def tensor_shape(self, num_blocks: int) -> tuple[int, ...]:
        """The engine's per-layer tensor shape (each of K and V, or the fused one)."""
        heads = self.kv_layout().local_heads
        if self.page_format is PageFormat.NHD:
            return (num_blocks * self.block_size, heads, self.head_dim)
        width = self.head_dim * (2 if self.page_format.kv_fused else 1)
        return (num_blocks, heads, self.block_size, width)

    def buffers(self, k: Sequence[torch.Tensor], v: Sequence[torch.Tensor] | None = None,
                pools: dict[str, StatePool] | None = None) -> KVBuffers:
        """kvstage's buffers over the engine's per-layer tensors, as views (no copy), validated.
        K/V-fused and MLA caches pass the one tensor per layer as `k` and no `v`."""
        layout = self.kv_layout()
        groups = [("k", k)] + ([("v", v)] if v is not None else [])
        views: dict[str, list[torch.Tensor]] = {}
        for name, tensors in groups:
            if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
                raise ValueError(f"{name} must be a sequence of per-layer tensors")
            views[name] = [self._view(f"{name}[{i}]", t, layout) for i, t in enumerate(tensors)]
        return KVBuffers(views["k"], views.get("v"), pools=pools or {}).validate(layout)

    def _view(self, where: str, t: torch.Tensor, layout: KVLayout) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{where} is {type(t).__name__}, expected a torch.Tensor")
        if not self.page_format.head_major:
            return t
        want = self.tensor_shape(1)[1:]
        if t.dim() != 4 or tuple(t.shape[1:]) != want:
            raise ValueError(f"{where} has shape {tuple(t.shape)}, expected [num_blocks, {', '.join(map(str, want))}] "
                             f"for page format {self.page_format.value}")
        if not t.is_contiguous():
            raise ValueError(f"{where} is not contiguous")
        return t.view(t.shape[0], layout.local_heads, layout.head_dim)
