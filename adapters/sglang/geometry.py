"""SGLang's KVArgs as kvstage's layout: what kvstage can take over, and what it refuses.

kvstage moves KV heads as bytes: the layout's element is one byte and its head_dim is the bytes
of one head (SGLang's item size / page size / local heads). Both sides of a transfer derive it
the same way, so any KV dtype SGLang uses (bf16, fp16, fp32, fp8) moves bit-exact; SGLang itself
checks that prefill and decode agree on kv_cache_dtype and page size before any transfer.

Speculative decoding: SGLang appends the draft model's KV entries after the target's
(`num_draft_entries` of them: draft K layers then draft V layers, or one latent per MTP layer of
an MLA model) and addresses them with the target's page indices. They become the layout's
`DraftKV` and the buffers' draft_k/draft_v. Their head count comes from the draft model's config
(server_args.speculative_draft_model_path, what SGLang sizes the draft's KV pool by), their head
bytes from their item sizes (`draft_kv`); a draft of another geometry than the target's moves
with each request's last piece (kvstage's DraftKV).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvstage import DraftKV, KVLayout

# draft algorithms whose draft is a model of its own (MHA, heads split over TP); any other draft
# beside an MLA target is the model's own MTP layers (latents, like the target's)
SEPARATE_DRAFT_MODELS = ("EAGLE3", "STANDALONE", "DFLASH", "DSPARK")


@dataclass(frozen=True, kw_only=True)
class Entries:
    """One KV set's pointer lists as KVArgs gives them (K layers then V layers; MLA: latents)."""

    ptrs: list
    items: list


def kv_entries(args) -> tuple[Entries, Entries | None]:
    """The target's entries and the draft model's (the last `num_draft_entries`; None: none)."""
    ptrs, items = list(args.kv_data_ptrs), list(args.kv_item_lens)
    n = int(getattr(args, "num_draft_entries", 0) or 0)
    if not 0 <= n < len(ptrs):
        raise ValueError(f"num_draft_entries {n} does not fit the {len(ptrs)} KV entries of KVArgs")
    cut = len(ptrs) - n
    target = Entries(ptrs=ptrs[:cut], items=items[:cut])
    return target, (Entries(ptrs=ptrs[cut:], items=items[cut:]) if n else None)


def kv_layout(args, attn_tp_size: int, attn_tp_rank: int, mla: bool, server_args=None, *, pp_size: int = 1,
              pp_rank: int = 0, decode: bool = False, dcp_size: int = 1, page_shards: int = 1) -> KVLayout:
    """SGLang's decode side does not fill kv_head_num/total_kv_head_num in KVArgs (its prefill
    side does): they then come from the model config, local heads as kvstage's layout defines.
    A PP prefill stage's KVArgs list only its layers, the first at `prefill_start_layer` of the
    model's (the decode side's) KV layers; the model's count comes from the last stage's end or,
    on the other stages, from the model config. A PP decode stage's KVArgs list only its layers
    too but name no start layer (SGLang's decode fills no prefill_start_layer): its stage is the
    one SGLang's model loader gives it, `get_pp_indices` of the model config's layer count.

    Decode context parallel: `dcp_size` is SGLang's attention DCP size (`attn_dcp_size`, the
    manager's `dcp_size`). SGLang's DCP groups are consecutive TP ranks (its DCP rank is
    `tp_rank % dcp_size`), as kvstage's (`KVLayout.dcp_rank`); each rank's KV entries hold one
    physical page of `page_size` of its own tokens per page index (KVArgs.page_size is the
    physical page size), so the item sizes map as without DCP.

    KV cache sharding: `page_shards` is the size of SGLang's KV shard group (the manager's
    `kv_shard_size`; for an MLA model its attention TP group): the rank's KV entries hold its
    local pages, and the page ids SGLang sends are the logical ones (KVLayout.page_shards)."""
    target, draft = kv_entries(args)
    ptrs, items = target.ptrs, target.items
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
    if pp_size > 1 and decode:
        num_layers = model_layers(server_args)
        stage = decode_stage(num_layers, pp_rank, pp_size)
        if len(stage) != layers:
            raise ValueError(f"decode PP stage {pp_rank} of {pp_size} holds layers [{stage.start}, {stage.stop}) of "
                             f"{num_layers} (get_pp_indices), but its KVArgs list {layers} layers")
    elif pp_size > 1:
        start = int(getattr(args, "prefill_start_layer", 0) or 0)
        stage = range(start, start + layers)
        num_layers = stage.stop if pp_rank == pp_size - 1 else model_layers(server_args)
    layout = KVLayout(num_layers=num_layers, total_kv_heads=total, head_dim=items[0] // (page * heads),
                      dtype=torch.uint8, page_size=page, tp_size=attn_tp_size, tp_rank=attn_tp_rank, mla=mla,
                      pp_size=pp_size, pp_rank=pp_rank, stage=stage, dcp_size=dcp_size, page_shards=page_shards)
    if draft is None:
        return layout
    heads = None if mla else draft_model_kv_heads(server_args)
    return replace(layout, draft=draft_kv(draft, layout, getattr(server_args, "speculative_algorithm", None), heads))


def draft_kv(draft: Entries, target: KVLayout, algorithm: str | None = None, heads: int | None = None) -> DraftKV:
    """The draft's geometry from its item sizes (bytes of one page of one layer on this rank) and,
    beside an MHA target, its global KV head count `heads` (the draft model's config).

    Beside an MLA target every entry moves whole like a latent: the model's own MTP layers, or a
    separate MHA draft model's K and V entries (this rank's share of its heads; equal attention
    TP sizes only, draft_equal_tp_only; `algorithm` no longer changes the mapping). Beside an
    MHA target: draft K layers then V layers; with `heads` known, a head's bytes are a token's over
    this rank's share of them (split over TP like the target's, replicated below one). Without
    it (no draft model path in the server args) sizes alone decide, which cannot tell every
    geometry apart: a token's bytes equal to the target's are the target's geometry (EAGLE and
    MTP drafts as a rule); otherwise the target's head bytes with its own head count (local heads
    x TP), failing that the target's head count with its own head bytes. Both sides derive it
    the same way, and kvstage compares the two drafts' geometry before pairing them."""
    items, page = draft.items, target.page_size
    if any(i != items[0] for i in items):
        raise ValueError(f"draft KV item sizes differ between entries ({sorted(set(items))}); kvstage needs one")
    if items[0] % page:
        raise ValueError(f"draft KV item size {items[0]} is not a whole number of bytes per token of {page}-token pages")
    token = items[0] // page
    if target.mla:
        # MTP layers: latents like the target's. A separate (MHA) draft model: each of its K and V
        # entries is this rank's share of the draft's heads, moved whole like a latent from the
        # prefill rank that writes this decode rank's latents; right at equal attention TP sizes
        # only (draft_equal_tp_only), as in SGLang's mooncake backend
        return DraftKV(num_layers=len(items), head_dim=None if token == target.head_dim else token)
    if len(items) % 2:
        raise ValueError(f"{len(items)} draft KV entries beside an MHA target: expected draft K layers then V layers")
    layers = len(items) // 2
    if heads is not None:
        local = max(1, heads // target.tp_size)
        if heads <= 0 or (heads % target.tp_size and target.tp_size % heads) or token % local:
            raise ValueError(f"draft KV of {token} bytes per token does not split into the draft model's {heads} KV "
                             f"heads over TP {target.tp_size} ({local} on this rank)")
        return DraftKV(num_layers=layers, total_kv_heads=heads, head_dim=token // local)
    if token == target.token_bytes:
        return DraftKV(num_layers=layers)
    if token % target.head_bytes == 0:
        return DraftKV(num_layers=layers, total_kv_heads=token // target.head_bytes * target.tp_size)
    if token % target.local_heads == 0:
        return DraftKV(num_layers=layers, head_dim=token // target.local_heads)
    raise ValueError(f"draft KV of {token} bytes per token fits neither the target's head bytes ({target.head_bytes}) "
                     f"nor its {target.local_heads} local heads")


def draft_equal_tp_only(args, mla: bool, server_args) -> str | None:
    """What of this rank's KV moves between equal attention TP sizes only (None: nothing): the KV
    of a separate draft model (EAGLE3, STANDALONE, DFLASH, DSPARK) beside an MLA target. Its
    entries hold this rank's share of the draft's heads, which kvstage moves whole, as one entry
    each like the target's latents, from the prefill rank that writes this decode rank's latents:
    that rank holds the same share only when both sides have the same attention TP size (the
    pairing SGLang's mooncake backend makes too). Across sizes the decode fails each request on
    both sides, naming it and both sizes."""
    algorithm = str(getattr(server_args, "speculative_algorithm", None) or "").upper()
    if not mla or not int(getattr(args, "num_draft_entries", 0) or 0) or algorithm not in SEPARATE_DRAFT_MODELS:
        return None
    return f"the KV of a separate draft model ({algorithm}) beside an MLA target"


def draft_model_kv_heads(server_args) -> int | None:
    """The draft model's global KV heads from its config, as SGLang sizes the draft's KV pool; None
    when the server args name no draft model (sizes alone decide then, see draft_kv)."""
    path = getattr(server_args, "speculative_draft_model_path", None)
    if not path:
        return None
    from sglang.srt.configs.model_config import ModelConfig
    try:
        config = ModelConfig.from_server_args(server_args, model_path=path, is_draft_model=True)
    except Exception as exc:  # noqa: BLE001 - said with the path; SGLang's own loading would fail alike
        raise ValueError(f"the draft model's config at {path!r} (speculative_draft_model_path) could not be read "
                         f"for its KV heads: {exc}") from exc
    return int(config.get_total_num_kv_heads())


def dsa_tail_slot_bytes(args, server_args) -> int | None:
    """Bytes of one slot of the DSA indexer's kpool-compress tail ring (StateType.DSA_TAIL): SGLang
    keeps index_head_dim bf16 values per slot and layer (DSATokenToKVPool), index_head_dim from the
    model config. None when KVArgs has no DSA tail or there are no server args to read it from."""
    types = [str(getattr(t, "value", t)) for t in getattr(args, "state_types", None) or []]
    if "dsa_tail" not in types or server_args is None:
        return None
    from sglang.srt.configs.model_config import ModelConfig, get_dsa_index_head_dim
    return int(get_dsa_index_head_dim(ModelConfig.from_server_args(server_args).hf_config)) * 2   # bf16


def model_kv_heads(server_args) -> int:
    if server_args is None:
        raise ValueError("KVArgs has no total_kv_head_num and no server args to read the model's from")
    from sglang.srt.configs.model_config import ModelConfig
    return int(ModelConfig.from_server_args(server_args).get_total_num_kv_heads())


def decode_stage(num_layers: int, pp_rank: int, pp_size: int) -> range:
    """A decode PP stage's layers, as SGLang's model loader splits them (its get_pp_indices,
    which honours SGLANG_PP_LAYER_PARTITION)."""
    from sglang.srt.distributed.utils import get_pp_indices
    start, end = get_pp_indices(num_layers, pp_rank, pp_size)
    return range(start, end)


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
    stages, _ = cp_stage(mgr)
    if stages > 1:   # a PP prefill or decode, or DSA cache layer split: each stage's ranks move its layers
        # (stage_mapping.py); DSA indexer pages are per MLA layer, pools bound to their layers (state.py):
        # each stage moves its own; a draft's KV is the last stage's (SGLang runs the draft worker there,
        # and sends it from the last CP rank under layer split), after its layers
        name = (f"DSA cache layer split (attn_cp_size {stages})" if layer_split(mgr)
                else f"pipeline parallelism (pp_size {stages})")
        others = sorted({str(getattr(st, "value", st)) for st in getattr(args, "state_types", None) or ()} - {"dsa"})
        if getattr(args, "kv_layer_ids", None):
            out.append(f"{name} with a hybrid KV pool (kv_layer_ids)")
        elif others:
            out.append(f"{name} with state components {others} (beside PP kvstage moves DSA indexer pages)")
    out += cp_problems(mgr)
    out += dcp_problems(mgr, args)
    out += shard_problems(mgr, args)
    state_tp = getattr(mgr, "state_tp_size", mgr.attn_tp_size)
    if getattr(args, "state_types", None) and state_tp != mgr.attn_tp_size:
        out.append(f"state laid out over {state_tp} ranks beside attention TP {mgr.attn_tp_size} (CP-TP group sharing)")
    if getattr(args, "kv_layout", None) is not None:
        out.append(f"KV layout {args.kv_layout!r} (kvstage moves token-major NHD pages)")
    server_args = getattr(mgr, "server_args", None)
    hisparse = bool(getattr(server_args, "enable_hisparse", False))
    if hisparse and getattr(args, "num_draft_entries", 0):
        out.append("HiSparse with speculative-decoding draft KV (the target's KV in host memory, the draft's "
                   "in device memory: kvstage's KV is one memory kind)")
    kinds = set(getattr(args, "kv_data_mem_kinds", None) or [])
    if len(kinds) > 1 or (kinds - {"VRAM"} and not hisparse
                          and str(getattr(server_args, "device", "cuda") or "cuda") != "cpu"):
        out.append(f"KV buffers in {'/'.join(sorted(kinds - {'VRAM'}))} memory beside a device KV cache "
                   f"(kv_data_mem_kinds)")
    if getattr(args, "host_kv_data_ptrs", None):
        if getattr(args, "state_types", None):
            out.append("host KV destinations (--disaggregation-decode-host-receive-threshold below 1) with state "
                       "components (SWA host pools)")
        if hisparse:
            out.append("host KV destinations with HiSparse")
    return out


def layer_split(mgr) -> bool:
    """Whether this is a prefill CP rank of SGLang's DSA cache layer split
    (`--enable-dsa-cache-layer-split`, GLM-5.2's DSA models): each attention CP rank holds a
    contiguous range of the model's layers (SGLang's get_layer_shard_range), its KVArgs list only
    those with `prefill_start_layer` at the first, and the last CP rank alone lists the draft's
    entries. kvstage serves it as a PP prefill whose stages are the CP ranks (`cp_stage`)."""
    mode = getattr(mgr, "disaggregation_mode", None)
    return (int(getattr(mgr, "attn_cp_size", 1) or 1) > 1 and str(getattr(mode, "value", mode)) == "prefill"
            and _layer_split_on(mgr))


def _layer_split_on(mgr) -> bool:
    """SGLang's resolved flag (its parallel state, which CommonKVManager reads), else the server args'."""
    try:
        from sglang.srt.runtime_context import get_parallel
        return bool(getattr(get_parallel(), "enable_dsa_cache_layer_split", False))
    except Exception:  # noqa: BLE001 - no parallel state published (a pure unit test's manager)
        return bool(getattr(getattr(mgr, "server_args", None), "enable_dsa_cache_layer_split", False))


def cp_stage(mgr) -> tuple[int, int]:
    """(PP size, PP rank) of the layout: SGLang's PP, or under DSA cache layer split the CP ranks
    as stages (their layer ranges tile the model in CP rank order; SGLang refuses layer split
    beside PP)."""
    if layer_split(mgr):
        return int(mgr.attn_cp_size), int(mgr.attn_cp_rank)
    return int(getattr(mgr, "pp_size", 1) or 1), int(getattr(mgr, "pp_rank", 0) or 0)


def cp_ranks_hold_copies(mgr) -> bool:
    """Whether every attention CP rank of this prefill holds the whole KV of its heads although
    SGLang has them all send (its `enable_all_cp_ranks_for_transfer`): only
    SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER asked for it, a split of the sending work, not
    of the KV (no hybrid MLA pool, DSA cache layer split or KV sharding, whose CP ranks hold
    parts). kvstage then moves the KV from CP rank 0 as without the variable: the bytes that
    arrive are the same."""
    server_args = getattr(mgr, "server_args", None)
    return (int(getattr(mgr, "attn_cp_size", 1) or 1) > 1
            and bool(getattr(mgr, "enable_all_cp_ranks_for_transfer", False))
            and not getattr(mgr, "is_hybrid_mla_backend", False)
            and not _layer_split_on(mgr)
            and int(getattr(mgr, "kv_shard_size", 1) or 1) <= 1
            and not getattr(server_args, "enable_cp_tp_group_sharing", False))


def cp_problems(mgr) -> list[str]:
    """What of a rank with attention context parallelism (SGLang's attn_cp_size above 1) kvstage
    does not serve, by name (empty: no CP, or a served one). Served: a prefill with CP where only
    CP rank 0 sends (SGLang's default for a plain pool: every CP rank holds the whole KV, so CP
    rank 0 moves it as a CP-1 prefill of attention TP ranks, and the other CP ranks are dummy
    senders, `is_dummy_cp_rank`, that succeed at their last send, as SGLang's own); the same
    with SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER, which splits the sending, not the KV
    (`cp_ranks_hold_copies`); DSA cache layer split, each CP rank a stage of its own layers
    (`layer_split`), with no state beyond the DSA indexer pages. Refused: every CP rank holding
    and sending its part of the pages otherwise (`enable_all_cp_ranks_for_transfer` for a hybrid
    MLA pool or KV sharding over CP), CP-TP group sharing, and CP on a decode (SGLang refuses it
    too)."""
    cp = int(getattr(mgr, "attn_cp_size", 1) or 1)
    if cp <= 1:
        return []
    name = f"context parallelism (attn_cp_size {cp})"
    mode = getattr(mgr, "disaggregation_mode", None)
    if str(getattr(mode, "value", mode)) != "prefill":
        return [f"{name} on a decode (SGLang's decode takes CP 1 only)"]
    out = []
    split = layer_split(mgr)
    if split and (getattr(mgr, "is_hybrid_mla_backend", False) or int(getattr(mgr, "kv_shard_size", 1) or 1) > 1):
        out.append(f"{name} with DSA cache layer split beside a hybrid MLA pool or KV sharding")
    elif getattr(mgr, "enable_all_cp_ranks_for_transfer", False) and not (cp_ranks_hold_copies(mgr) or split):
        out.append(f"{name} with every CP rank holding and sending its part of the pages (a hybrid MLA pool or KV "
                   f"sharding over CP): kvstage moves a CP prefill's KV from CP rank 0, or each CP rank's layers "
                   f"under DSA cache layer split")
    if getattr(getattr(mgr, "server_args", None), "enable_cp_tp_group_sharing", False):
        out.append(f"{name} with CP-TP group sharing (--enable-cp-tp-group-sharing)")
    return out


def shard_problems(mgr, args) -> list[str]:
    """What of a rank with KV cache sharding (SGLang's kv_shard_size above 1) kvstage does not
    serve, by name (empty: no sharding, or a sharded rank it serves). Served: an MLA model's
    prefill sharded over its whole attention TP group (SGLang's plain-TP MLA sharding), each
    page sent by the rank that owns it to a decode of the same attention TP size, the aux row
    with the last page (docs/protocol.md, "KV page sharding"; the layout's page_shards from
    kv_shard_size, SGLang's logical page ids passed as they are). The plugin lets SGLang's
    argument check accept the sharding for backend kvstage (plugin.around_kv_shard_checks);
    tests/sglang_adapter/test_kv_shard_classes.py moves it through SGLang's classes. Refused, by
    name: a shard group other than an MLA model's whole attention TP group (GQA shards over
    prefill CP, refused as CP too), state components or a hybrid pool (SGLang's sharded DSA
    indexer pages) and draft KV. Beside PP each stage's attention TP group shards its own
    layers' pages (page_shards.py)."""
    shards = int(getattr(mgr, "kv_shard_size", 1) or 1)
    if shards <= 1:
        return []
    name = f"KV cache sharding (kv_shard_size {shards})"
    out = []
    if not getattr(mgr, "is_mla_backend", False) or shards != mgr.attn_tp_size:
        out.append(f"{name} other than an MLA model's pages over its whole attention TP group "
                   f"(attention TP {mgr.attn_tp_size})")
    if getattr(args, "state_types", None) or getattr(args, "is_hybrid_mla_backend", False):
        out.append(f"{name} with state components or a hybrid KV pool (SGLang's sharded DSA indexer pages)")
    if int(getattr(args, "num_draft_entries", 0) or 0):
        out.append(f"{name} with speculative-decoding draft KV (num_draft_entries)")
    return out


def dcp_problems(mgr, args) -> list[str]:
    """What of a rank with decode context parallelism (SGLang's attn_dcp_size above 1) kvstage
    does not serve, by name (empty: no DCP, or a DCP rank it serves: a decode's, from a prefill
    of DCP 1 or of its own DCP size, and a prefill's, to a decode of its DCP size). kvstage's
    engine moves a DCP request direct, its KV and its pool items (SGLang's aux row is one;
    docs/protocol.md, "Decode context parallel"), a 1 -> N split relayouted through the
    prefill's staging buffers where it has them; the layout (kv_layout's dcp_size) and the
    request's token count (plugin.tell_*_tokens) are mapped, and the plugin lets SGLang's
    argument check accept decode DCP for backend kvstage (plugin.around_pd_checks);
    tests/sglang_adapter/test_dcp_classes.py moves both pairings through SGLang's classes. A
    pairing SGLang does not serve either (prefill DCP N -> decode DCP 1 or M) fails each request
    on both sides, naming both layouts. A hybrid MLA pool's Mamba slots (Kimi Linear: MLA
    layers beside linear-attention state) are pool items like the aux row, split over the decode's
    attention TP ranks by their heads, whatever its DCP. Refused, by name: a pool that is neither
    MLA nor hybrid MLA, a draft's KV (SGLang splits no draft entry), state components other than
    Mamba slots, a DCP rank that is not the attention TP rank mod dcp_size, host KV destinations
    and HiSparse. Beside PP (on either side) each prefill stage writes each DCP rank its layers of
    that rank's tokens. SGLang's staging flag is no problem: it turns kvstage's
    staging on, which on an MLA decode rank changes nothing (an MLA model moves direct) and gives
    its prefill the buffers a DCP split is relayouted through."""
    dcp = int(getattr(mgr, "dcp_size", 1) or 1)
    if dcp <= 1:
        return []
    name = f"decode context parallelism (dcp_size {dcp})"
    out = []
    if not (getattr(mgr, "is_mla_backend", False) or getattr(args, "is_hybrid_mla_backend", False)):
        out.append(f"{name} beside a non-MLA KV pool (SGLang serves DCP for MLA and hybrid MLA pools only)")
    others = sorted({str(getattr(st, "value", st)) for st in getattr(args, "state_types", None) or ()} - {"mamba"})
    if others:
        out.append(f"{name} with state components {others} (beside DCP kvstage moves Mamba slots, a hybrid MLA "
                   f"pool's, and the aux row)")
    if int(getattr(args, "num_draft_entries", 0) or 0):
        out.append(f"{name} with speculative-decoding draft KV (num_draft_entries; kvstage splits no draft "
                   f"under DCP)")
    if mgr.attn_tp_size % dcp or int(getattr(mgr, "dcp_rank", 0)) != mgr.attn_tp_rank % dcp:
        out.append(f"{name} whose DCP rank {getattr(mgr, 'dcp_rank', 0)} is not attention TP rank "
                   f"{mgr.attn_tp_rank} mod {dcp} (attention TP {mgr.attn_tp_size})")
    if getattr(args, "host_kv_data_ptrs", None):
        out.append(f"{name} with host KV destinations (host_kv_data_ptrs)")
    if getattr(getattr(mgr, "server_args", None), "enable_hisparse", False):
        out.append(f"{name} with HiSparse")
    return out


def kv_memory_device(server_args, args) -> str:
    """Where the KV buffers that KVArgs names live, as a torch device: SGLang's device, except
    with HiSparse, whose decode KV (the pool it hands the transfer backend) is its host pool."""
    if getattr(server_args, "enable_hisparse", False):
        return "cpu"
    return device_of(server_args, args)
