"""The SGLang adapter's state mapping (adapters/sglang/state.py) without SGLang installed: which
kvstage pools a rank's KVArgs state components become, how a request's state_indices become
pool items, and what is refused. Bytes moving between real ranks: tests/sglang_adapter."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvstage import KVLayout
from kvstage.adapters.sglang.state import StateMap

PAGE, HEADS = 4, 4


def layout(tp: int = 2, heads: int = HEADS, mla: bool = False) -> KVLayout:
    return KVLayout(num_layers=2, total_kv_heads=1 if mla else heads, head_dim=16, dtype=torch.uint8,
                    page_size=PAGE, tp_size=tp, tp_rank=0, mla=mla)


def state_args(tp: int, slots: int = 6, pages: int = 10, gdn: bool = False, swa_layout: str = "nhd"):
    """Mamba (temporal [4 heads, 6], Kimi-style [3 rows, 4, 2], replicated [5]) and SWA (2 NHD
    tensors), as SGLang lays them out; keeps the tensors alive on the namespace."""
    temporal = torch.zeros(slots, 4 // tp, 6, dtype=torch.int16)
    kimi = torch.zeros(slots, 3, 4 // tp, 2, dtype=torch.int16)
    whole = torch.zeros(slots, 5, dtype=torch.int16)
    swa = [torch.zeros(pages * PAGE, HEADS // tp, 8, dtype=torch.int16) for _ in range(2)]
    mamba = [temporal, kimi, whole]
    return SimpleNamespace(
        keep=mamba + swa, page_size=PAGE, state_types=["mamba", "swa"],
        state_data_ptrs=[[t.data_ptr() for t in mamba], [t.data_ptr() for t in swa]],
        state_data_lens=[[t.nbytes for t in mamba], [t.nbytes for t in swa]],
        state_item_lens=[[t[0].nbytes for t in mamba], [t[:PAGE].nbytes for t in swa]],
        state_dim_per_tensor=[[4 // tp, 4 // tp, 0], []], state_slice_outer_counts=[[1, 3, 1], []],
        state_conv_shard_groups=[[[2, 2] if gdn else None, None, None], []], swa_kv_cache_layout=swa_layout)


def test_components_become_pools_and_indices_become_items():
    sm = StateMap(state_args(2), layout(2), torch.device("cpu"), 2)
    assert {n: (p.sharding, p.heads) for n, p in sm.pools.items()} == {
        "state0.mamba.h4x1": ("heads", 4), "state0.mamba.h4x3": ("heads", 4), "state0.mamba.rep": ("replicated", None),
        "state1.swa": ("heads", HEADS)}
    items = sm.items([[np.array(5)], np.array([7, 2], dtype=np.int32)])
    assert {n: v.tolist() for n, v in items.items()} == {
        "state0.mamba.h4x1": [5], "state0.mamba.h4x3": [15, 16, 17], "state0.mamba.rep": [5],
        "state1.swa": [28, 29, 30, 31, 8, 9, 10, 11]}   # NHD pages as token items, in page order
    assert sm.items([None, []]) == {}


def test_pool_names_do_not_depend_on_sizes_or_tp():
    """Prefill and decode hold different slot/page counts and TP sizes: the pools must match."""
    a = StateMap(state_args(2, slots=6, pages=10), layout(2), torch.device("cpu"), 2)
    b = StateMap(state_args(1, slots=9, pages=13), layout(1), torch.device("cpu"), 1)
    assert {n: p.spec(n, layout(2)) for n, p in a.pools.items()} == {n: p.spec(n, layout(1))
                                                                       for n, p in b.pools.items()}


def test_tp_combinations():
    sm = StateMap(state_args(2), layout(2), torch.device("cpu"), 2)
    assert sm.peer_problem(2, 1) is None and sm.peer_problem(1, 2) is None
    gdn = StateMap(state_args(2, gdn=True), layout(2), torch.device("cpu"), 2)   # conv sub-blocks [2 | 2]
    assert gdn.pools["state0.mamba.h4x1b2-2"].blocks == [2, 2]
    assert gdn.peer_problem(2, 2) is None and gdn.peer_problem(2, 1) is None and gdn.peer_problem(1, 2) is None
    bad = state_args(2, gdn=True)
    bad.state_conv_shard_groups = [[[2, 1], None, None], []]
    with pytest.raises(NotImplementedError, match=r"conv sub-blocks \[2, 1\] do not add up to its 2 units"):
        StateMap(bad, layout(2), torch.device("cpu"), 2)
    two_heads = StateMap(state_args(2), layout(2, heads=2), torch.device("cpu"), 2)
    assert "must have the KV's writers" in two_heads.peer_problem(4, 2)   # KV replicated on prefill


@pytest.mark.parametrize("change,match", [
    (dict(state_types=["mamba", "swa_ring"]), r"state type 'swa_ring' \(DeepSeek V4's pool only"),
    (dict(swa_kv_cache_layout="vectorized_5d"), "SWA state in a 'vectorized_5d' sub-pool"),
    (dict(state_types=["dsa", "swa"]), "DSA indexer state beside a non-MLA KV cache"),
])
def test_refused_at_start_naming_the_feature(change, match):
    args = state_args(2)
    for k, v in change.items():
        setattr(args, k, v)
    with pytest.raises(NotImplementedError, match=match):
        StateMap(args, layout(2), torch.device("cpu"), 2)


def test_mxfp8_block_scales_that_do_not_fit_are_refused():
    """MXFP8 scales are head-sharded pages of an MHA cache (bytes moving: tests/sglang_adapter/
    test_state_types.py); a page that is not whole heads, or an MLA cache, is refused at start."""
    scales = [torch.zeros(10 * PAGE, HEADS // 2, 2, dtype=torch.uint8) for _ in range(2)]
    args = SimpleNamespace(keep=scales, page_size=PAGE, state_types=["block_scale"],
                           state_data_ptrs=[[t.data_ptr() for t in scales]], state_data_lens=[[t.nbytes for t in scales]],
                           state_item_lens=[[t[:PAGE].nbytes for t in scales]])
    sm = StateMap(args, layout(2), torch.device("cpu"), 2)
    assert {n: (p.sharding, p.heads, tuple(p.tensors[0].shape)) for n, p in sm.pools.items()} == {
        "state0.block_scale": ("heads", HEADS, (10 * PAGE, HEADS // 2, 2))}
    assert sm.items([np.array([3, 1])])["state0.block_scale"].tolist() == [12, 13, 14, 15, 4, 5, 6, 7]
    with pytest.raises(NotImplementedError, match="MXFP8 block scales beside an MLA KV cache"):
        StateMap(args, layout(2, mla=True), torch.device("cpu"), 2)
    args.state_item_lens = [[PAGE * 5 for _ in scales]]   # 160 bytes: 8 items of 20
    with pytest.raises(NotImplementedError, match="a 20-byte page is not 4 tokens x 2 heads"):
        StateMap(args, layout(2), torch.device("cpu"), 2)


def test_items_that_do_not_fit_are_refused():
    sm = StateMap(state_args(2), layout(2), torch.device("cpu"), 2)
    with pytest.raises(ValueError, match="3 entries, this rank has 2 state types"):
        sm.items([[np.array(1)], np.array([1]), np.array([4])])
    with pytest.raises(ValueError, match="must be integers"):
        sm.items([[np.array(1.5)], None])
