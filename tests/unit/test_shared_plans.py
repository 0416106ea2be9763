"""Plans shared by the rooms of one shape (issue 52, memory per room; decode/plan.py SharedPlans):
a decode rank hands every room of one shape the same immutable plan, and rooms of different
shapes different ones; a shared plan cannot be changed through any room; the cache stays
bounded; a room's tracker shares its plan's writer map; and a chunk's repeated grant, now made
from the tracker's pieces, is the grant it had (docs/scale.md, "Memory per room")."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
import torch

from kvstage.sim.fleet import Fleet, FleetConfig, Model
from kvstage.transfer.config import Timeouts
from kvstage.transfer.layout import KVLayout
from kvstage.transfer.poll import KVPoll
from kvstage.transfer.protocol.actions import PeerKey, PostWrite, Scatter, Send
from kvstage.transfer.protocol.decode.plan import PathInputs, RoomPlan, SharedPlans
from kvstage.transfer.protocol.decode.room import DecodeRoom, TagVerdict
from kvstage.transfer.protocol.head_mapping import compute_assignments
from kvstage.transfer.protocol.messages import AllocGrant, AllocRequest, RoomMeta
from kvstage.transfer.protocol.path_choice import PathMode, WriteCost, WriterCosts
from kvstage.transfer.protocol.prefill.room import PrefillRoom
from kvstage.transfer.protocol.ring import RingAllocator

MIXED = FleetConfig(prefill_engines=3, decode_engines=3, prefill_tp=(8, 4), decode_tp=(1, 2, 8),
                    models=(Model(name="gqa-p16", mla=False, heads=8, layers=4, page_size=16),),
                    requests=150, in_flight=120, deaths=0, seed=3)


def test_the_rooms_of_one_shape_on_a_rank_share_their_plan_and_other_shapes_do_not():
    """Judged by the plans' values (RoomPlan ==), not by the cache's key: rooms whose plans are
    equal hold one object, rooms whose plans differ hold different ones, and every room's plan
    names its own request's prefill engine (no room got another engine's plan)."""
    fleet = Fleet(MIXED)
    fleet.run(until=0.02)
    shared = distinct = 0
    for rank in fleet.ranks:
        shapes: list[list[RoomPlan]] = []   # the rank's rooms' plans, grouped by value
        for room in rank.rooms.values():
            if isinstance(room, DecodeRoom) and room.plan is not None and room.state is not KVPoll.Failed:
                req = fleet.open.get(room.room)
                if req is not None and req.de == rank.engine:
                    engine = fleet.engines[("prefill", req.pe)]
                    assert room.plan.prefill_tp == len(engine)
                    assert {p for p, _ in room.plan.writers} | set(room.plan.notices) <= \
                        {fleet.ranks[g].key for g in engine}, "a room holds another prefill engine's plan"
                group = next((g for g in shapes if g[0] == room.plan), None)
                if group is None:
                    shapes.append([room.plan])
                else:
                    group.append(room.plan)
        for plans in shapes:
            assert all(p is plans[0] for p in plans), "rooms of one shape hold different plan objects"
            shared += len(plans) > 1
        kept = [plans[0] for plans in shapes]
        assert len({id(p) for p in kept}) == len(kept), "rooms of different shapes hold one plan object"
        distinct += len(kept) > 1
    assert shared and distinct, (shared, distinct)   # both cases were seen


LAYOUT = KVLayout(num_layers=2, total_kv_heads=2, head_dim=4, dtype=torch.uint8, page_size=2, tp_size=1, tp_rank=0,
                  mla=False)
PREF = PeerKey("prefill", 0, 1000)
DEC = PeerKey("decode", 0, 2000)
N = 4
RING = 4096
SESSION = 22


def plan(**change) -> RoomPlan:
    a = compute_assignments(1, 1, LAYOUT.total_kv_heads, False).find(0, 0)
    hpb = LAYOUT.num_kv * LAYOUT.num_layers * LAYOUT.page_size * LAYOUT.head_bytes
    return dataclasses.replace(
        RoomPlan(writers=((PREF, a),), staged=True, head_page_bytes=hpb, max_piece_pages=N, ring_align=64,
                 ring_epoch=DEC.incarnation, prefill_tp=1, decode_tp=1, ring_size=RING, buffer_bytes=1024,
                 can_stage=True), **change)


COSTS = WriterCosts(writes=[WriteCost(backend="nixl", mem_kind="DRAM", per_write_s=1e-5, per_range_s=1e-7,
                                      per_byte_s=1e-10)], gather_bytes_per_s=1e10)


@pytest.mark.parametrize("change", [
    dict(prefill_tp=2), dict(decode_tp=2), dict(max_piece_pages=2), dict(staged=False), dict(num_layers=1),
    dict(ring_epoch=1), dict(writer_layers={0: range(1)}), dict(notices=(PeerKey("prefill", 1, 1001),)),
    dict(writers=((PeerKey("prefill", 0, 999), compute_assignments(1, 1, 2, False).find(0, 0)),)),
    dict(path=PathInputs(mode=PathMode.AUTO, writers=(COSTS,))),
], ids=lambda c: next(iter(c)))
def test_a_cache_hands_out_one_plan_per_shape(change):
    cache = SharedPlans()
    first = cache.intern(plan())
    assert cache.intern(plan()) is first                      # an equal plan built again: the kept one
    other = cache.intern(plan(**change))
    assert other is not first and other != first and len(cache) == 2
    assert cache.intern(plan(**change)) is other


def test_path_inputs_with_equal_costs_are_one_shape():
    """The engine's plans carry the writers' measured costs (lists inside): equal costs, one plan."""
    cache = SharedPlans()
    a = cache.intern(plan(path=PathInputs(mode=PathMode.AUTO, writers=(COSTS,))))
    assert cache.intern(plan(path=PathInputs(mode=PathMode.AUTO, writers=(WriterCosts(
        writes=list(COSTS.writes), gather_bytes_per_s=1e10),)))) is a
    assert cache.intern(plan(path=PathInputs(mode=PathMode.AUTO, writers=(None,)))) is not a


def test_a_shared_plan_cannot_be_changed_through_a_room():
    p = plan(writer_layers={0: range(2)})
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.staged = False   # type: ignore[misc]
    for mapping in (p.writer_layers, p.writer_bytes):
        with pytest.raises(TypeError):
            mapping[5] = 1   # type: ignore[index]
    assert isinstance(p.writers, tuple) and isinstance(p.notices, tuple) and isinstance(p.writer_ranks, tuple)
    given = {0: range(2)}
    q = plan(writer_layers=given)
    given[0] = range(1)                                        # the caller's dict is copied, not kept
    assert q.writer_layers[0] == range(2)


def test_the_cache_is_bounded_and_forgets_the_oldest_shape():
    cache = SharedPlans(limit=2)
    a, b = cache.intern(plan(ring_epoch=1)), cache.intern(plan(ring_epoch=2))
    c = cache.intern(plan(ring_epoch=3))
    assert len(cache) == 2 and cache.intern(plan(ring_epoch=2)) is b and cache.intern(plan(ring_epoch=3)) is c
    assert cache.intern(plan(ring_epoch=1)) is not a           # forgotten: a new room gets a new (equal) plan
    with pytest.raises(ValueError):
        SharedPlans(limit=0)


def decode(p: RoomPlan) -> DecodeRoom:
    d = DecodeRoom(room=7, session=SESSION, me=DEC.incarnation, layout=LAYOUT, now=0.0, timeouts=Timeouts())
    d.on_plan(p, 0.0)
    acts = d.init(np.arange(10, 10 + N), 1.0)
    assert any(isinstance(a, Send) and isinstance(a.msg, RoomMeta) and a.msg.staged for a in acts)
    return d


def test_rooms_of_one_plan_share_its_writer_map():
    p = plan()
    one, two = decode(p), decode(p)
    assert one.tracker is not None and two.tracker is not None
    assert one.tracker.writer_page_bytes is p.writer_bytes is two.tracker.writer_page_bytes
    assert dict(p.writer_bytes) == {0: p.head_page_bytes * 2}


def test_a_repeated_grant_is_the_first_even_after_a_piece_was_scattered():
    ring = RingAllocator(RING, 64)
    d = decode(plan(max_piece_pages=2))
    pre = PrefillRoom(room=7, num_pages=N, layout=LAYOUT, me=PREF.incarnation, now=0.0, timeouts=Timeouts(),
                      op_ids=itertools.count(700))
    pre.add_meta(DEC, 1, RoomMeta(src=DEC.incarnation, dst=PREF.incarnation, room=7, session=SESSION, num_pages=N,
                                  staged=True), 1.0)
    (req,) = [a.msg for a in pre.add_chunk(np.arange(N), True, 2.0)
              if isinstance(a, Send) and isinstance(a.msg, AllocRequest)]

    def grant(now: float) -> AllocGrant:
        (g,) = [a.msg for a in d.on_alloc_request(PREF, req, ring, now)
                if isinstance(a, Send) and isinstance(a.msg, AllocGrant)]
        return g

    first = grant(3.0)
    assert len(first.pieces) == 2
    assert [(p.start, p.region_nbytes) for p in first.pieces] == \
        [(r.start, r.nbytes) for r in d.allocs[req.chunk].regions.values()]
    ops = [a.op for a in pre.on_grant(DEC, first, 3.5) if isinstance(a, PostWrite)]
    res = d.on_tag(PREF, ops[0].tag, 4.0)
    assert res.verdict is TagVerdict.OK
    (scatter,) = [a for a in res.actions if isinstance(a, Scatter)]
    d.on_scattered(scatter.key, True, None, ring, 4.5)
    assert scatter.key[1] not in d.allocs[req.chunk].regions   # its region went back to the ring
    assert grant(5.0) == first


def test_a_plan_is_reused_only_for_the_same_records_peers_and_path_inputs():
    """EnginePlanner keeps each engine's last plan with what it was made of (PlanInputs): the
    next room reuses it only when the engine's records are the same object (a lookup replaces
    them) and every writer, notice and path input is equal; a reconnected writer (a new
    incarnation), another buffer size or other measured costs make a new plan."""
    from kvstage.transfer.engine.decode_planning import PlanInputs

    records: list = []
    base = dict(records=records, writers=((0, PREF, True, 1024),), notices=((1, PeerKey("prefill", 1, 1001)),),
                path=PathInputs(mode=PathMode.AUTO, writers=(COSTS,)))
    first = PlanInputs(**base)
    assert first.same(PlanInputs(**base))
    assert first.same(PlanInputs(**{**base, "path": PathInputs(mode=PathMode.AUTO, writers=(WriterCosts(
        writes=list(COSTS.writes), gather_bytes_per_s=1e10),))}))   # equal costs, rebuilt
    for change in (dict(records=[]), dict(writers=((0, PeerKey("prefill", 0, 999), True, 1024),)),
                   dict(writers=((0, PREF, True, 2048),)), dict(writers=((0, PREF, False, 1024),)),
                   dict(notices=()), dict(path=PathInputs(mode=PathMode.AUTO, writers=(None,))),
                   dict(path=PathInputs(mode=PathMode.STAGED, writers=(COSTS,)))):
        assert not first.same(PlanInputs(**{**base, **change})), change
