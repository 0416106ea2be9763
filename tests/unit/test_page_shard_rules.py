"""KV page sharding (transfer/protocol/page_shards.py): which rank owns which position, the page
mask a sharded writer's tag carries, the pairings served, the mapping where every prefill rank
writes every decode rank, the prefill's writes of the positions it owns, and the decode tracker
that takes each cell once from any writer."""

import itertools
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvstage.transfer.kv_buffers import KVBuffers
from kvstage.transfer.layout import KVLayout
from kvstage.transfer.protocol import peering
from kvstage.transfer.protocol.actions import PeerKey
from kvstage.transfer.protocol.decode.tracker import Outcome, RoomTracker
from kvstage.transfer.protocol.head_mapping import Assignment, compute_assignments
from kvstage.transfer.protocol.page_shards import (
    MAX_MASK_PAGES,
    ShardSide,
    decode_mask,
    encode_mask,
    owned,
    pairing_problem,
    pool_assignment,
)
from kvstage.transfer.protocol.prefill.chunk_writes import ChunkWrites, direct_writes
from kvstage.transfer.protocol.prefill.flows import Chunk
from kvstage.transfer.state_pools import StatePool


@given(st.lists(st.integers(0, 10_000), min_size=1, max_size=200, unique=True), st.integers(1, 8))
def test_the_ranks_own_every_position_exactly_once_with_its_local_page(pages, n):
    arr = np.array(pages, dtype=np.int64)
    masks = [owned(arr, n, r) for r in range(n)]
    assert (np.sum([m.mask for m in masks], axis=0) == 1).all()
    for r, m in enumerate(masks):
        assert (arr[m.mask] % n == r).all() and m.local.tolist() == (arr[m.mask] // n).tolist()


@given(st.lists(st.booleans(), min_size=1, max_size=3000))
def test_a_mask_round_trips_and_one_naming_a_page_past_its_write_is_refused(bits):
    mask = np.array(bits)
    data = encode_mask(mask)
    assert len(data) == -(-len(bits) // 8)
    assert decode_mask(data, len(bits)).tolist() == bits
    if len(bits) % 8:   # a bit set past the write's last position
        assert decode_mask(data[:-1] + bytes([data[-1] | 0x80]), len(bits)) is None
    assert decode_mask(data + b"\0", len(bits)) is None and decode_mask(data, 0) is None


SERVED = (ShardSide(tp_size=2, mla=True, page_shards=2), ShardSide(tp_size=2, mla=True))


@pytest.mark.parametrize("prefill, decode, reason", [
    (ShardSide(tp_size=2, mla=True, page_shards=2), ShardSide(tp_size=4, mla=True), "same TP size"),
    (ShardSide(tp_size=4, mla=True, page_shards=2), ShardSide(tp_size=4, mla=True), "whole TP group"),
    (ShardSide(tp_size=2, mla=False, page_shards=2), ShardSide(tp_size=2, mla=False), "MLA only"),
    (ShardSide(tp_size=2, mla=True, page_shards=2), ShardSide(tp_size=2, mla=True, dcp_size=2), "decode context"),
    (ShardSide(tp_size=2, mla=True, page_shards=2, draft_pools=1), ShardSide(tp_size=2, mla=True), "draft"),
    (ShardSide(tp_size=2, mla=True), ShardSide(tp_size=2, mla=True, page_shards=2), "prefill engines only"),
])
def test_a_pairing_kvstage_does_not_serve_is_refused_naming_both_sides(prefill, decode, reason):
    assert pairing_problem(*SERVED) is None and pairing_problem(SERVED[1], SERVED[1]) is None
    # each PP stage's TP group shards its own layers' pages: served with PP on either side
    assert pairing_problem(ShardSide(tp_size=2, mla=True, page_shards=2, pp_size=2),
                           ShardSide(tp_size=2, mla=True, pp_size=2)) is None
    why = pairing_problem(prefill, decode)
    assert why is not None and reason in why
    assert why.startswith(f"{prefill.describe('prefill')} -> {decode.describe('decode')}")


def test_every_prefill_rank_writes_every_decode_rank_when_pages_are_sharded():
    m = compute_assignments(4, 4, 1, True, 4)
    assert m.page_shards == 4
    for d in range(4):
        assert m.writers_of(d) == [0, 1, 2, 3]
    assert m.decode_peers_of(2) == [0, 1, 2, 3] and m.prefill_peers_of(1) == ([0, 1, 2, 3], [])
    assert compute_assignments(4, 4, 1, True).writers_of(1) == [1]   # unsharded: one writer
    with pytest.raises(ValueError, match="same|equal"):
        compute_assignments(2, 4, 1, True, 2)
    a = m.find(3, 1)
    assert a is not None and pool_assignment(a, 4).writer_index == 0 and pool_assignment(a, 1) is a


def test_a_layout_shards_its_pages_over_its_whole_tp_group_of_an_mla_model_only():
    base = dict(num_layers=2, total_kv_heads=1, head_dim=8, dtype=torch.bfloat16, page_size=4, tp_size=2, tp_rank=1)
    assert KVLayout(**base, mla=True, page_shards=2).page_shards == 2
    for bad, match in ((dict(mla=False, total_kv_heads=2, page_shards=2), "MLA only"),
                       (dict(mla=True, page_shards=4), "whole TP group"),
                       (dict(mla=True, page_shards=0), "positive")):
        with pytest.raises(ValueError, match=match):
            KVLayout(**{**base, **bad})


def _recs(shards_by_rank):
    return [SimpleNamespace(tp_rank=r, tp_size=len(shards_by_rank), role="prefill", incarnation=100 + r,
                            layout={"num_layers": 4, "page_shards": s}) for r, s in enumerate(shards_by_rank)]


def test_the_decode_side_reads_the_prefills_shards_and_plans_every_rank_as_a_writer():
    stages = peering.read_stages("e", _recs([2, 2]), 4)
    assert stages.page_shards == 2
    dec = KVLayout(num_layers=4, total_kv_heads=1, head_dim=8, dtype=torch.bfloat16, page_size=4, tp_size=2,
                   tp_rank=1, mla=True)
    need = peering.needed_ranks(stages.tp_size, dec, stages.layers, stages.draft_pools, stages.page_shards)
    assert need.writers == [0, 1] and need.notices == [] and need.mapping.page_shards == 2
    assert peering.read_stages("e", _recs([1, 1]), 4).page_shards == 1
    with pytest.raises(ValueError, match="disagree on how many ways"):
        peering.read_stages("e", _recs([2, 1]), 4)
    wide = KVLayout(num_layers=4, total_kv_heads=1, head_dim=8, dtype=torch.bfloat16, page_size=4, tp_size=4,
                    tp_rank=1, mla=True)
    with pytest.raises(ValueError, match="prefill TP 2 .* -> decode TP 4"):
        peering.needed_ranks(2, wide, None, 0, 2)


HEAD_PAGE = 100
PEER = PeerKey("d", 0, 77)


class _Copy:
    nbytes = 9


def _writes(pages, rank, *, pools_at=None, page_start=0):
    a = Assignment(prefill_rank=rank, decode_rank=0, src_heads=(0, 1), dst_heads=(0, 1), writer_index=rank,
                   num_writers=2)
    chunk = Chunk(index=0, page_start=page_start, pages=np.array(pages, dtype=np.int64), layers=range(0, 2))
    return ChunkWrites(room=5, me=11, writer=rank, peer=PEER, session=6, assignment=a, chunk=chunk, wire=0,
                       head_page_bytes=HEAD_PAGE, pools_at=pools_at)


def test_a_sharded_rank_writes_only_the_positions_it_owns_from_its_local_pages():
    logical = [7, 8, 9, 12, 14, 3]          # owners 1 0 1 0 0 1
    dst = np.arange(500, 506)
    asked = []
    ops = {r: direct_writes(_writes(logical, r, pools_at=6), dst_pages=dst, ranges_per_page=2, max_ranges=1000,
                            pools=lambda: asked.append(1) or (_Copy(),), op_ids=itertools.count(1), shard=(2, r))
           for r in (0, 1)}
    (z,), (o,) = ops[0], ops[1]
    assert z.src_pages.tolist() == [4, 6, 7] and z.dst_pages.tolist() == [501, 503, 504]
    assert o.src_pages.tolist() == [3, 4, 1] and o.dst_pages.tolist() == [500, 502, 505]
    assert decode_mask(z.tag.pages_mask, 6).tolist() == [False, True, False, True, True, False]
    assert (z.tag.page_start, z.tag.num_pages) == (o.tag.page_start, o.tag.num_pages) == (0, 6)
    # the pools go with the write holding the last position: rank 1's
    assert z.pools == () and len(o.pools) == 1 and asked == [1]
    assert z.nbytes == 3 * HEAD_PAGE and o.nbytes == 3 * HEAD_PAGE + 9


def test_a_part_with_no_owned_position_is_not_written_and_parts_stay_within_the_mask_limit():
    ops = direct_writes(_writes([2, 4, 6, 1], 1), dst_pages=np.arange(4), ranges_per_page=1, max_ranges=2,
                        pools=lambda: (), op_ids=itertools.count(1), shard=(2, 1))
    assert [(op.piece, op.tag.page_start, op.src_pages.tolist()) for op in ops] == [(1, 2, [0])]
    many = direct_writes(_writes(np.arange(3 * MAX_MASK_PAGES), 0), dst_pages=np.arange(3 * MAX_MASK_PAGES),
                         ranges_per_page=1, max_ranges=10**9, pools=lambda: (), op_ids=itertools.count(1), shard=(2, 0))
    assert [op.tag.num_pages for op in many] == [MAX_MASK_PAGES] * 3
    assert all(len(op.tag.pages_mask) == MAX_MASK_PAGES // 8 for op in many)


PAGE = 10   # a writer's bytes per page, every layer (2 layers)


def _tracker(extra=None, shared=True):
    return RoomTracker(6, {0: PAGE, 1: PAGE}, extra or {}, num_layers=2, shared=shared)


def test_the_shared_tracker_takes_each_cell_once_from_any_writer():
    t = _tracker({0: 9, 1: 9})
    zero = encode_mask(np.array([0, 1, 0, 1, 1, 0], dtype=bool))
    one = encode_mask(np.array([1, 0, 1, 0, 0, 1], dtype=bool))
    assert t.arrive_direct(0, 0, 0, 6, 3 * PAGE, pages_mask=zero).outcome is Outcome.ACCEPTED
    assert not t.complete and t.pages_done == 3
    # the writer of the last position carries the pools; the other's bytes would be wrong with them
    assert t.arrive_direct(1, 0, 0, 6, 3 * PAGE, pages_mask=one).outcome is Outcome.REJECTED
    assert t.arrive_direct(1, 0, 0, 6, 3 * PAGE + 9, pages_mask=one).outcome is Outcome.ACCEPTED
    assert t.complete and t.pages_done == 6


def test_the_shared_tracker_rejects_a_page_two_writers_wrote_and_a_mask_in_an_unsharded_room():
    t = _tracker()
    a = encode_mask(np.array([1, 1, 0, 0, 0, 0], dtype=bool))
    b = encode_mask(np.array([0, 1, 1, 1, 1, 1], dtype=bool))
    assert t.arrive_direct(0, 0, 0, 6, 2 * PAGE, pages_mask=a).outcome is Outcome.ACCEPTED
    bad = t.arrive_direct(1, 0, 0, 6, 5 * PAGE, pages_mask=b)
    assert bad.outcome is Outcome.REJECTED and "another writer" in bad.reason
    plain = _tracker(shared=False).arrive_direct(0, 0, 0, 6, 2 * PAGE, pages_mask=a)
    assert plain.outcome is Outcome.REJECTED and "does not shard" in plain.reason
    empty = _tracker().arrive_direct(0, 0, 0, 6, 0, pages_mask=encode_mask(np.zeros(6, dtype=bool)))
    assert empty.outcome is Outcome.REJECTED


def test_the_shared_tracker_is_complete_only_once_every_layer_of_every_page_landed():
    t = _tracker()
    every = encode_mask(np.ones(6, dtype=bool))
    assert t.arrive_direct(0, 0, 0, 6, 6 * PAGE // 2, layers=range(0, 1), pages_mask=every).outcome is Outcome.ACCEPTED
    assert not t.complete and t.pages_done == 0
    assert t.arrive_direct(1, 0, 0, 6, 6 * PAGE // 2, layers=range(1, 2), pages_mask=every).outcome is Outcome.ACCEPTED
    assert t.complete and t.pages_done == 6


def test_a_decode_rank_that_would_shard_its_pages_fails_before_anything_starts():
    from kvstage.transfer.config import EngineConfig
    from kvstage.transfer.engine.manager import KVManager
    lay = KVLayout(num_layers=2, total_kv_heads=1, head_dim=8, dtype=torch.bfloat16, page_size=4, tp_size=2,
                   tp_rank=0, mla=True, page_shards=2)
    cfg = EngineConfig(role="decode", engine_id="e", bootstrap="127.0.0.1:1", staging=False)
    with pytest.raises(ValueError, match="page_shards=2 on a decode rank"):
        KVManager(cfg, lay, None)   # type: ignore[arg-type] - refused before the buffers are looked at


def test_a_sharded_rank_takes_replicated_pools_and_refuses_pools_split_by_heads():
    lay = KVLayout(num_layers=2, total_kv_heads=1, head_dim=8, dtype=torch.bfloat16, page_size=4, tp_size=2,
                   tp_rank=0, mla=True, page_shards=2)

    def buffers(pool):
        return KVBuffers([torch.zeros(16, 1, 8, dtype=torch.bfloat16) for _ in range(2)], None, pools={"p": pool})
    assert buffers(StatePool(tensors=[torch.zeros(16, 5)])).validate(lay).num_pages == 4
    with pytest.raises(ValueError, match=r"pools \['p'\] are split by heads"):
        buffers(StatePool(tensors=[torch.zeros(4, 1, 6)], sharding="heads", heads=2)).validate(lay)
