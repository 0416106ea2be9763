"""SGLang's PD argument check (handle_pd_disaggregation) through kvstage's plugin, run by
SGLang's own resolution of its ServerArgs (`resolve_once`, as a launcher or `publish` calls
it): a decode with decode context parallel is accepted for backend kvstage
(SGLang 0.5.23 lists the backends whose decode DCP it accepts, and kvstage is not among them),
and so are the prefill_complete allocation policy on both roles (which it accepts for mooncake
only) and KV cache sharding on a prefill (mooncake and nixl only); the backend stays kvstage
once resolved, the staging flag is still taken over first, and SGLang's other refusals stand."""

from __future__ import annotations

import os

import pytest


def server_args(model_dir: str, **kw):
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.server_args import ServerArgs
    kw = {"tp_size": 2, "disaggregation_mode": "decode", **kw}
    sa = ServerArgs(model_path=model_dir, device="cpu", host="127.0.0.1", port=30000, skip_tokenizer_init=True,
                    page_size=4, **kw)
    sa.resolve_once()
    return sa


def test_decode_dcp_passes_the_check_for_kvstage_and_stays_kvstage(model_dir, monkeypatch):
    from sglang.srt.arg_groups.model_override_base import resolved_view
    monkeypatch.setenv("SGLANG_DISAGG_STAGING_BUFFER", "1")
    monkeypatch.delenv("KVSTAGE_SGLANG_STAGING", raising=False)
    sa = server_args(model_dir, dcp_size=2, disaggregation_transfer_backend="kvstage")
    assert resolved_view(sa).disaggregation_transfer_backend == "kvstage"
    assert "SGLANG_DISAGG_STAGING_BUFFER" not in os.environ and os.environ["KVSTAGE_SGLANG_STAGING"] == "1"


def test_sglangs_check_still_refuses_what_it_refuses_for_kvstage(model_dir):
    """Only the backend list of decode DCP is read as nixl's: SGLang's other refusals stand
    (here: decode host receive beside HiSparse)."""
    with pytest.raises(ValueError, match="Decode host receive"):
        server_args(model_dir, dcp_size=2, disaggregation_transfer_backend="kvstage", enable_hisparse=True,
                    disaggregation_decode_host_receive_threshold=0.5)


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_prefill_complete_passes_the_check_for_kvstage_and_stays_kvstage(model_dir, mode):
    from sglang.srt.arg_groups.model_override_base import resolved_view
    sa = server_args(model_dir, tp_size=1, disaggregation_mode=mode, disaggregation_transfer_backend="kvstage",
                     disaggregation_decode_allocation_policy="prefill_complete")
    view = resolved_view(sa)
    assert view.disaggregation_transfer_backend == "kvstage"
    assert view.disaggregation_decode_allocation_policy == "prefill_complete"
    if mode == "prefill":   # SGLang's own resolution for the policy still ran: optimistic prefill on (default 0)
        assert view.optimistic_prefill_attempts == 1


def test_sglangs_limits_of_prefill_complete_stand_for_kvstage(model_dir):
    with pytest.raises(ValueError, match="attention tensor parallelism greater than one"):
        server_args(model_dir, tp_size=2, disaggregation_transfer_backend="kvstage",
                    disaggregation_decode_allocation_policy="prefill_complete")


def test_kv_cache_sharding_passes_the_check_for_kvstage_and_stays_kvstage(mla_model_dir):
    """SGLang resolves --enable-kv-cache-sharding for plain-TP MLA on the fa3 attention backend
    (a CUDA one: named here, never run); its list of transfer backends now accepts kvstage."""
    from sglang.srt.arg_groups.model_override_base import resolved_view
    sa = server_args(mla_model_dir, disaggregation_mode="prefill", disaggregation_transfer_backend="kvstage",
                     enable_kv_cache_sharding=True, attention_backend="fa3")
    view = resolved_view(sa)
    assert view.disaggregation_transfer_backend == "kvstage" and view.enable_kv_cache_sharding


def test_sglangs_limits_of_kv_cache_sharding_stand_for_kvstage(model_dir):
    """A GQA model's KV is sharded over prefill CP only (SGLang's rule, kept)."""
    with pytest.raises(ValueError, match="GQA models shards across attention-CP ranks"):
        server_args(model_dir, disaggregation_mode="prefill", disaggregation_transfer_backend="kvstage",
                    enable_kv_cache_sharding=True, attention_backend="fa3")


@pytest.mark.parametrize("split", [True, False])
def test_dsa_cache_layer_split_is_checked_as_mooncake_for_kvstage(model_dir, split):
    """SGLang accepts --enable-dsa-cache-layer-split for the mooncake backend only, in its
    model-specific step (a DSA model's branch, which queries the CUDA device: not resolvable on
    this machine). The plugin's wrapper of that step runs it with the backend resolved as mooncake
    when the split is on, and as kvstage again afterwards; without the split, as it is."""
    from sglang.srt.arg_groups.model_override_base import resolved_view
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ServerArgs

    from kvstage.adapters.sglang.plugin import around_model_adjustments
    load_plugins()
    sa = ServerArgs(model_path=model_dir, device="cpu", host="127.0.0.1", port=30000, skip_tokenizer_init=True,
                    page_size=4, tp_size=2, attn_cp_size=2, enable_prefill_cp=True, cp_strategy="interleave",
                    disaggregation_mode="prefill", disaggregation_transfer_backend="kvstage",
                    enable_dsa_cache_layer_split=split)
    seen = []
    around_model_adjustments(sa, lambda args: seen.append(resolved_view(args).disaggregation_transfer_backend))
    assert seen == ["mooncake" if split else "kvstage"]
    assert resolved_view(sa).disaggregation_transfer_backend == "kvstage"
