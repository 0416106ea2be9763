"""Each room's status moves only along its lifecycle table (protocol/lifecycle.py), h11 style:
every legal move is walked with real inputs, every other (status, event) pair raises
IllegalTransition, and the final statuses have no way out."""

import itertools

import numpy as np
import pytest
import torch

from kvstage.transfer.config import Timeouts
from kvstage.transfer.layout import KVLayout
from kvstage.transfer.poll import KVPoll
from kvstage.transfer.protocol.actions import PeerKey, PostWrite, Send, StatusChanged
from kvstage.transfer.protocol.decode.room import DecodeRoom, RoomPlan
from kvstage.transfer.protocol.head_mapping import compute_assignments
from kvstage.transfer.protocol.lifecycle import (
    DECODE_TRANSITIONS,
    FINAL,
    PREFILL_TRANSITIONS,
    IllegalTransition,
    RoomEvent,
)
from kvstage.transfer.protocol.messages import RoomDone, RoomMeta
from kvstage.transfer.protocol.prefill.room import PrefillRoom

B, W, T, S, F = KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring, KVPoll.Success, KVPoll.Failed
LAYOUT = KVLayout(num_layers=2, total_kv_heads=2, head_dim=4, dtype=torch.uint8, page_size=2, tp_size=1, tp_rank=0, mla=False)   # one prefill rank, one decode rank
PREF = PeerKey("prefill", 0, 1000)
DEC = PeerKey("decode", 0, 2000)
N = 4
SESSION = 22


def prefill(num_pages=N):
    return PrefillRoom(room=7, num_pages=num_pages, layout=LAYOUT, me=PREF.incarnation, now=0.0, timeouts=Timeouts(),
                       op_ids=itertools.count(1))


def decode():
    return DecodeRoom(room=7, session=SESSION, me=DEC.incarnation, layout=LAYOUT, now=0.0, timeouts=Timeouts())


def plan():
    a = compute_assignments(1, 1, LAYOUT.total_kv_heads, False).find(0, 0)
    hpb = LAYOUT.num_kv * LAYOUT.num_layers * LAYOUT.page_size * LAYOUT.head_bytes
    return RoomPlan(writers=((PREF, a),), notices=(), staged=False, head_page_bytes=hpb)


def meta():
    return RoomMeta(src=DEC.incarnation, dst=PREF.incarnation, room=7, session=SESSION, num_pages=N, staged=False,
                    dst_pages=np.arange(N, dtype="<i8").tobytes())


def moves(actions):
    return [a.state for a in actions if isinstance(a, StatusChanged) and not a.released]


# -- prefill: one walk per legal move --------------------------------------------------------------
def prefill_in(state):
    """A prefill room brought to `state` by real inputs."""
    r = prefill()
    if state is W:
        r.add_meta(DEC, 1, meta(), 1.0)
    elif state is T:
        r.add_meta(DEC, 1, meta(), 1.0)
        r.add_chunk(np.arange(2), False, 1.0)
    assert r.state is state
    return r


def test_prefill_bootstrapping_to_waiting_on_metadata():
    r = prefill_in(B)
    assert moves(r.add_meta(DEC, 1, meta(), 1.0)) == [W]


def test_prefill_bootstrapping_to_transferring_when_the_input_came_first():
    r = prefill_in(B)
    assert moves(r.add_chunk(np.arange(2), False, 1.0)) == []     # nothing moves before the metadata
    assert moves(r.add_meta(DEC, 1, meta(), 1.0)) == [T]


def test_prefill_waiting_to_transferring_on_input():
    assert moves(prefill_in(W).add_chunk(np.arange(2), False, 1.0)) == [T]


def test_prefill_more_input_while_transferring_stays_without_a_report():
    r = prefill_in(T)
    assert moves(r.add_chunk(np.arange(2, 4), True, 2.0)) == [] and r.state is T


def test_prefill_transferring_to_success_once_confirmed():
    r = prefill_in(T)
    r.add_chunk(np.arange(2, 4), True, 2.0)
    for op_id in list(r.ops):
        assert moves(r.on_write_done(op_id, True, None, 3.0)) == []
    assert moves(r.on_room_done(DEC, SESSION, 4.0)) == [S]


@pytest.mark.parametrize("state", [B, W, T])
def test_prefill_fails_from_every_live_status(state):
    assert moves(prefill_in(state).abort(5.0)) == [F]


# -- decode: one walk per legal move ---------------------------------------------------------------
def decode_in(state):
    r = decode()
    if state in (W, T):
        r.on_plan(plan(), 1.0)
    if state is T:
        r.init(np.arange(10, 10 + N), 1.0)
    assert r.state is state
    return r


def test_decode_bootstrapping_to_waiting_on_plan():
    assert moves(decode_in(B).on_plan(plan(), 1.0)) == [W]


def test_decode_waiting_to_transferring_once_its_metadata_went_out():
    acts = decode_in(W).init(np.arange(10, 10 + N), 1.0)
    assert moves(acts) == [T] and any(isinstance(a, Send) and isinstance(a.msg, RoomMeta) for a in acts)


def test_decode_transferring_to_success_once_every_byte_landed():
    d = decode_in(T)
    p = prefill()
    p.add_meta(DEC, 1, meta(), 1.0)
    writes = [a.op for a in p.add_chunk(np.arange(N), True, 2.0) if isinstance(a, PostWrite)]
    results = [d.on_tag(PREF, op.tag, 3.0) for op in writes]
    assert [moves(r.actions) for r in results] == [[S]]
    assert any(isinstance(a, Send) and isinstance(a.msg, RoomDone) for a in results[0].actions)


@pytest.mark.parametrize("state", [B, W, T])
def test_decode_fails_from_every_live_status(state):
    assert moves(decode_in(state).abort(None, 5.0)) == [F]


# -- the tables: every other move raises -----------------------------------------------------------
ROOMS = {"prefill": (prefill, PREFILL_TRANSITIONS), "decode": (decode, DECODE_TRANSITIONS)}
PAIRS = [(side, state, event) for side in ROOMS for state in KVPoll for event in RoomEvent]


@pytest.mark.parametrize("side,state,event", PAIRS, ids=lambda x: getattr(x, "name", str(x)))
def test_every_move_the_table_lacks_raises_and_changes_nothing(side, state, event):
    make, table = ROOMS[side]
    r = make()
    r.state = state
    if (state, event) in table:
        want = table[(state, event)]
        out = r._move(event, 1.0)
        assert r.state is want and moves(out) == ([] if want is state else [want])
        return
    with pytest.raises(IllegalTransition) as exc:
        r._move(event, 1.0)
    assert r.state is state and exc.value.state is state and exc.value.event is event


@pytest.mark.parametrize("table", [PREFILL_TRANSITIONS, DECODE_TRANSITIONS])
def test_final_statuses_have_no_way_out_and_only_input_repeats(table):
    assert FINAL == {S, F}
    assert not [k for k in table if k[0] in FINAL]
    assert [k for k, v in table.items() if k[0] is v] == ([(T, RoomEvent.INPUT)] if table is PREFILL_TRANSITIONS
                                                          else [])


def test_a_failed_room_ignores_later_failures_before_any_move():
    """Failing twice is not a move: `fail` returns nothing once the room ended."""
    r = prefill_in(W)
    r.abort(1.0)
    assert r.abort(2.0) == [] and r.state is F
