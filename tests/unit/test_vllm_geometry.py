"""vLLM's KV tensors to kvstage buffers (adapters/vllm/geometry.py), pure: each recognised shape
becomes views of the same memory in the right page format, and everything else is refused at
start naming the feature (hybrid models, FlashInfer's interleaved layout, dtype, PP/DP, role)."""

from __future__ import annotations

import pytest
import torch

from kvstage.adapters.vllm.geometry import ModelGeometry, engine_cache, unsupported_features
from kvstage.transfer.page_format import PageFormat

GEO = ModelGeometry(num_layers=2, total_kv_heads=4, local_heads=2, head_dim=8, block_size=16, tp_size=2, tp_rank=1,
                    mla=False)


def test_recognised_shapes_are_views_in_their_format():
    cpu = {f"l{i}": torch.zeros(5, 2, 16, 16) for i in range(2)}
    eng, buf = engine_cache(GEO, cpu)
    assert eng.page_format is PageFormat.HND_KV_FUSED and buf.v is None
    assert buf.k[0].data_ptr() == cpu["l0"].data_ptr() and buf.num_pages == 5
    fa = {f"l{i}": torch.zeros(2, 5, 16, 2, 8) for i in range(2)}
    eng, buf = engine_cache(GEO, fa)
    assert eng.page_format is PageFormat.NHD and buf.v[1].data_ptr() == fa["l1"][1].data_ptr()
    fa_hnd = {f"l{i}": torch.zeros(2, 5, 2, 16, 8) for i in range(2)}
    assert engine_cache(GEO, fa_hnd)[0].page_format is PageFormat.HND
    mla = ModelGeometry(num_layers=1, total_kv_heads=1, local_heads=1, head_dim=8, block_size=16, tp_size=1,
                        tp_rank=0, mla=True)
    eng, buf = engine_cache(mla, {"l0": torch.zeros(5, 16, 8)})
    assert eng.kv_layout().mla and buf.k[0].shape == (80, 1, 8)


def test_unsupported_caches_are_refused_naming_them():
    with pytest.raises(ValueError, match="FlashInfer"):
        engine_cache(GEO, {f"l{i}": torch.zeros(5, 2, 16, 2, 8) for i in range(2)})
    with pytest.raises(ValueError, match=r"KV cache shape \(5, 3, 16, 16\) is not supported"):
        engine_cache(GEO, {f"l{i}": torch.zeros(5, 3, 16, 16) for i in range(2)})
    with pytest.raises(ValueError, match="dtype torch.float64 is not supported"):
        engine_cache(GEO, {f"l{i}": torch.zeros(5, 2, 16, 16, dtype=torch.float64) for i in range(2)})


def test_unsupported_deployments_are_refused_naming_them():
    full = type("FullAttentionSpec", (), {})()
    swa = type("SlidingWindowSpec", (), {})()
    groups = [type("G", (), {"kv_cache_spec": s})() for s in (full, swa)]
    problems = unsupported_features(kv_cache_groups=groups, pipeline_parallel=2, data_parallel=2, kv_role="kv_both")
    text = "; ".join(problems)
    for what in ("hybrid (HMA) models", "SlidingWindowSpec", "pipeline parallelism", "data parallelism",
                 "kv_role 'kv_both'"):
        assert what in text
    assert unsupported_features(kv_cache_groups=groups[:1], pipeline_parallel=1, data_parallel=1,
                                kv_role="kv_producer") == []
