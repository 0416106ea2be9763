"""Moving state pool items into a staged block and back out (staging/pool_copies.py): bit-exact
for any dtype, head range, item list and byte offset, and in ONE torch op per request."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from kvstage import StatePool
from kvstage.staging.pool_copies import LandedBlock, PoolBytes, gather_pools, scatter_pools
from kvstage.transfer.protocol.pool_parts import PoolCopy, PoolSegment

ITEMS = 6


def pools(seed: int, heads: int) -> dict:
    g = torch.Generator().manual_seed(seed)

    def rnd(shape, dtype):
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).view(dtype).reshape(*shape[:-1], -1)

    return {
        "mamba": StatePool(
            tensors=[rnd((ITEMS, heads, 3, 8), torch.float32), rnd((ITEMS, heads, 2, 4), torch.bfloat16)],
            sharding="heads",
            heads=heads,
        ),
        "aux": StatePool(tensors=[rnd((ITEMS, 12), torch.int32), rnd((ITEMS, 1), torch.uint8)]),
    }


def copies(p: dict, src_items, dst_items, src_heads, dst_heads) -> list[PoolCopy]:
    """Every tensor of both pools, one after another (heads pool: the given local head ranges)."""
    out, offset = [], 0
    for name, pool in sorted(p.items()):
        for i, t in enumerate(pool.tensors):
            hs, hd = (src_heads, dst_heads) if pool.sharding == "heads" else (None, None)
            row = t[0].numel() * t.element_size()
            item_bytes = row if hs is None else row // t.shape[1] * (hs[1] - hs[0])
            n = len(src_items) * item_bytes
            out.append(
                PoolCopy(PoolSegment(name, i, hs, hd, item_bytes), np.array(src_items), np.array(dst_items), offset, n)
            )
            offset += n
    return out


def expected_block(p: dict, cs: list[PoolCopy]) -> bytes:
    parts = []
    for c in cs:
        t = p[c.segment.pool].tensors[c.segment.tensor]
        for i in c.src_items:
            row = (
                t[int(i)] if c.segment.src_heads is None else t[int(i), c.segment.src_heads[0] : c.segment.src_heads[1]]
            )
            parts.append(row.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return b"".join(parts)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_gather_then_scatter_moves_exactly_the_named_items(data):
    heads = data.draw(st.sampled_from([1, 2, 4]), "heads")
    n = data.draw(st.integers(1, 3), "items per request")
    src_items = data.draw(st.lists(st.integers(0, ITEMS - 1), min_size=n, max_size=n, unique=True), "src")
    dst_items = data.draw(st.lists(st.integers(0, ITEMS - 1), min_size=n, max_size=n, unique=True), "dst")
    width = data.draw(st.integers(1, heads), "heads moved")
    h0 = data.draw(st.integers(0, heads - width), "src head")
    d0 = data.draw(st.integers(0, heads - width), "dst head")
    offset = data.draw(st.integers(0, 9), "byte offset")  # the block may start at any byte
    src, dst = pools(1, heads), pools(2, heads)
    before = {k: [t.clone() for t in v.tensors] for k, v in dst.items()}
    cs = copies(src, src_items, dst_items, (h0, h0 + width), (d0, d0 + width))
    total = sum(c.nbytes for c in cs)
    out = torch.full((offset + total + 3,), 0xAB, dtype=torch.uint8)

    assert gather_pools(PoolBytes(src), cs, out, offset) == total
    assert out[offset : offset + total].numpy().tobytes() == expected_block(src, cs)
    assert bool((out[:offset] == 0xAB).all()) and bool((out[offset + total :] == 0xAB).all())

    scatter_pools(PoolBytes(dst), [LandedBlock(out[offset + c.offset : offset + c.offset + c.nbytes], c) for c in cs])
    for name, pool in dst.items():
        for i, t in enumerate(pool.tensors):
            want = before[name][i].clone()
            sharded = pool.sharding == "heads"
            for s, d in zip(src_items, dst_items):
                if sharded:
                    want[d, d0 : d0 + width] = src[name].tensors[i][s, h0 : h0 + width]
                else:
                    want[d] = src[name].tensors[i][s]
            assert torch.equal(t.view(torch.uint8), want.view(torch.uint8)), (name, i)


def snapshot(p: dict) -> dict:
    return {(name, i): t.clone() for name, pool in p.items() for i, t in enumerate(pool.tensors)}


def changed(p: dict, before: dict) -> list:
    """The (pool, tensor) whose bytes differ from `before`, over every tensor of every pool."""
    now = snapshot(p)
    assert now.keys() == before.keys()
    return [k for k in now if not torch.equal(now[k].view(torch.uint8), before[k].view(torch.uint8))]


@pytest.mark.parametrize("item", [ITEMS, -1])
def test_an_item_outside_the_pool_is_refused_before_any_byte_moves(item):
    """The bad item is in the last copy only: every copy before it (both "aux" tensors, the
    first "mamba" one) is valid, and none of them may have moved a byte."""
    src, dst = pools(1, 2), pools(2, 2)
    good = copies(src, [0, 1], [1, 2], (0, 2), (0, 2))
    last = good[-1]
    assert (last.segment.pool, last.segment.tensor) == ("mamba", 1)
    src_before, dst_before = snapshot(src), snapshot(dst)
    bad_src = good[:-1] + [PoolCopy(last.segment, np.array([0, item]), last.dst_items, last.offset, last.nbytes)]
    out = torch.zeros(sum(c.nbytes for c in good), dtype=torch.uint8)
    with pytest.raises(ValueError, match=f"item {item} is out of range"):
        gather_pools(src, bad_src, out, 0)
    assert not out.any() and changed(src, src_before) == []
    gather_pools(src, good, out, 0)
    bad_dst = good[:-1] + [PoolCopy(last.segment, last.src_items, np.array([1, item]), last.offset, last.nbytes)]
    with pytest.raises(ValueError, match=f"item {item} is out of range"):
        scatter_pools(dst, [LandedBlock(out[c.offset : c.offset + c.nbytes], c) for c in bad_dst])
    assert changed(dst, dst_before) == []


def test_a_block_of_the_wrong_size_is_refused():
    src = pools(1, 2)
    (c, *_) = copies(src, [0], [1], (0, 1), (0, 1))
    with pytest.raises(ValueError, match="landed block"):
        scatter_pools(src, [LandedBlock(torch.zeros(c.nbytes + 1, dtype=torch.uint8), c)])


class _Ops(TorchDispatchMode):
    """The aten ops a call runs, views (what plain indexing makes) left out."""

    VIEWS = {"select", "slice", "view", "alias", "as_strided", "_reshape_alias"}

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in self.VIEWS:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def test_a_request_moves_all_its_items_in_one_torch_op():
    """Every torch op releases the GIL and must win it back from the rank's polling control
    thread: a few ops per tensor made the pool copies 1.7-2.6x slower (docs/journal/benchmarks-2026-11.md, "State
    pools"). Indexing the cached byte views is not an op; the copy is one."""
    src, dst = pools(1, 4), pools(2, 4)
    pb_src, pb_dst = PoolBytes(src), PoolBytes(dst)
    cs = copies(src, [3, 1, 4], [0, 2, 5], (1, 3), (2, 4))
    out = torch.zeros(sum(c.nbytes for c in cs), dtype=torch.uint8)
    gather_pools(pb_src, cs, out, 0)  # the first call builds the byte views
    scatter_pools(pb_dst, [LandedBlock(out[c.offset : c.offset + c.nbytes], c) for c in cs])
    with _Ops() as g:
        gather_pools(pb_src, cs, out, 0)
    with _Ops() as s:
        scatter_pools(pb_dst, [LandedBlock(out[c.offset : c.offset + c.nbytes], c) for c in cs])
    assert g.ops == ["_foreach_copy_"] and s.ops == ["_foreach_copy_"], (g.ops, s.ops)
