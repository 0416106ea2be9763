"""Heads pools whose head axis is several sub-blocks sharded each on its own (GDN's conv state,
[q | k | v]): which bytes each flow moves, checked against a model of the global axis."""

import itertools

import numpy as np
import pytest
import torch

from kvstage import KVBuffers, KVLayout, StatePool
from kvstage.transfer.pool_spec import PoolSpec
from kvstage.transfer.protocol.head_mapping import compute_assignments
from kvstage.transfer.protocol.pool_parts import writer_segments, writers_mismatch

TP_SIZES = (1, 2, 4, 8)
BLOCK_SETS = ([8, 8, 16], [16, 16, 32], [24, 8, 8, 40], [8, 8])


def share(global_axis: np.ndarray, blocks: list[int], tp: int, rank: int) -> np.ndarray:
    """What rank `rank` of a TP group of `tp` holds: its slice of every block, one after another."""
    parts, at = [], 0
    for b in blocks:
        n = b // tp
        parts.append(global_axis[:, at + rank * n: at + (rank + 1) * n])
        at += b
    return np.concatenate(parts, axis=1)


def spec(blocks: list[int]) -> PoolSpec:
    return PoolSpec(name="conv", sharding="heads", heads=sum(blocks), dtypes=["int32"], rows=[[3]], blocks=blocks)


def moved(blocks: list[int], P: int, D: int, kv_heads: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Run every flow's pool segments over the model; returns (what each decode rank received,
    how many times each of its positions was written)."""
    items, width = 5, sum(blocks)
    axis = np.arange(items * width, dtype=np.int64).reshape(items, width)
    src = [share(axis, blocks, P, p) for p in range(P)]
    got = [np.full((items, width // D), -1, dtype=np.int64) for _ in range(D)]
    hits = [np.zeros((items, width // D), dtype=np.int64) for _ in range(D)]
    for a in compute_assignments(P, D, kv_heads).assignments:
        for seg in writer_segments([spec(blocks)], P, D, a):
            (s0, s1), (d0, d1) = seg.src_heads, seg.dst_heads
            assert s1 - s0 == d1 - d0 and seg.item_bytes == (s1 - s0) * 3 * 4
            got[a.decode_rank][:, d0:d1] = src[a.prefill_rank][:, s0:s1]
            hits[a.decode_rank][:, d0:d1] += 1
    expected = [share(axis, blocks, D, d) for d in range(D)]
    return [g - e for g, e in zip(got, expected)], hits


@pytest.mark.parametrize("blocks", BLOCK_SETS, ids=lambda b: "x".join(map(str, b)))
def test_every_position_of_every_decode_share_is_written_once_from_the_right_source(blocks):
    checked = 0
    for P, D in itertools.product(TP_SIZES, TP_SIZES):
        if any(b % max(P, D) for b in blocks):
            continue
        assert writers_mismatch([spec(blocks)], P, D, 8, False) == ""
        diffs, hits = moved(blocks, P, D, kv_heads=8)
        for d in range(D):
            assert (hits[d] == 1).all(), f"P{P} -> D{D}: decode rank {d} positions written {hits[d].tolist()}"
            assert not diffs[d].any(), f"P{P} -> D{D}: decode rank {d} got the wrong channels"
        checked += 1
    assert checked == (16 if all(b % 8 == 0 for b in blocks) else 9)


def test_a_flow_carries_one_segment_per_block_at_the_blocks_offsets():
    # P2 -> D1, blocks [8, 8, 16]: prefill rank 1 holds [4 | 4 | 8] and writes the second half of
    # each of decode rank 0's blocks [8 | 8 | 16]
    a = compute_assignments(2, 1, 8).find(1, 0)
    segs = writer_segments([spec([8, 8, 16])], 2, 1, a)
    assert [(s.src_heads, s.dst_heads) for s in segs] == [((0, 4), (4, 8)), ((4, 8), (12, 16)), ((8, 16), (24, 32))]


def test_writers_that_differ_from_the_kvs_are_named():
    # KV of 2 heads, P4 -> D8: decode rank 1 holds a copy of head 0, written by prefill rank 1
    # (a replica holder); the pool's blocks split eight ways would be written there by rank 0
    why = writers_mismatch([spec([8, 8, 16])], 4, 8, 2, False)
    assert why.startswith("pool 'conv' (a block of 8 of its heads [8, 8, 16]) would be written to decode rank 1 "
                          "by prefill ranks [0], its KV (2 heads) by [1]")
    assert writers_mismatch([spec([8, 8, 16])], 2, 4, 2, False) == ""


def _layout(tp: int, rank: int = 0) -> KVLayout:
    return KVLayout(num_layers=1, total_kv_heads=8, head_dim=4, dtype=torch.bfloat16, page_size=2, tp_size=tp,
                    tp_rank=rank)


def _buffers(lay: KVLayout, pool: StatePool) -> KVBuffers:
    shape = (4 * lay.page_size, lay.local_heads, lay.head_dim)
    return KVBuffers([torch.zeros(shape, dtype=lay.dtype)], [torch.zeros(shape, dtype=lay.dtype)],
                     pools={"conv": pool})


def test_a_rank_holds_its_share_of_every_block():
    lay = _layout(tp=2)
    b = _buffers(lay, StatePool(tensors=[torch.zeros(3, 4 + 4 + 8, 2)], sharding="heads", blocks=[8, 8, 16]))
    b.validate(lay)
    assert b.pool_specs[0].heads == 32 and b.pool_specs[0].blocks == [8, 8, 16]


@pytest.mark.parametrize(
    "pool, match",
    [
        (StatePool(tensors=[torch.zeros(3, 16, 2)], sharding="heads", blocks=[8, 8, 16]), "has 16 heads in dim 1"),
        (StatePool(tensors=[torch.zeros(3, 8, 2)], sharding="heads", blocks=[6, 6, 4]), "block 0 of 6 heads does not "
                                                                                        "divide by TP size 4"),
        (StatePool(tensors=[torch.zeros(3, 8, 2)], sharding="heads", heads=30, blocks=[8, 8, 16]), "add up to 32"),
        (StatePool(tensors=[torch.zeros(3, 8)], blocks=[8, 8]), "blocks is only for sharding='heads'"),
        (StatePool(tensors=[torch.zeros(3, 8, 2)], sharding="heads", blocks=[8, 0]), "positive ints"),
    ],
)
def test_bad_blocks_are_refused_naming_the_pool(pool, match):
    lay = _layout(tp=4)
    with pytest.raises(ValueError, match=match):
        _buffers(lay, pool).validate(lay)


def test_one_block_is_the_plain_heads_split():
    lay = _layout(tp=2)
    b = _buffers(lay, StatePool(tensors=[torch.zeros(3, 4, 2)], sharding="heads", blocks=[8]))
    b.validate(lay)
    assert b.pool_specs[0].blocks == [] and b.pool_specs[0].heads == 8
