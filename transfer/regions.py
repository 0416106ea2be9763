"""A rank's memory as regions: the KV layers, and each state pool, each with its own device and
memory kind (DRAM for host memory, VRAM for CUDA memory).

On a GPU server the KV cache is device memory while the rows that go with a request (SGLang's
MetadataBuffers) are host memory: each region is registered with the backend under its own kind,
advertised to peers with it, and no backend write ever mixes kinds (docs/protocol.md, "Regions
and memory kinds"). The checks here are pure: they take kinds and return what is wrong.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .backends.base import MemRegion
from .protocol.hello_admission import KV_REGION, pool_region_name

if TYPE_CHECKING:
    from .kv_buffers import KVBuffers


@dataclass(frozen=True, kw_only=True)
class Region:
    """One region of a rank's memory: what it is called in errors, where it lives, its spans."""

    name: str                       # "kv", or "pool 'aux'"
    device: torch.device
    kind: str                       # "DRAM" or "VRAM"
    spans: tuple[MemRegion, ...]    # one per tensor, registered together

    @property
    def nbytes(self) -> int:
        return sum(s.length for s in self.spans)


def _spans(tensors: Sequence[torch.Tensor], device: torch.device, kind: str) -> tuple[MemRegion, ...]:
    index = (device.index or 0) if kind == "VRAM" else 0
    return tuple(
        MemRegion(addr=t.data_ptr(), length=t.numel() * t.element_size(), device=index, kind=kind) for t in tensors
    )


def buffer_regions(buffers: KVBuffers) -> list[Region]:
    """The KV region, then one region per state pool (pools by name) of validated KVBuffers."""
    kv = Region(
        name=KV_REGION,
        device=buffers.device,
        kind=buffers.kind,
        spans=_spans(buffers.tensors(), buffers.device, buffers.kind),
    )
    pools = [
        Region(name=pool_region_name(n), device=p.device, kind=p.kind, spans=_spans(p.tensors, p.device, p.kind))
        for n, p in sorted(buffers.pools.items())
    ]
    return [kv] + pools


def unregistrable(regions: Sequence[Region], kinds: Sequence[str], backend: str) -> str | None:
    """Why this rank's regions cannot be registered with a backend that handles `kinds`, or None."""
    for r in regions:
        if r.kind not in kinds:
            return (
                f"the {r.name} region is {r.kind} memory (on {r.device}), which this {backend} build cannot "
                f"register (it handles {', '.join(kinds)})"
            )
    return None
