"""The SGLang adapter's pure parts, without SGLang installed: the enum member, the staging
switch hand-over, SGLang's variables mapped onto EngineConfig, and KVArgs -> kvstage layout (the SGLang-facing classes are tested in
tests/sglang_adapter by `make test-sglang`)."""

from __future__ import annotations

import enum
import os
from types import SimpleNamespace

import pytest
import torch

from kvstage.adapters.sglang import plugin, prefill_complete
from kvstage.adapters.sglang.geometry import kv_layout, kv_memory_device, unsupported_features


@pytest.fixture(autouse=True)
def staging_variables_restored():
    """take_staging_flag writes os.environ itself (as in SGLang's process): whatever a test
    leaves in the staging and ring variables is put back as it was, so no later test inherits it."""
    names = (plugin.STAGING_ENV, plugin.SGLANG_STAGING_ENV, plugin.SGLANG_RING_MB_ENV)
    before = {n: os.environ.get(n) for n in names}
    yield
    for n, v in before.items():
        if v is None:
            os.environ.pop(n, None)
        else:
            os.environ[n] = v


class Backend(enum.Enum):
    MOONCAKE = "mooncake"
    NIXL = "nixl"


def test_enum_member_added_in_place_and_idempotent():
    plugin.add_enum_member(Backend, "KVSTAGE", "kvstage")
    plugin.add_enum_member(Backend, "KVSTAGE", "kvstage")
    assert Backend("kvstage") is Backend.KVSTAGE and Backend["KVSTAGE"] is Backend.KVSTAGE
    assert [m.value for m in Backend] == ["mooncake", "nixl", "kvstage"]
    assert plugin.is_kvstage(Backend.KVSTAGE) and plugin.is_kvstage("kvstage")
    assert not plugin.is_kvstage(Backend.NIXL)


@pytest.mark.parametrize("flag,want", [("1", "1"), ("true", "1"), ("0", "0"), ("off", "0")])
def test_staging_flag_moves_to_kvstage_for_backend_kvstage(monkeypatch, flag, want):
    monkeypatch.delenv(plugin.STAGING_ENV, raising=False)
    monkeypatch.setenv(plugin.SGLANG_STAGING_ENV, flag)
    plugin.take_staging_flag(SimpleNamespace(disaggregation_transfer_backend="kvstage"))
    assert plugin.SGLANG_STAGING_ENV not in os.environ      # SGLang neither refuses nor acts on it
    assert os.environ[plugin.STAGING_ENV] == want
    assert plugin.engine_options()["staging"] is (want == "1")


def test_staging_flag_left_alone_for_other_backends(monkeypatch):
    monkeypatch.delenv(plugin.STAGING_ENV, raising=False)
    monkeypatch.setenv(plugin.SGLANG_STAGING_ENV, "1")
    plugin.take_staging_flag(SimpleNamespace(disaggregation_transfer_backend="mooncake"))
    assert os.environ[plugin.SGLANG_STAGING_ENV] == "1" and plugin.STAGING_ENV not in os.environ


SGLANG_AND_KVSTAGE_ENVS = (plugin.STAGING_ENV, plugin.SGLANG_STAGING_ENV, plugin.SGLANG_RING_MB_ENV,
                           "KVSTAGE_STAGING", "KVSTAGE_RING_MB")


@pytest.mark.parametrize("moved", [False, True], ids=["as-set", "moved-by-sglang"])
def test_sglang_variables_become_engine_config_arguments(monkeypatch, moved):
    """SGLang's staging switch and ring size reach the engine as EngineConfig's `staging` and
    `ring_mb` (the core reads only KVSTAGE_*): set, whether or not SGLang's argument handling
    moved the switch first; unset, left to kvstage's own variables."""
    from kvstage.transfer.config import EngineConfig

    for name in SGLANG_AND_KVSTAGE_ENVS:
        monkeypatch.delenv(name, raising=False)
    base = dict(role="decode", engine_id="e", bootstrap="127.0.0.1:8998")
    assert plugin.engine_options() == {}
    r = EngineConfig(**base).resolved()
    assert (r.staging, r.ring_mb) == (False, 256.0)
    monkeypatch.setenv(plugin.SGLANG_STAGING_ENV, "1")
    monkeypatch.setenv(plugin.SGLANG_RING_MB_ENV, "16")
    if moved:
        plugin.take_staging_flag(SimpleNamespace(disaggregation_transfer_backend="kvstage"))
    assert plugin.engine_options() == {"staging": True, "ring_mb": 16.0}
    r = EngineConfig(**base, **plugin.engine_options()).resolved()
    assert (r.staging, r.ring_mb) == (True, 16.0)
    monkeypatch.setenv("KVSTAGE_RING_MB", "32")                  # SGLang's name wins in SGLang
    assert EngineConfig(**base, **plugin.engine_options()).resolved().ring_mb == 16.0
    monkeypatch.delenv(plugin.SGLANG_RING_MB_ENV)
    assert EngineConfig(**base, **plugin.engine_options()).resolved().ring_mb == 32.0


@pytest.mark.parametrize("raw", ["nan", "0", "-3", "x", "inf"])
def test_a_bad_sglang_ring_size_names_sglangs_variable(monkeypatch, raw):
    monkeypatch.setenv(plugin.SGLANG_RING_MB_ENV, raw)
    with pytest.raises(ValueError, match=plugin.SGLANG_RING_MB_ENV):
        plugin.engine_options()


def kv_args(layers=3, heads=2, total=8, page=16, head_bytes=256, **kw):
    item = page * heads * head_bytes
    return SimpleNamespace(kv_data_ptrs=[4096 * (i + 1) for i in range(2 * layers)],
                           kv_item_lens=[item] * (2 * layers), page_size=page, kv_head_num=heads,
                           total_kv_head_num=total, **kw)


def test_layout_from_kv_args_moves_heads_as_bytes():
    lay = kv_layout(kv_args(), attn_tp_size=4, attn_tp_rank=3, mla=False)
    assert (lay.num_layers, lay.total_kv_heads, lay.local_heads, lay.head_dim, lay.dtype) == (3, 8, 2, 256,
                                                                                               torch.uint8)
    assert (lay.tp_size, lay.tp_rank, lay.page_size, lay.mla) == (4, 3, 16, False)


def test_layout_of_a_pp_prefill_stage_holds_its_layers_of_the_model(monkeypatch):
    """Stage 1 of 2 lists layers [3, 6) of 6 (prefill_start_layer 3): the last stage's end is
    the model's count; an earlier stage reads it from the model config."""
    last = kv_layout(kv_args(layers=3, prefill_start_layer=3), attn_tp_size=4, attn_tp_rank=1, mla=False,
                     pp_size=2, pp_rank=1)
    assert (last.num_layers, last.layers, last.rank, last.ranks) == (6, range(3, 6), 5, 8)
    from kvstage.adapters.sglang import geometry
    monkeypatch.setattr(geometry, "model_layers", lambda server_args: 6)
    first = kv_layout(kv_args(layers=3, prefill_start_layer=0), attn_tp_size=4, attn_tp_rank=1, mla=False,
                      pp_size=2, pp_rank=0)
    assert (first.num_layers, first.layers, first.rank) == (6, range(0, 3), 1)
    with pytest.raises(ValueError, match="PP stage 0 must start at layer 0"):
        kv_layout(kv_args(layers=3, prefill_start_layer=1), attn_tp_size=4, attn_tp_rank=1, mla=False,
                  pp_size=2, pp_rank=0)


def test_layout_of_a_pp_decode_stage_is_the_model_loaders_split(monkeypatch):
    """A decode stage's KVArgs name no start layer: its stage is SGLang's get_pp_indices split of
    the model's layers (here 7 layers over 2 stages: [0, 3) and [3, 7)); KVArgs listing another
    count are refused, naming both."""
    from kvstage.adapters.sglang import geometry
    monkeypatch.setattr(geometry, "model_layers", lambda server_args: 7)
    monkeypatch.setattr(geometry, "decode_stage", lambda n, rank, size: [range(0, 3), range(3, 7)][rank])
    second = kv_layout(kv_args(layers=4), attn_tp_size=2, attn_tp_rank=1, mla=False, pp_size=2, pp_rank=1,
                       decode=True)
    assert (second.num_layers, second.layers, second.rank, second.ranks) == (7, range(3, 7), 3, 4)
    with pytest.raises(ValueError, match=r"holds layers \[0, 3\) of 7 \(get_pp_indices\), but its KVArgs list 4"):
        kv_layout(kv_args(layers=4), attn_tp_size=2, attn_tp_rank=1, mla=False, pp_size=2, pp_rank=0, decode=True)


def test_layout_mla_is_one_latent_per_layer():
    args = SimpleNamespace(kv_data_ptrs=[1, 2, 3], kv_item_lens=[16 * 576 * 2] * 3, page_size=16)
    lay = kv_layout(args, attn_tp_size=2, attn_tp_rank=0, mla=True)
    assert (lay.num_layers, lay.total_kv_heads, lay.head_dim, lay.mla) == (3, 1, 1152, True)


def test_layout_with_decode_context_parallel_is_the_dcp_group_of_attention_tp():
    """SGLang's KVArgs under DCP: page_size is the physical page (each rank's page of its own
    tokens), so the latent's bytes map as without DCP; the DCP rank is the attention TP rank mod
    dcp_size, SGLang's tp_rank % dcp_size."""
    args = SimpleNamespace(kv_data_ptrs=[1, 2, 3], kv_item_lens=[16 * 576 * 2] * 3, page_size=16)
    lay = kv_layout(args, attn_tp_size=4, attn_tp_rank=3, mla=True, dcp_size=2)
    assert (lay.dcp_size, lay.dcp_rank, lay.head_dim, lay.page_size) == (2, 1, 1152, 16)
    assert kv_layout(args, attn_tp_size=4, attn_tp_rank=3, mla=True).dcp_size == 1
    with pytest.raises(ValueError, match="MLA only"):
        kv_layout(kv_args(), attn_tp_size=4, attn_tp_rank=3, mla=False, dcp_size=2)


@pytest.mark.parametrize("args,match", [
    (SimpleNamespace(kv_data_ptrs=[1, 2, 3], kv_item_lens=[64] * 3, page_size=4, kv_head_num=1,
                     total_kv_head_num=1), "K layers then V layers"),
    (SimpleNamespace(kv_data_ptrs=[1, 2], kv_item_lens=[64, 128], page_size=4, kv_head_num=1,
                     total_kv_head_num=1), "differ between layers"),
    (SimpleNamespace(kv_data_ptrs=[1, 2], kv_item_lens=[66, 66], page_size=4, kv_head_num=1,
                     total_kv_head_num=1), "not page_size"),
])
def test_layout_refuses_what_it_cannot_map(args, match):
    with pytest.raises(ValueError, match=match):
        kv_layout(args, attn_tp_size=1, attn_tp_rank=0, mla=False)


@pytest.mark.parametrize("kv, nvlink, want", [("cpu", False, "cpu"), ("cuda:1", False, "cpu"),
                                              ("cuda:1", True, "cuda:1"), ("cpu", True, "cpu")])
def test_aux_rows_are_host_memory_beside_a_cuda_cache(monkeypatch, kv, nvlink, want):
    """SGLang's MetadataBuffers are host memory unless its NVLink pool puts them on the GPU: the
    aux pool is a DRAM region beside a VRAM cache, no longer a refusal."""
    from kvstage.adapters.sglang.pools import aux_device
    if nvlink:
        monkeypatch.setenv("SGLANG_MOONCAKE_CUSTOM_MEM_POOL", "INTRA_NODE_NVLINK")
    else:
        monkeypatch.delenv("SGLANG_MOONCAKE_CUSTOM_MEM_POOL", raising=False)
    assert aux_device(torch.device(kv)) == torch.device(want)


def plain_mgr(**kw):
    """What unsupported_features reads of a manager: SGLang's parallel sizes and server args."""
    base = dict(pp_size=1, pp_rank=0, attn_cp_size=1, attn_cp_rank=0, dcp_size=1, dcp_rank=0, kv_shard_size=1, defer_decode_allocation=False,
                attn_tp_size=2, attn_tp_rank=0, state_tp_size=2, is_mla_backend=False,
                server_args=SimpleNamespace(enable_hisparse=False, device="cuda"))
    base.update(kw)
    return SimpleNamespace(**base)


@pytest.mark.parametrize("mgr,args,named", [
    (plain_mgr(server_args=SimpleNamespace(enable_hisparse=True, device="cuda")), {"num_draft_entries": 2},
     "HiSparse with speculative-decoding draft KV"),
    (plain_mgr(), {"kv_data_mem_kinds": ["DRAM", "VRAM"]}, "DRAM memory beside a device KV cache"),
    (plain_mgr(), {"host_kv_data_ptrs": [4096], "state_types": ["swa"]}, "host KV destinations"),
    (plain_mgr(server_args=SimpleNamespace(enable_hisparse=True, device="cuda")), {"host_kv_data_ptrs": [4096]},
     "host KV destinations with HiSparse"),
    (plain_mgr(pp_size=2, disaggregation_mode=SimpleNamespace(value="decode")), {"state_types": ["mamba", "dsa"]},
     "pipeline parallelism (pp_size 2) with state components ['mamba']"),
    (plain_mgr(pp_size=2, disaggregation_mode=SimpleNamespace(value="prefill")), {"kv_layer_ids": [0, 3]},
     "pipeline parallelism (pp_size 2) with a hybrid KV pool (kv_layer_ids)"),
    (plain_mgr(attn_cp_size=2, disaggregation_mode=SimpleNamespace(value="decode")), {},
     "context parallelism (attn_cp_size 2) on a decode"),
    (plain_mgr(attn_cp_size=2, disaggregation_mode=SimpleNamespace(value="prefill"),
               enable_all_cp_ranks_for_transfer=True, is_hybrid_mla_backend=True), {},
     "with every CP rank holding and sending its part of the pages"),
    (plain_mgr(attn_cp_size=2, disaggregation_mode=SimpleNamespace(value="prefill"),
               server_args=SimpleNamespace(enable_hisparse=False, device="cuda", enable_cp_tp_group_sharing=True)),
     {}, "CP-TP group sharing"),
    (plain_mgr(kv_shard_size=2), {}, "KV cache sharding (kv_shard_size 2) other than an MLA model's pages"),
    (plain_mgr(), {"kv_layout": "dsv4"}, "KV layout"),
], ids=["hisparse-draft", "mem-kinds", "host-destinations-state", "host-destinations-hisparse", "decode-pp", "pp-hybrid",
        "cp-decode", "cp-all-ranks", "cp-tp-sharing", "kv-sharding", "kv-layout"])
def test_features_kvstage_does_not_move_are_named_at_start(mgr, args, named):
    problems = unsupported_features(mgr, SimpleNamespace(**args))
    assert len(problems) == 1 and named in problems[0], problems


def split_mgr(**kw):
    """A prefill CP rank of SGLang's DSA cache layer split (server args' flag; no parallel state here)."""
    base = dict(attn_cp_size=2, attn_cp_rank=1, disaggregation_mode=SimpleNamespace(value="prefill"),
                enable_all_cp_ranks_for_transfer=True, is_mla_backend=True,
                server_args=SimpleNamespace(enable_hisparse=False, device="cuda", enable_dsa_cache_layer_split=True))
    return plain_mgr(**(base | kw))


def test_dsa_cache_layer_split_is_served_as_stages_of_the_cp_ranks():
    from kvstage.adapters.sglang.geometry import cp_stage, layer_split
    mgr = split_mgr()
    assert layer_split(mgr) and cp_stage(mgr) == (2, 1)
    assert unsupported_features(mgr, SimpleNamespace(state_types=["dsa"], num_draft_entries=1)) == []
    assert cp_stage(plain_mgr(pp_size=2, pp_rank=1)) == (2, 1) and cp_stage(plain_mgr()) == (1, 0)
    # the last CP rank lists the layers [2, 3) of 3 from prefill_start_layer (SGLang's get_layer_shard_range)
    args = SimpleNamespace(kv_data_ptrs=[4096], kv_data_lens=[64 * 16], kv_item_lens=[64 * 4], page_size=4,
                           prefill_start_layer=2, num_draft_entries=0)
    lay = kv_layout(args, 2, 0, True, None, pp_size=2, pp_rank=1)
    assert (lay.stage, lay.num_layers, lay.rank) == (range(2, 3), 3, 2)
    named = unsupported_features(mgr, SimpleNamespace(state_types=["mamba"]))
    assert len(named) == 1 and "DSA cache layer split (attn_cp_size 2) with state components ['mamba']" in named[0]
    named = unsupported_features(split_mgr(is_hybrid_mla_backend=True), SimpleNamespace())
    assert len(named) == 1 and "DSA cache layer split beside a hybrid MLA pool" in named[0]
    decode = split_mgr(disaggregation_mode=SimpleNamespace(value="decode"))
    assert not layer_split(decode)


def test_a_plain_gpu_deployment_is_not_refused():
    assert unsupported_features(plain_mgr(), SimpleNamespace(kv_data_mem_kinds=["VRAM"] * 4)) == []
    pp_prefill = plain_mgr(pp_size=2, disaggregation_mode=SimpleNamespace(value="prefill"))
    assert unsupported_features(pp_prefill, SimpleNamespace(kv_layer_ids=[])) == []
    pp_decode = plain_mgr(pp_size=2, disaggregation_mode=SimpleNamespace(value="decode"))
    assert unsupported_features(pp_decode, SimpleNamespace(kv_layer_ids=[])) == []   # served since decode PP
    # an MLA model's DSA indexer pages: each stage moves its own layers' (state.py, per-layer pools)
    assert unsupported_features(pp_prefill, SimpleNamespace(kv_layer_ids=[], state_types=["dsa"])) == []
    cpu = plain_mgr(server_args=SimpleNamespace(enable_hisparse=False, device="cpu"))
    assert unsupported_features(cpu, SimpleNamespace(kv_data_mem_kinds=["DRAM"] * 4)) == []
    assert unsupported_features(plain_mgr(), SimpleNamespace(num_draft_entries=2)) == []   # speculative decoding
    # beside PP: the draft is the last stage's (KVLayout), after its layers
    assert unsupported_features(pp_prefill, SimpleNamespace(kv_layer_ids=[], num_draft_entries=2)) == []
    assert unsupported_features(pp_decode, SimpleNamespace(kv_layer_ids=[], num_draft_entries=1)) == []
    # prefill CP where CP rank 0 sends (SGLang's default): the other CP ranks are dummy senders
    cp_prefill = plain_mgr(attn_cp_size=2, disaggregation_mode=SimpleNamespace(value="prefill"),
                           enable_all_cp_ranks_for_transfer=False)
    assert unsupported_features(cp_prefill, SimpleNamespace()) == []


def test_hisparse_and_host_destinations_are_destinations_like_any_other():
    """HiSparse: the decode KV SGLang hands over is its host pool, so kvstage takes it as DRAM
    (the aux rows and state stay where they are); host KV destinations: the host pool is given
    beside the device cache. Neither is refused any more."""
    hisparse = SimpleNamespace(enable_hisparse=True, device="cuda")
    assert unsupported_features(plain_mgr(server_args=hisparse), SimpleNamespace()) == []
    assert unsupported_features(plain_mgr(server_args=hisparse), SimpleNamespace(kv_data_mem_kinds=["DRAM"] * 4)) == []
    assert unsupported_features(plain_mgr(), SimpleNamespace(host_kv_data_ptrs=[4096])) == []
    assert kv_memory_device(hisparse, SimpleNamespace(gpu_id=1)) == "cpu"
    assert kv_memory_device(SimpleNamespace(enable_hisparse=False, device="cuda"), SimpleNamespace(gpu_id=1)) == "cuda:1"


def test_host_kv_buffers_must_have_the_device_kvs_layout():
    from kvstage.adapters.sglang.pools import host_kv_args
    args = SimpleNamespace(kv_data_ptrs=[4096, 8192], kv_data_lens=[64, 64], kv_item_lens=[16, 16],
                           host_kv_data_ptrs=[1 << 20, 2 << 20], host_kv_data_lens=[128, 128],
                           host_kv_item_lens=[16, 16], aux_data_ptrs=[7], aux_data_lens=[8], aux_item_lens=[8])
    host = host_kv_args(args)
    assert (host.kv_data_ptrs, host.kv_data_lens, host.kv_item_lens) == ([1 << 20, 2 << 20], [128, 128], [16, 16])
    assert host.aux_data_ptrs == [7]
    with pytest.raises(ValueError, match="do not have the device KV's layout"):
        host_kv_args(SimpleNamespace(**{**args.__dict__, "host_kv_item_lens": [32, 32]}))
    with pytest.raises(ValueError, match="do not have the device KV's layout"):
        host_kv_args(SimpleNamespace(**{**args.__dict__, "host_kv_data_ptrs": [1 << 20]}))


def with_draft(args, layers: int, item: int, kinds: int = 2):
    """KVArgs with a draft model's entries appended after the target's, as SGLang appends them."""
    n = kinds * layers
    args.kv_data_ptrs = list(args.kv_data_ptrs) + [(1 << 20) + 4096 * i for i in range(n)]
    args.kv_item_lens = list(args.kv_item_lens) + [item] * n
    args.num_draft_entries = n
    return args


@pytest.mark.parametrize("draft_heads,draft_head_bytes,want", [
    (2, 256, (None, None)),      # EAGLE / MTP: the target's geometry
    (1, 256, (4, None)),         # another head count (1 local head x TP 4), the target's head bytes
    (2, 96, (None, 96)),         # the target's head count, other head bytes
])
def test_draft_geometry_from_its_item_sizes(draft_heads, draft_head_bytes, want):
    """Target: 3 layers, 2 of 8 heads on this rank (TP 4), 256 B heads; draft: 1 layer, K then V
    (None: the target's)."""
    from kvstage.adapters.sglang.geometry import draft_kv, kv_entries
    args = with_draft(kv_args(), layers=1, item=16 * draft_heads * draft_head_bytes)
    target, draft = kv_entries(args)
    assert (len(target.ptrs), len(draft.ptrs)) == (6, 2)
    got = draft_kv(draft, kv_layout(kv_args(), attn_tp_size=4, attn_tp_rank=3, mla=False))
    assert (got.num_layers, got.total_kv_heads, got.head_dim) == (1, *want)


@pytest.mark.parametrize("heads,item,want", [
    (8, 16 * 2 * 256, (8, 256)),     # the target's geometry, as the draft model's config says
    (4, 16 * 1 * 256, (4, 256)),     # 4 heads over TP 4: one on this rank, the target's head bytes
    (2, 16 * 1 * 96, (2, 96)),       # 2 heads over TP 4: replicated, 96 B heads
    (8, 16 * 2 * 256 // 2, (8, 128)),  # the target's head count, half its head bytes
])
def test_draft_geometry_with_the_draft_model_heads(heads, item, want):
    """With the draft model's head count (its config), a head's bytes are a token's over this
    rank's share: geometries item sizes alone cannot tell apart (4 x 256 B vs 8 x 128 B) are exact."""
    from kvstage.adapters.sglang.geometry import draft_kv, kv_entries
    _, draft = kv_entries(with_draft(kv_args(), layers=2, item=item))
    got = draft_kv(draft, kv_layout(kv_args(), attn_tp_size=4, attn_tp_rank=3, mla=False), heads=heads)
    assert (got.num_layers, got.total_kv_heads, got.head_dim) == (2, *want)
    with pytest.raises(ValueError, match="does not split into the draft model's 3 KV heads over TP 4"):
        draft_kv(draft, kv_layout(kv_args(), attn_tp_size=4, attn_tp_rank=3, mla=False), heads=3)


def test_draft_heads_come_from_the_draft_model_config(tmp_path):
    """kv_layout asks the draft model's config (speculative_draft_model_path) for its KV heads; a
    path that cannot be read is said, with the path."""
    from kvstage.adapters.sglang import geometry
    asked = []

    def heads(server_args):
        asked.append(server_args.speculative_draft_model_path)
        return 4
    orig, geometry.draft_model_kv_heads = geometry.draft_model_kv_heads, heads
    try:
        sa = SimpleNamespace(speculative_algorithm="EAGLE", speculative_draft_model_path="/models/draft")
        lay = kv_layout(with_draft(kv_args(), layers=1, item=16 * 2 * 128), attn_tp_size=4, attn_tp_rank=3,
                        mla=False, server_args=sa)
    finally:
        geometry.draft_model_kv_heads = orig
    assert asked == ["/models/draft"]
    # 256 B per token of a 16-token page, 1 of the 4 draft heads on this rank: 256 B heads
    assert (lay.draft.total_kv_heads, lay.draft.head_dim, lay.draft_own_geometry) == (4, 256, True)
    assert geometry.draft_model_kv_heads(SimpleNamespace(speculative_draft_model_path=None)) is None
    assert geometry.draft_model_kv_heads(None) is None


def test_layout_with_an_eagle_draft():
    lay = kv_layout(with_draft(kv_args(), layers=1, item=16 * 2 * 256), attn_tp_size=4, attn_tp_rank=3, mla=False)
    assert (lay.num_layers, lay.draft.num_layers, lay.draft.total_kv_heads, lay.draft.head_dim) == (3, 1, 8, 256)


def test_mtp_draft_of_an_mla_model_is_latents():
    args = with_draft(SimpleNamespace(kv_data_ptrs=[1, 2, 3], kv_item_lens=[16 * 1152] * 3, page_size=16),
                      layers=2, item=16 * 1152, kinds=1)
    lay = kv_layout(args, attn_tp_size=2, attn_tp_rank=1, mla=True)
    assert (lay.num_layers, lay.draft.num_layers, lay.draft.head_dim) == (3, 2, 1152)


@pytest.mark.parametrize("mla,draft,algorithm,match", [
    (False, dict(layers=1, item=16 * 2 * 256, kinds=1), None, "expected draft K layers then V layers"),
    (False, dict(layers=1, item=16 * 2 * 256 + 16 * 3, kinds=2), None, "fits neither"),
])
def test_draft_entries_that_cannot_be_paired_are_refused(mla, draft, algorithm, match):
    base = SimpleNamespace(kv_data_ptrs=[1, 2, 3], kv_item_lens=[16 * 1152] * 3, page_size=16) if mla else kv_args()
    with pytest.raises(ValueError, match=match):
        kv_layout(with_draft(base, **draft), attn_tp_size=4, attn_tp_rank=0, mla=mla,
                  server_args=SimpleNamespace(speculative_algorithm=algorithm))


def test_an_mha_draft_model_beside_an_mla_target_moves_at_equal_tp_only():
    """EAGLE3 on an MLA model: the draft's K and V entries (this rank's share of its heads) become
    draft entries of their own size, moved whole like latents; the manager marks them equal-TP
    only, which the decode checks per request (conn.py send_metadata). MTP drafts, MHA targets
    and no draft are not marked."""
    from kvstage.adapters.sglang import geometry

    def base():
        return SimpleNamespace(kv_data_ptrs=[1, 2, 3], kv_item_lens=[16 * 1152] * 3, page_size=16)

    args = with_draft(base(), layers=1, item=16 * 2 * 128, kinds=2)      # 2 of 8 draft heads x 128 B
    eagle3 = SimpleNamespace(speculative_algorithm="EAGLE3")
    lay = kv_layout(args, attn_tp_size=4, attn_tp_rank=0, mla=True, server_args=eagle3)
    assert (lay.num_layers, lay.draft.num_layers, lay.draft.total_kv_heads, lay.draft.head_dim) == (3, 2, 1, 256)
    assert geometry.draft_equal_tp_only(args, True, eagle3) == (
        "the KV of a separate draft model (EAGLE3) beside an MLA target")
    assert geometry.draft_equal_tp_only(args, True, SimpleNamespace(speculative_algorithm="NEXTN")) is None
    assert geometry.draft_equal_tp_only(args, False, eagle3) is None
    assert geometry.draft_equal_tp_only(base(), True, eagle3) is None


def test_rendezvous_per_prefill_instance_or_one_etcd_for_the_fleet():
    from kvstage.adapters.sglang.rendezvous import address_from_route, instance_address, route_answer, shared_rendezvous
    assert shared_rendezvous({}) is None                                   # a bootstrap server per instance
    fleet = shared_rendezvous({"KVSTAGE_BOOTSTRAP": "etcd://e1:2379,e2:2379/prod?ttl=5"})
    assert fleet == "etcd://e1:2379,e2:2379/prod?ttl=5"
    with pytest.raises(ValueError, match="names an etcd cluster"):
        shared_rendezvous({"KVSTAGE_BOOTSTRAP": "10.0.0.1:8998"})
    one, two = instance_address(fleet), instance_address(fleet)
    assert one != two and one.startswith("etcd://e1:2379,e2:2379/prod/prefill-") and one.endswith("?ttl=5")
    # the decode side reads what the prefill instance's route says
    assert address_from_route("10.0.0.7:8998", route_answer(None, one)) == one
    assert address_from_route("10.0.0.7:8998", route_answer(41234, None)) == "10.0.0.7:41234"
    assert address_from_route("[fd00::7]:8998", route_answer(41234, None)) == "[fd00::7]:41234"


def dcp_mgr(**kw):
    """A decode rank of attention TP 2 with DCP 2 of an MLA model (SGLang's manager fields)."""
    return plain_mgr(**{"dcp_size": 2, "dcp_rank": 1, "attn_tp_rank": 1, "is_mla_backend": True,
                        "disaggregation_mode": SimpleNamespace(value="decode"), **kw})


@pytest.mark.parametrize("mgr,args,named", [
    (dcp_mgr(is_mla_backend=False), {}, "beside a non-MLA KV pool"),
    (dcp_mgr(is_mla_backend=False), {"state_types": ["mamba"]}, "beside a non-MLA KV pool"),
    (dcp_mgr(), {"state_types": ["dsa"]}, "with state components ['dsa']"),
    (dcp_mgr(is_mla_backend=False), {"is_hybrid_mla_backend": True, "state_types": ["mamba", "swa"]},
     "with state components ['swa']"),
    (dcp_mgr(), {"num_draft_entries": 2}, "with speculative-decoding draft KV"),
    (dcp_mgr(dcp_rank=0), {}, "whose DCP rank 0 is not attention TP rank 1 mod 2"),
    (dcp_mgr(), {"host_kv_data_ptrs": [4096]}, "with host KV destinations"),
    (dcp_mgr(server_args=SimpleNamespace(enable_hisparse=True, device="cuda")), {}, "with HiSparse"),
], ids=["mha", "mha-mamba", "dsa", "hybrid-mla-swa", "draft", "rank", "host", "hisparse"])
def test_decode_context_parallel_kvstage_does_not_serve_is_refused_at_start_naming_why(monkeypatch, mgr, args,
                                                                                        named):
    for name in SGLANG_AND_KVSTAGE_ENVS:
        monkeypatch.delenv(name, raising=False)
    (only,) = unsupported_features(mgr, SimpleNamespace(**args))
    assert named in only and "decode context parallelism (dcp_size 2)" in only, only


def test_a_dcp_rank_beside_pp_starts(monkeypatch):
    for name in SGLANG_AND_KVSTAGE_ENVS:
        monkeypatch.delenv(name, raising=False)
    assert unsupported_features(dcp_mgr(pp_size=2), SimpleNamespace(kv_layer_ids=[])) == []


@pytest.mark.parametrize("staging", [None, "1"], ids=["staging-unset", "sglang-staging-flag"])
@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_a_dcp_rank_of_an_mla_pool_starts(monkeypatch, staging, mode):
    """An MLA decode or prefill rank of attention TP 2 with DCP 2 is served (tests/sglang_adapter/
    test_dcp_classes.py moves 1 -> 2 and 2 -> 2 through SGLang's classes); SGLang's staging flag,
    which turns kvstage's staging on (its prefill relayouts a DCP split), adds no problem."""
    for name in SGLANG_AND_KVSTAGE_ENVS:
        monkeypatch.delenv(name, raising=False)
    if staging:
        monkeypatch.setenv(plugin.SGLANG_STAGING_ENV, staging)
    assert unsupported_features(dcp_mgr(disaggregation_mode=SimpleNamespace(value=mode)), SimpleNamespace()) == []


def test_a_dcp_rank_of_a_hybrid_mla_pool_with_mamba_slots_starts(monkeypatch):
    """Kimi Linear's pool beside decode DCP: MLA layers in a hybrid pool (SGLang's is_mla_backend
    False, KVArgs.is_hybrid_mla_backend True) with Mamba slots is served
    (tests/sglang_adapter/test_dcp_classes.py moves it through SGLang's classes)."""
    for name in SGLANG_AND_KVSTAGE_ENVS:
        monkeypatch.delenv(name, raising=False)
    args = SimpleNamespace(is_hybrid_mla_backend=True, state_types=["mamba"])
    assert unsupported_features(dcp_mgr(is_mla_backend=False), args) == []


@pytest.mark.parametrize("mgr,args,named", [
    (plain_mgr(kv_shard_size=2, is_mla_backend=True), {}, None),
    (plain_mgr(kv_shard_size=2), {}, "other than an MLA model's pages over its whole attention TP group"),
    (plain_mgr(kv_shard_size=2, is_mla_backend=True, attn_tp_size=4), {}, "whole attention TP group"),
    (plain_mgr(kv_shard_size=2, is_mla_backend=True), {"state_types": ["dsa"]}, "with state components"),
    (plain_mgr(kv_shard_size=2, is_mla_backend=True), {"num_draft_entries": 1}, "with speculative-decoding draft"),
    (plain_mgr(kv_shard_size=2, is_mla_backend=True, pp_size=2), {}, None),
], ids=["mla-over-attention-tp", "mha", "part-of-tp", "dsa-state", "draft", "pp"])
def test_kv_cache_sharding_starts_where_kvstage_moves_it_and_is_refused_naming_why_elsewhere(mgr, args, named):
    """An MLA model's pages sharded over the whole attention TP group start (kvstage's engine
    moves them, each page from its owner); any other sharding is refused at start, by name."""
    problems = [p for p in unsupported_features(mgr, SimpleNamespace(**args)) if "KV cache sharding" in p]
    if named is None:
        assert unsupported_features(mgr, SimpleNamespace(**args)) == []
    else:
        assert len(problems) == 1 and named in problems[0] and "(kv_shard_size 2)" in problems[0], problems


def test_layout_of_a_sharded_prefill_holds_its_local_pages_of_the_logical_ones():
    args = SimpleNamespace(kv_data_ptrs=[1, 2, 3], kv_item_lens=[16 * 576 * 2] * 3, page_size=16)
    lay = kv_layout(args, attn_tp_size=2, attn_tp_rank=1, mla=True, page_shards=2)
    assert (lay.page_shards, lay.tp_rank, lay.head_dim) == (2, 1, 1152)
    with pytest.raises(ValueError, match="whole TP group"):
        kv_layout(args, attn_tp_size=4, attn_tp_rank=1, mla=True, page_shards=2)


class KvstageLike:
    request_tokens = None       # what kvstage's sender and receiver declare (conn._Handle)


def test_request_tokens_reach_kvstages_sender_and_receiver_only():
    """The plugin's BEFORE hooks on SGLang's queue methods hand kvstage's sender and receiver the
    request's token count (what SGLang counts its pages by); another backend's are left alone."""
    sender, other = KvstageLike(), SimpleNamespace()
    assert plugin.tell_prefill_tokens(object(), SimpleNamespace(disagg_kv_sender=sender,
                                                                origin_input_ids=[7] * 19)) is None
    plugin.tell_prefill_tokens(object(), SimpleNamespace(disagg_kv_sender=other, origin_input_ids=[7] * 19))
    assert sender.request_tokens == 19 and not hasattr(other, "request_tokens")

    class Queue:   # SGLang's DecodePreallocQueue: a request bootstrapped again is recomputed with its outputs
        @staticmethod
        def _rebootstrap_prefill_len(req):
            return len(req.origin_input_ids) + len(req.output_ids)

    receiver = KvstageLike()
    req = SimpleNamespace(origin_input_ids=[1] * 30, output_ids=[2] * 3)
    assert plugin.tell_decode_tokens(Queue(), SimpleNamespace(kv_receiver=receiver, req=req), [0], 4) is None
    assert receiver.request_tokens == 33
    plugin.tell_decode_tokens(object(), SimpleNamespace(kv_receiver=receiver, req=req))
    assert receiver.request_tokens == 30


@pytest.mark.parametrize("args,backend", [
    (dict(disaggregation_mode="decode", dcp_size=2), "nixl"),
    (dict(disaggregation_mode="prefill", dcp_size=2), None),
    (dict(disaggregation_mode="decode", dcp_size=1), None),
    (dict(disaggregation_mode="prefill", disaggregation_decode_allocation_policy="prefill_complete"), "mooncake"),
    (dict(disaggregation_mode="decode", dcp_size=2, disaggregation_decode_allocation_policy="prefill_complete"),
     "mooncake"),
    (dict(disaggregation_mode="decode", disaggregation_transfer_backend="nixl", dcp_size=2,
          disaggregation_decode_allocation_policy="prefill_complete"), None),
], ids=["decode-dcp", "prefill-dcp", "plain", "prefill-complete", "prefill-complete-and-dcp", "other-backend"])
def test_sglangs_pd_check_sees_the_backend_that_it_accepts_the_feature_for(args, backend):
    """kvstage's plugin runs SGLang's PD argument check as for nixl on a decode with DCP, as for
    mooncake under prefill_complete (which SGLang accepts for mooncake only, and which also gets
    SGLang's refusal of DCP beside it), and as written otherwise."""
    server_args = SimpleNamespace(**{"disaggregation_transfer_backend": "kvstage", **args})
    assert plugin.checked_as(server_args) == backend


def prefill_info(**kw):
    return SimpleNamespace(**{"decode_allocation_policy": "prefill_complete", "attn_tp_size": 1, "attn_cp_size": 1,
                              "pp_size": 1, **kw})


@pytest.mark.parametrize("info,policy,named", [
    (prefill_info(), "prefill_complete", None),
    (prefill_info(decode_allocation_policy="early"), "early", None),
    (prefill_info(decode_allocation_policy="early"), "prefill_complete", "prefill early, decode prefill_complete"),
    (prefill_info(), "early", "prefill prefill_complete, decode early"),
    (prefill_info(attn_tp_size=2), "prefill_complete", "TP 2, CP 1, PP 1"),
    (prefill_info(pp_size=2), "prefill_complete", "TP 1, CP 1, PP 2"),
    (prefill_info(attn_tp_size=2, decode_allocation_policy="early"), "early", None),
], ids=["both-prefill-complete", "both-early", "decode-only", "prefill-only", "prefill-tp2", "prefill-pp2",
        "early-tp2"])
def test_a_decode_refuses_a_prefill_of_another_allocation_policy_or_shape(info, policy, named):
    problem = prefill_complete.peer_problem(info, policy)
    assert (problem is None) if named is None else (named in problem), problem


@pytest.mark.parametrize("kw,copies,served", [
    ({}, True, True),
    ({"is_hybrid_mla_backend": True}, False, False),
    ({"kv_shard_size": 2}, False, False),
    ({"server_args": SimpleNamespace(enable_hisparse=False, device="cuda", enable_dsa_cache_layer_split=True)}, False,
     True),
], ids=["plain-pool", "hybrid-mla", "kv-sharding", "dsa-layer-split"])
def test_all_cp_ranks_sending_is_served_where_each_cp_rank_holds_the_whole_kv(kw, copies, served):
    """SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER on a plain pool splits SGLang's sending, not the
    KV: kvstage serves it as without the variable (CP rank 0 moves the KV); under DSA cache layer
    split each CP rank holds its layers, a stage of its own; where the CP ranks hold other parts
    of it, every rank is refused at start."""
    mgr = plain_mgr(**{"attn_cp_size": 2, "disaggregation_mode": SimpleNamespace(value="prefill"),
                       "enable_all_cp_ranks_for_transfer": True, **kw})
    from kvstage.adapters.sglang.geometry import cp_ranks_hold_copies
    assert cp_ranks_hold_copies(mgr) is copies
    problems = [p for p in unsupported_features(mgr, SimpleNamespace()) if "context parallelism" in p]
    assert (problems == []) is served, problems
