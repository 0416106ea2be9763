"""vLLM's per-layer KV tensors (`register_kv_caches`) as kvstage buffers, without a copy, and
what the connector refuses at start. Pure apart from reading the tensors' shapes.

Recognised (B blocks of S tokens, H local KV heads of D elements):
- CPU attention: one tensor [B, H, S, 2D] per layer (K and V fused per head): HND_KV_FUSED;
- FlashAttention: [2, B, S, H, D] (K = [0], V = [1]): NHD; with the HND cache layout
  [2, B, H, S, D]: HND;
- MLA: [B, S, D] (one latent head): NHD, MLA.
FlashInfer's [B, 2, ...] interleaves K and V per block (neither is one contiguous tensor) and is
refused, as is any other shape, naming it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstage.transfer.kv_buffers import SUPPORTED_DTYPES, KVBuffers
from kvstage.transfer.layout import KVLayout
from kvstage.transfer.page_format import PageFormat
from kvstage.transfer.page_layouts import EngineCache

SUPPORTED_SPECS = ("FullAttentionSpec", "MLAAttentionSpec")


@dataclass(frozen=True, kw_only=True)
class ModelGeometry:
    """What the model and the parallel config say, before any tensor is seen."""

    num_layers: int
    total_kv_heads: int
    local_heads: int
    head_dim: int
    block_size: int
    tp_size: int
    tp_rank: int
    mla: bool


def unsupported_features(*, kv_cache_groups: list | None, pipeline_parallel: int, data_parallel: int,
                         kv_role: str) -> list[str]:
    """Everything about this deployment the connector does not support, each naming it
    (`kv_cache_groups` None: not known in this process)."""
    problems = []
    kv_cache_groups = list(kv_cache_groups) if kv_cache_groups is not None else []
    if len(kv_cache_groups) > 1:
        problems.append(f"hybrid (HMA) models: this model has {len(kv_cache_groups)} KV cache groups "
                        f"(sliding window, Mamba or mixed attention); the kvstage connector moves one full-attention cache")
    for g in kv_cache_groups:
        spec = type(getattr(g, "kv_cache_spec", None)).__name__
        if spec not in SUPPORTED_SPECS:
            problems.append(f"KV cache spec {spec} (supported: {', '.join(SUPPORTED_SPECS)})")
    if pipeline_parallel != 1:
        problems.append(f"pipeline parallelism ({pipeline_parallel} stages)")
    if data_parallel != 1:
        problems.append(f"data parallelism ({data_parallel} ranks): run one instance per DP rank")
    if kv_role not in ("kv_producer", "kv_consumer"):
        problems.append(f"kv_role {kv_role!r} (use kv_producer on prefill instances, kv_consumer on decode)")
    return problems


def engine_cache(geo: ModelGeometry, kv_caches: dict[str, torch.Tensor]) -> tuple[EngineCache, KVBuffers]:
    """The page format of vLLM's tensors and kvstage buffers over them. ValueError naming the
    layer, shape or dtype that is not supported."""
    if len(kv_caches) != geo.num_layers:
        raise ValueError(f"vLLM registered {len(kv_caches)} KV cache tensors for a model of {geo.num_layers} layers "
                         f"(shared or cross-layer KV caches are not supported by the kvstage connector)")
    tensors = list(kv_caches.values())
    first = tensors[0]
    if first.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"KV cache dtype {first.dtype} is not supported by the kvstage connector "
                         f"(supported: {', '.join(SUPPORTED_DTYPES.values())})")
    fmt, split = _format_of(geo, tuple(first.shape))
    ks, vs = [], []
    for name, t in kv_caches.items():
        if tuple(t.shape) != tuple(first.shape) or t.dtype != first.dtype:
            raise ValueError(f"KV cache of layer {name} is {tuple(t.shape)} {t.dtype}, the first layer's "
                             f"{tuple(first.shape)} {first.dtype}: the kvstage connector needs one shape for all layers")
        k, v = split(t)
        ks.append(k)
        if v is not None:
            vs.append(v)
    eng = EngineCache(page_format=fmt, num_layers=geo.num_layers, total_kv_heads=geo.total_kv_heads,
                      head_dim=geo.head_dim, dtype=first.dtype, block_size=geo.block_size, tp_size=geo.tp_size,
                      tp_rank=geo.tp_rank, mla=geo.mla)
    return eng, eng.buffers(ks, vs or None)


def _format_of(geo: ModelGeometry, shape: tuple[int, ...]):
    H, S, D = geo.local_heads, geo.block_size, geo.head_dim
    if geo.mla:
        if len(shape) == 3 and shape[1:] == (S, D):
            return PageFormat.NHD, lambda t: (t.view(-1, 1, D), None)
        raise ValueError(f"MLA KV cache shape {shape} is not supported by the kvstage connector "
                         f"(supported: [num_blocks, {S}, {D}])")
    if len(shape) == 4 and shape[1:] == (H, S, 2 * D):
        return PageFormat.HND_KV_FUSED, lambda t: (t, None)
    if len(shape) == 5 and shape[0] == 2 and shape[2:] == (S, H, D):
        return PageFormat.NHD, lambda t: (t[0].view(-1, H, D), t[1].view(-1, H, D))
    if len(shape) == 5 and shape[0] == 2 and shape[2:] == (H, S, D):
        return PageFormat.HND, lambda t: (t[0], t[1])
    if len(shape) == 5 and shape[1] == 2:
        raise ValueError(f"KV cache shape {shape} (FlashInfer's [num_blocks, 2, ...]: K and V interleaved per block) "
                         f"is not supported by the kvstage connector; use the FlashAttention or CPU backend")
    raise ValueError(f"KV cache shape {shape} is not supported by the kvstage connector (supported, with "
                     f"{H} local KV heads of {D} and blocks of {S}: CPU [num_blocks, {H}, {S}, {2 * D}], "
                     f"FlashAttention [2, num_blocks, {S}, {H}, {D}] or [2, num_blocks, {H}, {S}, {D}], "
                     f"MLA [num_blocks, {S}, head_dim])")


def describe(layout: KVLayout) -> str:
    return (f"{layout.page_format.value}, {layout.num_layers} layers, {layout.local_heads}/{layout.total_kv_heads} "
            f"KV heads, TP {layout.tp_rank}/{layout.tp_size}")
