"""Kernels ready before the first request: while the manager starts, run the gather/scatter
kernels a layout will need once, so Triton compiles them (or loads them from its on-disk cache)
then and not inside the first staged request (on the H100 that request took 3.58 s, the
second 11.8 ms: docs/bench/gpu-h100-2026-11-27.md).

`warm_variants` is the decision, pure: which launches make every kernel variant a layout can
use. The Triton kernel is specialised on its direction, its tile (from the span of the head
range: `triton_kernels.tile_shape`) and on its integer arguments' values (Triton specialises an
int that is 1 or a multiple of 16). A prefill rank gathers, a decode rank scatters, each a head
range of any size that divides its local heads (the split a peer of another TP size asks for),
starting at head 0 or further in, for one page or several. On the torch kernels (every CPU
cache, and KVSTAGE_STAGING_KERNELS=torch) there is nothing to build: no variants.

`warm_kernels` is the shell: it runs each variant on the rank's own cache, a gather of a few
pages into a scratch region and (decode) the scatter of that same region back into the same
pages, which leaves every byte as it was. Call it before the rank takes requests.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..transfer.protocol.kinds import Role
from .kernels import KernelChoice, kernel_choice, make_gatherer, make_scatterer

WARM_PAGES = (1, 3)      # one page (ints of 1) and a few (neither 1 nor a multiple of 16)


@dataclass(frozen=True, kw_only=True)
class WarmVariant:
    gather: bool           # True: gather, False: scatter (which runs after the gather of its region)
    heads: tuple[int, int]
    pages: int


def warm_variants(*, role: str, local_heads: int, num_pages: int, kernels: KernelChoice,
                  device_type: str) -> tuple[WarmVariant, ...]:
    """The launches that build every kernel variant a rank of `role` with `local_heads` heads
    per token can use; none for the torch kernels, a cache of no pages, or a cache off CUDA
    (Triton on the CPU is its interpreter: nothing is compiled)."""
    if kernels != KernelChoice.TRITON or device_type != "cuda" or num_pages < 1 or local_heads < 1:
        return ()
    out = []
    for n in (d for d in range(local_heads, 0, -1) if local_heads % d == 0):
        for h0 in sorted({0, n} if 2 * n <= local_heads else {0}):
            for pages in sorted({min(p, num_pages) for p in WARM_PAGES}):
                out.append(WarmVariant(gather=True, heads=(h0, h0 + n), pages=pages))
                if role == Role.DECODE:
                    out.append(WarmVariant(gather=False, heads=(h0, h0 + n), pages=pages))
    return tuple(out)


def warm_kernels(*, role: str, k: Sequence[torch.Tensor], v: Sequence[torch.Tensor] | None, page_size: int,
                 local_heads: int, num_pages: int, region_bytes: int) -> tuple[int, float]:
    """Run every variant (warm_variants) on this cache; returns (launches, seconds). Nothing on
    the torch kernels. `region_bytes`: bytes of one page's region of all local heads."""
    device = k[0].device
    variants = warm_variants(role=role, local_heads=local_heads, num_pages=num_pages, kernels=kernel_choice(device),
                             device_type=device.type)
    if not variants:
        return 0, 0.0
    t0 = time.perf_counter()
    gatherer, scatterer = make_gatherer(device), make_scatterer(device) if role == Role.DECODE else None
    region = torch.empty(region_bytes * max(v.pages for v in variants), dtype=torch.uint8, device=device)
    for var in variants:
        pages = list(range(var.pages))
        if var.gather:
            gatherer.gather(k, v, pages, page_size, var.heads, region)
        elif scatterer is not None:
            # the region holds what the gather of the same pages and heads just read: the
            # scatter writes every byte back as it was
            gatherer.gather(k, v, pages, page_size, var.heads, region)
            scatterer.scatter(region, k, v, pages, page_size, var.heads)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return len(variants), time.perf_counter() - t0
