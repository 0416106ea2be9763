"""The layer-axis mapping of pipeline parallelism on either side (transfer/protocol/stage_mapping.py)
and what the decode and prefill sides make of it: the prefill stages a decode stage needs, the
decode ranks a prefill rank waits for, a decode stage's memory by model layer, and a decode
room's tracker over its own layers only."""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstage.transfer.config import Timeouts
from kvstage.transfer.draft_kv import DraftKV
from kvstage.transfer.layout import KVLayout
from kvstage.transfer.poll import KVPoll
from kvstage.transfer.protocol import peering
from kvstage.transfer.protocol.actions import PeerKey, PostWrite, Send
from kvstage.transfer.protocol.decode.tracker import RoomTracker
from kvstage.transfer.protocol.messages import KVMemory, RoomMeta
from kvstage.transfer.protocol.prefill.room import PrefillRoom
from kvstage.transfer.protocol.stage_mapping import (
    DecodeStage,
    by_model_layer,
    decode_coverage,
    decode_stage_of,
    flow_layers,
    overlap,
    sources_of,
    stage_memory,
)


def tiling(bounds: list[int]) -> tuple[range, ...]:
    return tuple(range(a, b) for a, b in zip(bounds, bounds[1:]))


@st.composite
def tilings(draw, layers: int):
    """Stages tiling [0, layers): 1 to `layers` non-empty stages."""
    cuts = draw(st.sets(st.integers(1, layers - 1), max_size=layers - 1)) if layers > 1 else set()
    return tiling([0, *sorted(cuts), layers])


def test_sources_of_named_cases():
    pre = tiling([0, 3, 6])                      # prefill PP 2
    assert sources_of(pre, range(0, 2)) == {0: range(0, 2)}
    assert sources_of(pre, range(2, 4)) == {0: range(2, 3), 1: range(3, 4)}
    assert sources_of(pre, range(4, 6)) == {1: range(4, 6)}
    assert sources_of((range(6),), range(3, 6)) == {0: range(3, 6)}   # prefill without PP
    with pytest.raises(ValueError, match=r"prefill's PP 2 \[0, 3\) \[3, 5\) does not hold every layer of this "
                                         r"decode rank's stage \[4, 6\)"):
        sources_of(tiling([0, 3, 5]), range(4, 6))


@given(st.integers(1, 12).flatmap(lambda n: st.tuples(st.just(n), tilings(n), tilings(n))))
@settings(max_examples=300, deadline=None)
def test_every_layer_of_every_decode_stage_comes_from_exactly_the_prefill_stage_holding_it(case):
    """Brute force: for any two tilings, each (decode stage, layer) is written once, by the
    prefill stage that holds the layer, and each prefill stage's layers go to exactly one
    decode stage each (what flow_layers gives a prefill rank, per decode stage)."""
    n, pre, dec = case
    sent = {s: [] for s in range(len(pre))}
    for d in dec:
        src = sources_of(pre, d)
        got = sorted(layer for lay in src.values() for layer in lay)
        assert got == list(d)
        for s, lay in src.items():
            assert all(layer in pre[s] for layer in lay)
            ds = DecodeStage(len(dec), dec.index(d), d)
            assert flow_layers(pre[s], ds) == lay
            sent[s] += list(lay)
    for s, lay in sent.items():
        assert sorted(lay) == list(pre[s])
    assert overlap(range(0, 2), range(2, 4)) == range(2, 2) and not len(overlap(range(0, 2), range(5, 9)))


def stage(pp_rank: int, bounds: list[int]) -> DecodeStage:
    return DecodeStage(len(bounds) - 1, pp_rank, range(bounds[pp_rank], bounds[pp_rank + 1]))


def test_decode_coverage_completes_once_the_stages_heard_from_cover_this_rank():
    b = [0, 2, 4, 6]                       # decode PP 3, TP 2; this prefill stage holds [0, 3)
    cov = decode_coverage(range(0, 3), [0, 1], 2, {1: stage(0, b)}, 6)
    assert (cov.expected, cov.complete, cov.error) == (frozenset({0, 1}), False, "")
    cov = decode_coverage(range(0, 3), [0, 1], 2, {1: stage(0, b), 0: stage(0, b), 3: stage(1, b)}, 6)
    assert (cov.expected, cov.complete) == (frozenset({0, 1, 2, 3}), True)
    # a prefill rank writing only decode TP rank 1 of each stage (decode TP 2, prefill TP 2)
    cov = decode_coverage(range(3, 6), [1], 2, {3: stage(1, b), 5: stage(2, b)}, 6)
    assert (cov.expected, cov.complete) == (frozenset({3, 5}), True)


@pytest.mark.parametrize("seen, message", [
    ({0: DecodeStage(2, 0, range(0, 2)), 1: DecodeStage(2, 1, range(3, 6))}, r"leave layers \[2, 3\) to no stage"),
    ({0: DecodeStage(2, 0, range(0, 4)), 1: DecodeStage(2, 1, range(2, 6))}, "overlap or are out of order"),
    ({0: DecodeStage(2, 0, range(1, 3))}, "does not start at layer 0"),
    ({1: DecodeStage(2, 1, range(3, 5))}, "does not end at the model's last layer"),
    ({0: DecodeStage(2, 0, range(0, 3)), 1: DecodeStage(3, 1, range(3, 6))}, "disagree on their PP size"),
    ({0: DecodeStage(2, 0, range(0, 3)), 1: DecodeStage(2, 0, range(0, 2))}, "says it is in decode PP stage 0"),
    ({1: DecodeStage(2, 1, range(5, 6))}, r"holds none of this prefill stage's layers \[0, 3\)"),
])
def test_decode_coverage_names_what_cannot_pair(seen, message):
    cov = decode_coverage(range(0, 3), [0], 1, seen, 6)
    assert not cov.complete and not cov.expected
    assert cov.error and re.search(message, cov.error), cov.error


def test_a_decode_stage_from_its_hello():
    assert decode_stage_of(pp_size=1, tp_size=2, rank=1, stage_start=0, stage_stop=0, num_layers=6) == (None, [])
    got, bad = decode_stage_of(pp_size=3, tp_size=2, rank=5, stage_start=4, stage_stop=6, num_layers=6)
    assert (got, bad) == (DecodeStage(3, 2, range(4, 6)), [])
    _, bad = decode_stage_of(pp_size=2, tp_size=2, rank=3, stage_start=4, stage_stop=8, num_layers=6)
    assert bad and "not a stage of this model's 6 layers" in bad[0]
    _, bad = decode_stage_of(pp_size=2, tp_size=1, rank=2, stage_start=4, stage_stop=6, num_layers=6)
    assert bad   # rank 2 of TP 1 would be stage 2 of 2


def test_a_decode_stage_memory_is_addressed_by_model_layer():
    assert by_model_layer([10, 11, 20, 21], 2, 3) == [0, 0, 0, 10, 11, 0, 0, 0, 20, 21]
    assert by_model_layer([10, 11], 1, 0) == [10, 11]
    kv = KVMemory(k_addrs=[10, 11], v_addrs=[20, 21], num_pages=4, page_stride=8, token_stride=2)
    assert stage_memory(kv, None) is kv and stage_memory(kv, DecodeStage(2, 0, range(0, 2))) is kv
    moved = stage_memory(kv, DecodeStage(2, 1, range(4, 6)))
    assert (moved.k_addrs, moved.v_addrs) == ([0, 0, 0, 0, 10, 11], [0, 0, 0, 0, 20, 21])
    mla = stage_memory(KVMemory(k_addrs=[10], v_addrs=[], num_pages=4, page_stride=8, token_stride=2),
                       DecodeStage(2, 1, range(1, 2)))
    assert (mla.k_addrs, mla.v_addrs) == ([0, 10], [])


def decode_layout(tp: int, rank: int, pp: int, pp_rank: int, stage_: range) -> KVLayout:
    return KVLayout(num_layers=6, total_kv_heads=4, head_dim=16, dtype=torch.float16, page_size=4, tp_size=tp,
                    tp_rank=rank, pp_size=pp, pp_rank=pp_rank, stage=stage_)


def test_needed_ranks_of_a_decode_stage_are_the_prefill_stages_holding_its_layers():
    pre = tiling([0, 3, 6])   # prefill PP 2 x TP 2: ranks 0, 1 hold [0, 3), ranks 2, 3 hold [3, 6)
    need = peering.needed_ranks(2, decode_layout(1, 0, 3, 1, range(2, 4)), pre)
    assert need.writers == [0, 1, 2, 3] and need.notices == []
    assert need.layers == {0: range(2, 3), 1: range(2, 3), 2: range(3, 4), 3: range(3, 4)}
    need = peering.needed_ranks(2, decode_layout(1, 0, 3, 0, range(0, 2)), pre)
    assert need.writers == [0, 1] and need.layers == {0: range(0, 2), 1: range(0, 2)}
    need = peering.needed_ranks(2, decode_layout(2, 1, 2, 1, range(3, 6)), pre)   # PP 2 -> PP 2, TP 2 -> 2
    assert need.writers == [3] and need.layers == {3: range(3, 6)}
    need = peering.needed_ranks(1, decode_layout(1, 0, 2, 1, range(3, 6)))          # a prefill without PP
    assert need.writers == [0] and need.layers == {0: range(3, 6)}


def test_a_decode_stage_room_completes_on_its_own_layers_only():
    # decode stage [2, 4) of 6 layers, written by prefill stage 0 (layer 2) and stage 1 (layer 3)
    t = RoomTracker(2, {0: 6 * 10, 1: 6 * 10}, num_layers=6, writer_layers={0: range(2, 3), 1: range(3, 4)},
                    held=range(2, 4))
    t.expect_piece(0, 0, 0, 2, 0, [0], range(2, 3))
    t.expect_piece(1, 0, 0, 2, 100, [1], range(3, 4))
    for writer, chunk, lay in ((0, 0, range(2, 3)), (1, 1, range(3, 4))):
        arrival = t.arrive_staged(writer, chunk, 0, 0, 2, 2 * 10, 0 if writer == 0 else 100, lay)
        t.mark_scattered(arrival.piece)
    assert t.complete and t.pages_done == 2
    direct = RoomTracker(2, {0: 60, 1: 60}, num_layers=6, writer_layers={0: range(2, 3), 1: range(3, 4)},
                         held=range(2, 4))
    assert direct.arrive_direct(0, 0, 0, 2, 20, layers=range(2, 3)).outcome.name == "ACCEPTED"
    assert not direct.complete
    assert direct.arrive_direct(1, 1, 0, 2, 20, layers=range(3, 5)).outcome.name == "REJECTED"   # not its stage's
    assert direct.arrive_direct(1, 1, 0, 2, 20, layers=range(3, 4)).outcome.name == "ACCEPTED"
    assert direct.complete
    with pytest.raises(ValueError, match="held layers"):
        RoomTracker(2, {0: 60}, num_layers=6, held=range(4, 8))


# -- a prefill room facing a decode engine with PP ---------------------------------------------------

PRE = KVLayout(num_layers=6, total_kv_heads=2, head_dim=4, dtype=torch.uint8, page_size=2, tp_size=1, tp_rank=0)


def prefill_room():
    return PrefillRoom(room=7, num_pages=2, layout=PRE, me=1000, now=0.0, timeouts=Timeouts(metadata=50),
                       op_ids=itertools.count(1))


def dmeta(peer: PeerKey) -> RoomMeta:
    return RoomMeta(src=peer.incarnation, dst=1000, room=7, session=peer.incarnation, num_pages=2, staged=False,
                    dst_pages=np.arange(2, dtype="<i8").tobytes())


def test_a_prefill_room_writes_each_decode_stage_its_layers_once_every_stage_is_heard_from():
    """Prefill without PP (6 layers) -> decode PP 2 ([0, 2) and [2, 6)), decode TP 1: nothing is
    written until both stages' metadata arrived; then each decode rank gets its stage's layers."""
    r = prefill_room()
    d0, d1 = PeerKey("dec", 0, 2000), PeerKey("dec", 1, 2001)
    r.add_chunk(np.arange(2), True, 0.5)
    acts = r.add_meta(d1, 1, dmeta(d1), 1.0, stage=DecodeStage(2, 1, range(2, 6)))
    assert not [a for a in acts if isinstance(a, PostWrite)] and r.state is not KVPoll.Failed
    acts = r.add_meta(d0, 1, dmeta(d0), 2.0, stage=DecodeStage(2, 0, range(0, 2)))
    writes = {a.op.peer.tp_rank: a.op.layers for a in acts if isinstance(a, PostWrite)}
    assert writes == {0: range(0, 2), 1: range(2, 6)}


def test_decode_stages_that_leave_a_gap_fail_the_room_and_tell_the_decode_rank():
    r = prefill_room()
    d0, d1 = PeerKey("dec", 0, 2000), PeerKey("dec", 1, 2001)
    r.add_meta(d0, 1, dmeta(d0), 1.0, stage=DecodeStage(2, 0, range(0, 2)))
    acts = r.add_meta(d1, 1, dmeta(d1), 2.0, stage=DecodeStage(2, 1, range(3, 6)))
    assert r.state is KVPoll.Failed
    assert "prefill rank 0 (no PP, 6 layers) cannot pair" in r.failure and "leave layers [2, 3)" in r.failure
    told = {(a.peer.tp_rank, type(a.msg).__name__) for a in acts if isinstance(a, Send)}
    assert {(0, "RoomFailed"), (1, "RoomFailed"), (1, "Quiesced")} <= told


def test_a_gap_no_prefill_rank_sees_both_sides_of_fails_at_the_metadata_deadline_naming_the_layers():
    """Prefill PP 2 ([0, 3), [3, 6)) and decode stages [0, 2), [3, 6): prefill stage 0 hears only
    from decode stage 0, whose layers leave its layer 2 to nobody."""
    lay = KVLayout(num_layers=6, total_kv_heads=2, head_dim=4, dtype=torch.uint8, page_size=2, tp_size=1,
                   tp_rank=0, pp_size=2, pp_rank=0, stage=range(0, 3))
    r = PrefillRoom(room=7, num_pages=2, layout=lay, me=1000, now=0.0, timeouts=Timeouts(metadata=5),
                    op_ids=itertools.count(1))
    d0 = PeerKey("dec", 0, 2000)
    r.add_meta(d0, 1, dmeta(d0), 1.0, stage=DecodeStage(2, 0, range(0, 2)))
    assert r.state is not KVPoll.Failed and not r.tick(4.0)
    r.tick(6.0)
    assert r.state is KVPoll.Failed and "leave its layers [2] to no decode stage" in r.failure, r.failure
    assert "PP stage 0 of 2 [0, 3)" in r.failure and "decode PP stage 0 of 2 [0, 2)" in r.failure


def test_the_draft_pairs_as_more_layers_of_the_last_stages():
    """The last stage of each engine holds the draft (KVLayout): a prefill rank sees a decode's
    last stage going on over the draft entries it writes, and a decode's last stage takes them
    from the prefill's last stage, as far as the prefill writes them (decode-only speculation:
    its further entries stay unwritten); a stage before the last has no draft to pair."""
    got, bad = decode_stage_of(pp_size=2, tp_size=1, rank=1, stage_start=3, stage_stop=6, num_layers=6, draft_layers=2)
    assert (got, bad) == (DecodeStage(2, 1, range(3, 8)), []) and got.model_layers(6) == range(3, 6)
    got, _ = decode_stage_of(pp_size=2, tp_size=1, rank=0, stage_start=0, stage_stop=3, num_layers=6, draft_layers=2)
    assert got == DecodeStage(2, 0, range(0, 3))
    # the prefill's last stage [3, 6) + 2 draft entries, against decode stages [0, 4) and [4, 8)
    seen = {0: DecodeStage(2, 0, range(0, 4)), 1: DecodeStage(2, 1, range(4, 8))}
    cov = decode_coverage(range(3, 8), [0], 1, seen, 8)
    assert cov.complete and cov.expected == {0, 1} and not cov.error
    assert flow_layers(range(3, 8), seen[1]) == range(4, 8) and flow_layers(range(3, 8), seen[0]) == range(3, 4)
    cov = decode_coverage(range(3, 8), [0], 1, {1: DecodeStage(2, 1, range(4, 6))}, 8)
    assert "does not end at the model's last layer" in cov.error   # a decode stage that lost the draft entries

    def last(draft: int) -> KVLayout:
        return KVLayout(num_layers=6, total_kv_heads=4, head_dim=16, dtype=torch.float16, page_size=4, tp_size=1,
                        tp_rank=0, pp_size=2, pp_rank=1, stage=range(3, 6), draft=DraftKV(num_layers=draft))
    pre = (range(0, 4), range(4, 7))    # prefill PP 2, TP 1, one draft entry after layer 5
    need = peering.needed_ranks(1, last(2), pre)
    assert need.writers == [0, 1] and need.layers == {0: range(3, 4), 1: range(4, 7)}   # entry 7 stays unwritten
    assert peering.needed_ranks(1, last(1), pre).layers == {0: range(3, 4), 1: range(4, 7)}
    first = decode_layout(1, 0, 2, 0, range(0, 3))
    assert peering.needed_ranks(1, first, pre, draft_pools=1).draft_pools == 0   # a draft of its own geometry too
    assert peering.needed_ranks(1, last(1), pre, draft_pools=1).draft_pools == 1
