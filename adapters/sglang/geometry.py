"""SGLang's KVArgs as kvstage's layout: what kvstage can take over, and what it refuses.

kvstage moves KV heads as bytes: the layout's element is one byte and its head_dim is the bytes
of one head (SGLang's item size / page size / local heads). Both sides of a transfer derive it
the same way, so any KV dtype SGLang uses (bf16, fp16, fp32, fp8) moves bit-exact; SGLang itself
checks that prefill and decode agree on kv_cache_dtype and page size before any transfer.
"""

from __future__ import annotations

import torch

from kvstage import KVLayout


def kv_layout(args, attn_tp_size: int, attn_tp_rank: int, mla: bool, server_args=None, *, pp_size: int = 1,
              pp_rank: int = 0) -> KVLayout:
    """SGLang's decode side does not fill kv_head_num/total_kv_head_num in KVArgs (its prefill
    side does): they then come from the model config, local heads as kvstage's layout defines.
    A PP prefill stage's KVArgs list only its layers, the first at `prefill_start_layer` of the
    model's (the decode side's) KV layers; the model's count comes from the last stage's end or,
    on the other stages, from the model config."""
    ptrs, items = list(args.kv_data_ptrs), list(args.kv_item_lens)
    page = int(args.page_size)
    if mla:
        layers, heads, total = len(ptrs), 1, 1
    else:
        if len(ptrs) % 2:
            raise ValueError(f"KVArgs lists {len(ptrs)} KV buffers; expected K layers then V layers")
        total = getattr(args, "total_kv_head_num", None) or model_kv_heads(server_args)
        heads = getattr(args, "kv_head_num", None) or max(1, total // attn_tp_size)
        layers, heads, total = len(ptrs) // 2, int(heads), int(total)
    if not items or any(i != items[0] for i in items):
        raise ValueError(f"KV item sizes differ between layers ({sorted(set(items))}); kvstage needs one")
    if items[0] % (page * heads):
        raise ValueError(f"KV item size {items[0]} is not page_size {page} x {heads} heads x head bytes")
    stage, num_layers = None, layers
    if pp_size > 1:
        start = int(getattr(args, "prefill_start_layer", 0) or 0)
        stage = range(start, start + layers)
        num_layers = stage.stop if pp_rank == pp_size - 1 else model_layers(server_args)
    return KVLayout(num_layers=num_layers, total_kv_heads=total, head_dim=items[0] // (page * heads),
                    dtype=torch.uint8, page_size=page, tp_size=attn_tp_size, tp_rank=attn_tp_rank, mla=mla,
                    pp_size=pp_size, pp_rank=pp_rank, stage=stage)


def model_kv_heads(server_args) -> int:
    if server_args is None:
        raise ValueError("KVArgs has no total_kv_head_num and no server args to read the model's from")
    from sglang.srt.configs.model_config import ModelConfig
    return int(ModelConfig.from_server_args(server_args).get_total_num_kv_heads())


def model_layers(server_args) -> int:
    """The model's KV layers, as a decode rank (without PP) lists them."""
    if server_args is None:
        raise ValueError("a PP stage before the last needs the model's layer count: no server args to read it from")
    from sglang.srt.configs.model_config import ModelConfig
    return int(ModelConfig.from_server_args(server_args).num_hidden_layers)


def device_of(server_args, args) -> str:
    device = str(getattr(server_args, "device", None) or "cuda")
    if device.startswith("cuda"):
        return f"cuda:{int(getattr(args, 'gpu_id', 0) or 0)}"
    if device == "cpu":
        return "cpu"
    raise NotImplementedError(f"the kvstage backend runs on cpu or cuda, not {device}")


def unsupported_features(mgr, args) -> list[str]:
    """SGLang features this backend does not handle yet, by name (empty: all fine)."""
    out = []
    if mgr.pp_size > 1:
        mode = getattr(mgr, "disaggregation_mode", None)
        if str(getattr(mode, "value", mode)) != "prefill":
            out.append(f"pipeline parallelism on the decode side (pp_size {mgr.pp_size}; a PP prefill is "
                       f"supported: run the decode with --pp-size 1)")
        elif getattr(args, "kv_layer_ids", None) or getattr(args, "state_types", None):
            out.append(f"pipeline parallelism (pp_size {mgr.pp_size}) with a hybrid KV pool or state components")
    if mgr.attn_cp_size > 1:
        out.append(f"context parallelism (attn_cp_size {mgr.attn_cp_size})")
    if getattr(mgr, "dcp_size", 1) and getattr(mgr, "dcp_size", 1) > 1:
        out.append(f"decode context parallelism (dcp_size {mgr.dcp_size})")
    if mgr.kv_shard_size > 1:
        out.append("KV cache sharding")
    if mgr.defer_decode_allocation:
        out.append("--disaggregation-decode-allocation-policy prefill_complete")
    if getattr(args, "num_draft_entries", 0):
        out.append("speculative decoding draft KV (num_draft_entries)")
    state_tp = getattr(mgr, "state_tp_size", mgr.attn_tp_size)
    if getattr(args, "state_types", None) and state_tp != mgr.attn_tp_size:
        out.append(f"state laid out over {state_tp} ranks beside attention TP {mgr.attn_tp_size} (CP-TP group sharing)")
    if getattr(args, "kv_layout", None) is not None:
        out.append(f"KV layout {args.kv_layout!r} (kvstage moves token-major NHD pages)")
    server_args = getattr(mgr, "server_args", None)
    if getattr(server_args, "enable_hisparse", False):
        out.append("HiSparse (--enable-hisparse: the decode KV is host memory, kvstage would take it for device memory)")
    kinds = sorted(set(getattr(args, "kv_data_mem_kinds", None) or []) - {"VRAM"})
    if kinds and str(getattr(server_args, "device", "cuda") or "cuda") != "cpu":
        out.append(f"KV buffers in {'/'.join(kinds)} memory beside a device KV cache (kv_data_mem_kinds)")
    if getattr(args, "host_kv_data_ptrs", None):
        out.append("host KV destinations (--disaggregation-decode-host-receive-threshold below 1)")
    return out
