"""State pools: validation, the compatibility summary, and which pool bytes each flow carries."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstage import KVBuffers, KVLayout, StatePool
from kvstage.transfer.pool_spec import check_pool_items, pool_mismatches
from kvstage.transfer.protocol.head_mapping import compute_assignments
from kvstage.transfer.protocol.pool_parts import (
    block_bytes,
    carried_pools,
    counts_mismatch,
    final_part,
    part_offsets,
    request_copies,
    writer_segments,
    writers_mismatch,
)


def layout(tp=2, rank=0, heads=4, mla=False):
    return KVLayout(
        num_layers=2,
        total_kv_heads=1 if mla else heads,
        head_dim=8,
        dtype=torch.bfloat16,
        page_size=4,
        tp_size=tp,
        tp_rank=rank,
        mla=mla,
    )


def kv(lay, pages=8):
    shape = (pages * lay.page_size, lay.local_heads, lay.head_dim)
    k = [torch.zeros(shape, dtype=lay.dtype) for _ in range(lay.num_layers)]
    return k, (None if lay.mla else [torch.zeros(shape, dtype=lay.dtype) for _ in range(lay.num_layers)])


def test_buffers_validate_pools_and_summarise_them():
    lay = layout()
    k, v = kv(lay)
    aux = StatePool(tensors=[torch.zeros(16, 5), torch.zeros(16, 3, dtype=torch.int32)])
    mamba = StatePool(tensors=[torch.zeros(4, 4, 6, 2)], sharding="heads", heads=8)
    b = KVBuffers(k, v, pools={"mamba": mamba, "aux": aux}).validate(lay)
    assert [p.name for p in b.pool_specs] == ["aux", "mamba"]
    assert b.pool_specs[0].rows == [[5], [3]] and b.pool_specs[0].dtypes == ["float32", "int32"]
    assert b.pool_specs[1].heads == 8 and b.pool_specs[1].row_bytes(0) == 6 * 2 * 4
    assert aux.num_items == 16 and mamba.num_items == 4


@pytest.mark.parametrize(
    "pool, match",
    [
        (StatePool(tensors=[torch.zeros(4, 3, 6)], sharding="heads", heads=6), "do not divide by TP size 4"),
        (StatePool(tensors=[torch.zeros(4, 1, 6)], sharding="heads", heads=8), "has 1 heads in dim 1"),
        (StatePool(tensors=[torch.zeros(4, 5), torch.zeros(3, 5)]), "has 3 items, tensor 0 has 4"),
        (StatePool(tensors=[torch.zeros(4, 6)[:, ::2]]), "not contiguous"),
        (StatePool(tensors=[torch.zeros(0, 6)]), "holds no items"),
        (StatePool(tensors=[torch.zeros(4, 6)], sharding="rows"), "sharding must be one of"),
        (StatePool(tensors=[torch.zeros(4, 6)], heads=4), "heads is only for sharding='heads'"),
    ],
)
def test_bad_pools_are_refused_naming_the_pool(pool, match):
    lay = layout(tp=4, heads=4)
    k, v = kv(lay)
    with pytest.raises(ValueError, match=match):
        KVBuffers(k, v, pools={"p": pool}).validate(lay)


def test_a_pool_sharing_bytes_with_the_kv_is_refused():
    lay = layout()
    k, v = kv(lay)
    with pytest.raises(ValueError, match="overlap"):
        KVBuffers(k, v, pools={"p": StatePool(tensors=[k[0].view(16, -1)])}).validate(lay)


def test_pool_mismatches_are_readable():
    lay = layout()
    k, v = kv(lay)
    mine = KVBuffers(k, v, pools={"aux": StatePool(tensors=[torch.zeros(8, 5)])}).validate(lay).pool_specs
    theirs = (
        KVBuffers(
            *kv(lay),
            pools={"aux": StatePool(tensors=[torch.zeros(8, 6)]), "ssm": StatePool(tensors=[torch.zeros(8, 2)])},
        )
        .validate(lay)
        .pool_specs
    )
    out = pool_mismatches(mine, theirs)
    assert out == ["pool 'ssm': registered at the peer only", "pool 'aux' rows: [[5]] here vs [[6]] at peer"]
    assert lay.summary(mine).mismatches(lay.summary(theirs)) == out
    assert pool_mismatches(mine, mine) == []


def stage_layout(stage: range) -> KVLayout:
    """A prefill PP stage of a 4-layer model (two stages)."""
    return KVLayout(num_layers=4, total_kv_heads=4, head_dim=8, dtype=torch.bfloat16, page_size=4, tp_size=1,
                    tp_rank=0, pp_size=2, pp_rank=stage.start // 2, stage=stage)


def test_a_pool_of_one_layer_is_registered_by_the_stage_holding_it_and_compared_where_both_hold_it():
    """StatePool(layer=L): a stage registers the pools of its own layers only (another's is a
    ValueError naming the stage); two ranks compare the pools of the layers both hold, a pool of
    a layer one of them lacks being registered there only, as it should."""
    first = stage_layout(range(0, 2))
    state = StatePool(tensors=[torch.zeros(8, 5)], layer=1)
    assert state.spec("m1", first).layer == 1 and StatePool(tensors=[torch.zeros(8, 5)]).spec("aux", first).layer == -1
    for bad in (2, -1, True, "1"):
        with pytest.raises(ValueError, match=r"layer must be None or a model layer of this rank's stage \[0, 2\)"):
            StatePool(tensors=[torch.zeros(8, 5)], layer=bad).spec("m", first)
    whole = KVLayout(num_layers=4, total_kv_heads=4, head_dim=8, dtype=torch.bfloat16, page_size=4, tp_size=1,
                     tp_rank=0)
    spec = {n: StatePool(tensors=[torch.zeros(8, 5)], layer=n).spec(f"m{n}", whole) for n in range(4)}
    aux = StatePool(tensors=[torch.zeros(8, 3)]).spec("aux", whole)
    stage0 = [aux, spec[0], spec[1]]
    decode = [aux, *spec.values()]          # a decode rank of no PP holds every layer
    assert pool_mismatches(stage0, decode, shared=range(0, 2)) == []
    assert pool_mismatches(stage0, decode) == ["pool 'm2': registered at the peer only",
                                               "pool 'm3': registered at the peer only"]
    assert pool_mismatches(stage0, [aux, spec[0]], shared=range(0, 2)) == ["pool 'm1': registered here only"]
    assert pool_mismatches([spec[0]], decode, shared=range(0, 2)) == ["pool 'aux': registered at the peer only",
                                                                      "pool 'm1': registered at the peer only"]
    other = StatePool(tensors=[torch.zeros(8, 5)], layer=2).spec("m1", whole)   # one name, another layer
    assert pool_mismatches([spec[1]], [other], shared=range(0, 4)) == ["pool 'm1' layer: 1 here vs 2 at peer"]


def test_a_flow_carries_the_pools_of_the_layers_it_writes_and_those_of_no_layer_with_the_last():
    whole = KVLayout(num_layers=4, total_kv_heads=4, head_dim=8, dtype=torch.bfloat16, page_size=4, tp_size=1,
                     tp_rank=0)
    specs = [StatePool(tensors=[torch.zeros(8, 5)], layer=n).spec(f"m{n}", whole) for n in range(4)]
    specs.append(StatePool(tensors=[torch.zeros(8, 3)]).spec("aux", whole))
    assert [p.name for p in carried_pools(specs, range(0, 2), False)] == ["m0", "m1"]
    assert [p.name for p in carried_pools(specs, range(2, 4), True)] == ["m2", "m3", "aux"]
    assert [p.name for p in carried_pools(specs, range(1, 3), False)] == ["m1", "m2"]
    assert carried_pools(specs, range(4, 4), False) == ()


def test_request_items_are_checked_in_the_callers_thread():
    pools = {"aux": StatePool(tensors=[torch.zeros(8, 5)])}
    pools["aux"].spec("aux", layout())
    assert check_pool_items({"aux": [3, 1]}, pools, "x")["aux"].tolist() == [3, 1]
    for bad, match in (
        ({"ssm": [0]}, "unknown pool 'ssm'"),
        ({"aux": [8]}, r"outside \[0, 8\)"),
        ({"aux": [1, 1]}, "twice"),
        ({"aux": [[1]]}, "1-D list of ints"),
        ([1], "must be a dict"),
    ):
        with pytest.raises(ValueError, match=match):
            check_pool_items(bad, pools, "x")


SPEC_CASES = [(P, D, H) for P in (1, 2, 4) for D in (1, 2, 4) for H in (2, 4, 8)]


@pytest.mark.parametrize("P, D, H", SPEC_CASES)
def test_every_decode_rank_gets_every_pool_byte_exactly_once(P, D, H):
    """Summed over its writers, a decode rank receives each replicated item once and each of its
    heads of a heads pool once, from flows the KV makes anyway."""
    lay = KVLayout(num_layers=2, total_kv_heads=H, head_dim=8, dtype=torch.bfloat16, page_size=4, tp_size=P, tp_rank=0)
    specs = (
        KVBuffers(
            *kv(lay),
            pools={
                "aux": StatePool(tensors=[torch.zeros(8, 5)]),
                "ssm": StatePool(tensors=[torch.zeros(8, max(1, H // P), 3)], sharding="heads"),
            },
        )
        .validate(lay)
        .pool_specs
    )
    assert writers_mismatch(specs, P, D, H, False) == ""
    mapping = compute_assignments(P, D, H)
    for d in range(D):
        segs = [s for a in mapping.for_decode(d) for s in writer_segments(specs, P, D, a)]
        assert sum(s.item_bytes for s in segs if s.pool == "aux") == 5 * 4
        heads = sorted(h for s in segs if s.pool == "ssm" for h in range(*s.dst_heads))
        assert heads == list(range(max(1, H // D)))
        assert all(s.item_bytes == (s.dst_heads[1] - s.dst_heads[0]) * 3 * 4 for s in segs if s.pool == "ssm")


def test_heads_pool_with_other_writers_than_the_kv_is_refused_at_connect():
    lay = KVLayout(
        num_layers=2, total_kv_heads=2, head_dim=8, dtype=torch.bfloat16, page_size=4, tp_size=4, tp_rank=0
    )  # P4 over 2 KV heads: KV replicated
    specs = (
        KVBuffers(*kv(lay), pools={"ssm": StatePool(tensors=[torch.zeros(8, 2, 3)], sharding="heads", heads=8)})
        .validate(lay)
        .pool_specs
    )
    why = writers_mismatch(specs, 4, 1, 2, False)
    assert "pool 'ssm'" in why and "must have the KV's writers" in why
    assert writers_mismatch(specs[:0], 4, 1, 2, False) == ""


def test_mla_with_a_replicated_pool():
    lay = layout(tp=2, mla=True)
    specs = (
        KVBuffers(*kv(lay), pools={"aux": StatePool(tensors=[torch.zeros(8, 7, dtype=torch.int32)])})
        .validate(lay)
        .pool_specs
    )
    mapping = compute_assignments(2, 4, 1, True)
    for d in range(4):
        (a,) = mapping.for_decode(d)
        assert [s.item_bytes for s in writer_segments(specs, 2, 4, a)] == [28]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(SPEC_CASES), st.integers(1, 64), st.integers(0, 4), st.integers(0, 4))
def test_final_part_offsets_tile_the_region(case, head_bytes, n_aux, n_ssm):
    """Writers' parts of the last piece (KV then pool block), as final_part places them, follow
    each other without a gap or an overlap and add up to the decode rank's KV and pool bytes."""
    P, D, H = case
    lay = KVLayout(num_layers=2, total_kv_heads=H, head_dim=8, dtype=torch.bfloat16, page_size=4, tp_size=P, tp_rank=0)
    specs = (
        KVBuffers(
            *kv(lay),
            pools={
                "aux": StatePool(tensors=[torch.zeros(8, 5)]),
                "ssm": StatePool(tensors=[torch.zeros(8, max(1, H // P), 3)], sharding="heads"),
            },
        )
        .validate(lay)
        .pool_specs
    )
    mapping = compute_assignments(P, D, H)
    src = {"aux": np.arange(n_aux), "ssm": np.arange(n_ssm)}
    for d in range(D):
        end = 0
        for a in mapping.for_decode(d):  # in writer order
            offset, copies = final_part(specs, mapping, a, head_bytes, src, None)
            assert offset == end, (d, a)
            end = offset + head_bytes * a.num_heads + block_bytes(copies)
        heads = max(1, H // D)
        assert end == head_bytes * heads + n_aux * 5 * 4 + n_ssm * heads * 3 * 4, d


def test_prefill_and_decode_agree_on_the_last_piece_layout():
    P, D, H = 2, 1, 4
    lay = KVLayout(num_layers=2, total_kv_heads=H, head_dim=8, dtype=torch.bfloat16, page_size=4, tp_size=P, tp_rank=0)
    specs = (
        KVBuffers(
            *kv(lay),
            pools={
                "aux": StatePool(tensors=[torch.zeros(8, 5)]),
                "ssm": StatePool(tensors=[torch.zeros(8, 2, 3)], sharding="heads"),
            },
        )
        .validate(lay)
        .pool_specs
    )
    mapping = compute_assignments(P, D, H)
    src = {"aux": np.array([3]), "ssm": np.array([1, 2])}
    dst = {"aux": np.array([0]), "ssm": np.array([5, 6])}
    head_bytes = 100
    decode_sizes = [
        head_bytes * a.num_heads + block_bytes(request_copies(writer_segments(specs, P, D, a), None, dst))
        for a in mapping.for_decode(0)
    ]
    for a in mapping.for_decode(0):
        offset, copies = final_part(specs, mapping, a, head_bytes, src, dst)
        assert offset == part_offsets(decode_sizes)[a.writer_index]
        assert [c.dst_items.tolist() for c in copies] == ([[0]] if a.writer_index == 0 else []) + [[5, 6]]


def test_counts_mismatch():
    assert counts_mismatch({"aux": np.array([1])}, {"aux": 1}) == ""
    assert "pool items differ" in counts_mismatch({"aux": np.array([1])}, {"aux": 2})
    assert "pool items differ" in counts_mismatch({}, {"aux": 1})


def test_the_last_piece_is_split_so_its_pool_blocks_fit_the_ring_and_buffers():
    from kvstage.transfer.protocol.decode.chunk_pieces import fit_pools
    from kvstage.transfer.protocol.decode.room import RoomPlan
    from kvstage.transfer.protocol.decode.tracker import RoomTracker

    tracker = RoomTracker(10, {0: 100, 1: 100}, {0: 300, 1: 50})   # pages of 200 B, 350 B of pools

    def fit(planned, **plan):
        return fit_pools(tracker, RoomPlan(writers=(), staged=True, head_page_bytes=50, max_piece_pages=8, **plan),
                         planned, range(1), [0, 1])

    # the last piece of 8 pages needs 8*200+350 > 1000: at most 3 pages (3*200+350 = 950) go with the pools
    assert fit([(0, 2), (2, 8)], ring_size=1000, buffer_bytes=10_000) == [(0, 2), (2, 5), (7, 3)]
    assert fit([(0, 3)], ring_size=1000, buffer_bytes=10_000) == [(0, 3)]
    assert fit([(0, 3)], ring_size=1000, buffer_bytes=450) == [(0, 2), (2, 1)]    # writer 0: 100 B a page + 300 B
    assert fit([(0, 3)], ring_size=500, buffer_bytes=10_000) == []                # 200 + 350 > 500: not one page
