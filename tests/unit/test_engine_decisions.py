"""The control plane's pure decisions, without sockets: where a frame goes
(protocol/routing.py), which prefill ranks a decode rank needs and when it may plan
(protocol/peering.py), and which staged writes may go (protocol/write_queue.py)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstage.transfer.layout import KVLayout
from kvstage.transfer.protocol import peering
from kvstage.transfer.protocol.actions import PeerKey, WriteOp
from kvstage.transfer.protocol.messages import (
    AllocGrant,
    Goodbye,
    Heartbeat,
    Hello,
    HelloAck,
    Quiesced,
    RoomFailed,
    RoomMeta,
)
from kvstage.transfer.protocol.routing import PEER_STATES, Route, route_frame
from kvstage.transfer.protocol.write_queue import StagedQueue, WriteDeadlines

KINDS = [Hello, HelloAck, RoomMeta, RoomFailed, Goodbye, Heartbeat, AllocGrant, Quiesced]
HANDLED = {"prefill": frozenset({RoomMeta, RoomFailed, Goodbye, Heartbeat, AllocGrant}),
           "decode": frozenset({HelloAck, RoomFailed, Goodbye, Heartbeat, Quiesced})}


# -- routing ------------------------------------------------------------------------------------------
def expected_route(kind, role, dst, state, gone, replaced) -> Route:
    """The rules written out once more, case by case, for the exhaustive check."""
    if kind is Hello:
        return Route("hello")
    if state is None:
        if gone and kind is not Goodbye:
            return Route("tell_gone", "stale_peer")
        return Route("drop", "stale_peer" if gone or replaced else "unknown_peer")
    if dst != 5:
        return Route("drop", "stale_epoch")
    if state == "rejected":
        return Route("rejected_failure") if (kind, role) == (RoomFailed, "prefill") else Route("drop")
    if kind in HANDLED[role]:
        return Route("deliver", heard=True)
    return Route("drop", "unexpected", heard=True)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_route_frame_every_combination(role):
    seen = set()
    for kind, dst, state, gone, replaced in itertools.product(KINDS, [5, 6], (None,) + PEER_STATES,
                                                            [False, True], [False, True]):
        got = route_frame(kind, role=role, me=5, dst=dst, peer_state=state, src_gone=gone, src_replaced=replaced,
                          handled=HANDLED[role])
        assert got == expected_route(kind, role, dst, state, gone, replaced), (kind, dst, state, gone, replaced)
        seen.add(got.action)
    assert seen == {"hello", "tell_gone", "drop", "deliver", "rejected_failure"} if role == "prefill" else \
        seen == {"hello", "tell_gone", "drop", "deliver"}


def test_a_goodbye_from_a_lost_peer_is_not_answered_with_another_goodbye():
    r = route_frame(Goodbye, role="decode", me=1, dst=1, peer_state=None, src_gone=True, src_replaced=False,
                    handled=HANDLED["decode"])
    assert r == Route("drop", "stale_peer")


def test_only_delivered_or_unexpected_frames_renew_the_lease():
    for state in PEER_STATES:
        r = route_frame(Heartbeat, role="decode", me=1, dst=1, peer_state=state, src_gone=False,
                        src_replaced=False, handled=HANDLED["decode"])
        assert r.heard == (state not in ("rejected",))


# -- peering ------------------------------------------------------------------------------------------
def layout(tp: int, rank: int, heads: int = 8, mla: bool = False) -> KVLayout:
    return KVLayout(num_layers=2, total_kv_heads=heads, head_dim=16, dtype=torch.float16, page_size=4,
                    tp_size=tp, tp_rank=rank, mla=mla)


@pytest.mark.parametrize("P,D", [(1, 1), (2, 1), (4, 2), (1, 4), (8, 2), (2, 8), (16, 4)])
def test_needed_ranks_cover_every_head_of_the_decode_rank_once(P, D):
    for d in range(D):
        need = peering.needed_ranks(P, layout(D, d))
        assert need.all == need.writers + need.notices
        assert not set(need.writers) & set(need.notices)
        got = sorted(h for a in need.mapping.assignments if a.decode_rank == d for h in range(*a.dst_heads))
        assert got == list(range(layout(D, d).local_heads))   # each local head exactly once
        assert {a.prefill_rank for a in need.mapping.assignments if a.decode_rank == d} == set(need.writers)


def test_needed_ranks_refuses_tp_sizes_that_cannot_share_heads():
    with pytest.raises(ValueError, match="tp_size=3 does not divide"):
        peering.needed_ranks(3, layout(2, 0))


def rec(rank, role="prefill", inc=None):
    return SimpleNamespace(tp_rank=rank, role=role, incarnation=inc if inc is not None else 100 + rank)


def stage_recs(stages, tp=2, num_layers=6):
    """Rank records of a PP prefill engine whose stage s holds layers stages[s]."""
    pp = len(stages)
    return [SimpleNamespace(tp_rank=s * tp + r, tp_size=pp * tp, role="prefill", incarnation=100 + s * tp + r,
                            layout={"num_layers": num_layers, **({"pp_size": pp, "stage_start": st.start,
                                                                  "stage_stop": st.stop} if st is not None else {})})
            for s, st in enumerate(stages) for r in range(tp)]


def test_read_stages_and_needed_ranks_of_a_pp_prefill():
    stages = peering.read_stages("e", stage_recs([range(0, 2), range(2, 6)]), 6)
    assert stages == peering.PrefillStages(2, (range(0, 2), range(2, 6)))
    need = peering.needed_ranks(stages.tp_size, layout(1, 0), stages.layers)
    assert need.writers == [0, 1, 2, 3] and need.notices == []   # (stage, TP rank) -> rank s * 2 + p
    assert need.layers == {0: range(0, 2), 1: range(0, 2), 2: range(2, 6), 3: range(2, 6)}
    need = peering.needed_ranks(2, layout(4, 3), stages.layers)   # decode TP 4: one writer per stage
    assert need.writers == [1, 3] and need.notices == []
    # an engine without PP (records that name no stage): one stage of every layer
    plain = peering.read_stages("e", stage_recs([None], tp=4), 6)
    assert plain == peering.PrefillStages(4, (range(6),))


@pytest.mark.parametrize("stages, message", [
    ([range(0, 2), range(3, 6)], r"\[0, 2\), \[3, 6\) do not tile the model's 6 layers \(stage 1 should start at "
                                 r"layer 2\)"),
    ([range(0, 3), range(2, 6)], "do not tile"),
    ([range(0, 2), range(2, 5)], "end at layer 5, the model has 6"),
    ([range(1, 3), range(3, 6)], "stage 0 should start at layer 0"),
])
def test_read_stages_refuses_stages_that_do_not_tile_the_model(stages, message):
    with pytest.raises(ValueError, match=message):
        peering.read_stages("e", stage_recs(stages), 6)


def test_read_stages_refuses_ranks_that_disagree():
    recs = stage_recs([range(0, 2), range(2, 6)])
    recs[3].layout["stage_start"] = 3
    with pytest.raises(ValueError, match="ranks of PP stage 1 disagree on its layers"):
        peering.read_stages("e", recs, 6)
    recs = stage_recs([range(0, 2), range(2, 6)])
    recs[0].layout["pp_size"] = 1
    with pytest.raises(ValueError, match="disagree on the PP size"):
        peering.read_stages("e", recs, 6)


def test_read_lookup():
    assert peering.read_lookup("e", None, "boom") == peering.Lookup(peering.LookupState.FAILED, [], "boom")
    empty = peering.read_lookup("e", [], None)
    assert (empty.state, empty.records) == (peering.LookupState.FAILED, [])
    assert "not a prefill engine" in peering.read_lookup("e", [rec(0, "decode")], None).error
    found = peering.read_lookup("e", [rec(2), rec(0), rec(1)], None)
    assert (found.state, [r.tp_rank for r in found.records], found.error) == (peering.LookupState.READY, [0, 1, 2], "")


@given(st.sets(st.integers(0, 9)), st.sets(st.integers(0, 9)), st.sets(st.integers(0, 9)))
@settings(max_examples=200, deadline=None)
def test_records_stale_iff_one_incarnation_was_lost_or_replaced(incs, gone, replaced):
    assert peering.records_stale(incs, gone, replaced) == bool(incs & (gone | replaced))


def test_needs_lookup():
    table = {(None, False): True, ("lookup", False): False, ("lookup", True): False, ("ready", False): False,
             ("ready", True): True, ("failed", False): True, ("failed", True): True}
    for (state, stale), want in table.items():
        assert peering.needs_lookup(state, stale) is want, (state, stale)


def test_reuse_peer():
    assert peering.reuse_peer(7, "connected", 7) is True
    assert peering.reuse_peer(7, "connecting", 7) is True
    assert peering.reuse_peer(7, "rejected", 7) is True     # the refusal stands until a new incarnation
    assert peering.reuse_peer(7, "lost", 7) is False
    assert peering.reuse_peer(7, "connected", 8) is False
    assert peering.reuse_peer(None, None, 8) is False


@given(st.dictionaries(st.integers(0, 7), st.sampled_from(["connecting", "connected", "rejected"]), min_size=1))
@settings(max_examples=300, deadline=None)
def test_plan_gate(states):
    verdict = peering.plan_gate(states)
    rejected = [r for r, s in states.items() if s == "rejected"]
    if rejected:
        assert verdict == peering.GateVerdict(peering.Gate.REJECTED, rejected_by=rejected[0])
    elif all(s == "connected" for s in states.values()):
        assert verdict == peering.GateVerdict(peering.Gate.GO)
    else:
        assert verdict == peering.GateVerdict(peering.Gate.WAIT)


def test_fallback_reason_names_the_cause():
    assert peering.fallback_reason(False, False, 2, 1, []) == "this rank has no staging ring"
    assert "MLA" in peering.fallback_reason(True, True, 2, 1, [])
    assert "equal" in peering.fallback_reason(True, False, 2, 2, [])
    assert peering.fallback_reason(True, False, 4, 2, [1, 3]).endswith("rank(s) 1, 3")


# -- the staged write queue ---------------------------------------------------------------------------
def op(op_id: int, room: int, start: int = 0) -> WriteOp:
    return WriteOp(op_id=op_id, room=room, peer=PeerKey("d", 0, 9), staged=True, chunk=0, piece=op_id,
                   src_pages=np.array([0]), dst_pages=None, src_heads=(0, 1), dst_heads=(0, 1), nbytes=8,
                   tag=None, ring_start=start, layers=range(1))


def test_take_ready_cancels_dead_rooms_dispatches_free_regions_and_keeps_order():
    q = StagedQueue()
    for i, (room, start) in enumerate([(1, 0), (2, 100), (1, 200), (3, 300)]):
        q.add(9, op(i, room, start), now=float(i))
    out = q.take_ready(9, room_live=lambda r: r != 2, region_free=lambda o: o.ring_start < 250)
    assert [(v, o.op_id, s) for v, o, s in out] == [("go", 0, 0.0), ("cancel", 1, 1.0), ("go", 2, 2.0)]
    assert len(q) == 1
    assert q.take_ready(9, lambda r: True, lambda o: False) == []
    assert [o.op_id for _, o, _ in q.take_ready(9, lambda r: True, lambda o: True)] == [3]
    assert len(q) == 0 and q.take_ready(9, lambda r: True, lambda o: True) == []


def test_acting_on_take_ready_may_change_the_queue():
    q = StagedQueue()
    q.add(9, op(1, 1), 0.0)
    q.add(9, op(2, 2), 0.0)
    for verdict, o, _ in q.take_ready(9, lambda r: r != 1, lambda o: False):
        assert (verdict, o.op_id) == ("cancel", 1)
        assert [x.op_id for x in q.cancel_room(2)] == [2]  # re-entered while acting: nothing lost or doubled
    assert len(q) == 0


def test_cancel_room_drop_peer_and_expire():
    q = StagedQueue()
    q.add(1, op(1, 10), 0.0)
    q.add(1, op(2, 11), 5.0)
    q.add(2, op(3, 10), 1.0)
    q.add(2, op(4, 12), 9.0)
    assert sorted(o.op_id for o in q.cancel_room(10)) == [1, 3]
    assert len(q) == 2
    assert [o.op_id for o in q.expire(now=10.0, limit=4.0)] == [2]
    assert [o.op_id for o in q.drop_peer(2)] == [4]
    assert len(q) == 0 and q.drop_peer(2) == []


@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 3), st.floats(0, 10)), max_size=30),
       st.floats(0, 10), st.floats(0, 5))
@settings(max_examples=200, deadline=None)
def test_expire_removes_exactly_the_late_ones(items, now, limit):
    q = StagedQueue()
    for i, (peer, room, t) in enumerate(items):
        q.add(peer, op(i, room), t)
    late = {o.op_id for o in q.expire(now, limit)}
    assert late == {i for i, (_, _, t) in enumerate(items) if now - t > limit}
    assert len(q) == len(items) - len(late)


def test_write_deadlines():
    d = WriteDeadlines()
    d.start(1, room=10, at=5.0)
    d.start(2, room=11, at=7.0)
    d.restart(2, at=20.0)
    d.restart(3, at=1.0)             # not tracked (already done): stays untracked
    assert 3 not in d
    assert d.expired(6.0) == [(1, 10)]
    assert d.expired(6.0) == []
    d.done(2)
    assert len(d) == 0 and d.expired(100.0) == []


# -- connections: a late Goodbye or Hello of an earlier connection -----------------------------------
def test_a_goodbye_ends_only_the_connection_it_names():
    def goodbye(conn, peer_conn):
        return route_frame(Goodbye, role="decode", me=1, dst=1, peer_state="connected", src_gone=False,
                           src_replaced=False, handled=HANDLED["decode"], conn=conn, peer_conn=peer_conn)
    assert goodbye(1, 2) == Route("drop", "stale_connection")
    assert goodbye(3, 2) == Route("drop", "stale_connection")
    assert goodbye(2, 2) == Route("deliver", heard=True)
    assert goodbye(0, 2) == Route("deliver", heard=True)    # a peer that does not number connections
    assert goodbye(2, 0) == Route("deliver", heard=True)
    # only Goodbye is bound to a connection: anything else from the incarnation is delivered
    assert route_frame(Heartbeat, role="decode", me=1, dst=1, peer_state="connected", src_gone=False,
                       src_replaced=False, handled=HANDLED["decode"], conn=1, peer_conn=2).action == "deliver"


def test_hello_verdict():
    from kvstage.transfer.protocol.routing import hello_verdict
    assert hello_verdict(None, 0, 5) == "new"
    assert hello_verdict("rejected", 4, 5) == "new"
    assert hello_verdict("connected", 5, 5) == "ack_again"
    assert hello_verdict("connected", 5, 0) == "ack_again"
    assert hello_verdict("connected", 0, 5) == "ack_again"
    assert hello_verdict("connected", 5, 4) == "stale"
    assert hello_verdict("connected", 5, 6) == "replace"

