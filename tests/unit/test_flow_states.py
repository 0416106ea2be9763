"""A prefill room's flow (one decode rank) moves only along FLOW_TRANSITIONS (protocol/prefill/flows.py),
h11 style: every legal move is walked, on the table and with a real room's inputs; every other
(state, event) pair raises IllegalTransition and changes nothing; the table is the product of
this rank's writing and the decode rank's confirmation (a hypothesis walk checks it)."""

import itertools
from collections import deque

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstage.transfer.config import Timeouts
from kvstage.transfer.layout import KVLayout
from kvstage.transfer.poll import KVPoll
from kvstage.transfer.protocol.actions import PeerKey, PostWrite, Send
from kvstage.transfer.protocol.lifecycle import IllegalTransition
from kvstage.transfer.protocol.messages import RoomMeta, WriterDone
from kvstage.transfer.protocol.prefill.flows import (
    CONFIRMED_STATES,
    FLOW_TRANSITIONS,
    UNCHECKED_STATES,
    Flow,
    FlowEvent,
    FlowState,
)
from kvstage.transfer.protocol.prefill.room import PrefillRoom

S, E = FlowState, FlowEvent
LAYOUT = KVLayout(num_layers=2, total_kv_heads=2, head_dim=4, dtype=torch.uint8, page_size=2, tp_size=1, tp_rank=0,
                  mla=False)   # one prefill rank, one decode rank
PREF = PeerKey("prefill", 0, 1000)
DEC = PeerKey("decode", 0, 2000)
N = 4
SESSION = 22


def new_flow() -> Flow:
    return Flow(peer=DEC, session=SESSION, assignment=None, staged=False)


def path_to(state: FlowState) -> list[FlowEvent] | None:
    """The shortest list of events that brings a new flow to `state` (breadth first on the table)."""
    seen = {S.WAITING_META: []}
    todo = deque([S.WAITING_META])
    while todo:
        s = todo.popleft()
        for (frm, ev), to in FLOW_TRANSITIONS.items():
            if frm is s and to not in seen:
                seen[to] = seen[s] + [ev]
                todo.append(to)
    return seen.get(state)


def flow_in(state: FlowState) -> Flow:
    f = new_flow()
    for ev in path_to(state):
        f.move(ev)
    assert f.state is state
    return f


# -- the table ------------------------------------------------------------------------------------
def test_every_state_is_reachable_and_failed_is_the_only_final_one():
    assert all(path_to(s) is not None for s in FlowState)
    leaving = {frm for (frm, ev), to in FLOW_TRANSITIONS.items() if to is not frm}
    assert set(FlowState) - leaving == {S.FAILED}
    assert {ev for (frm, ev) in FLOW_TRANSITIONS if frm is S.CONFIRMED} == {E.CONFIRM, E.FAIL}
    assert not any(frm is S.FAILED for frm, _ in FLOW_TRANSITIONS)


@pytest.mark.parametrize("state,event", list(itertools.product(FlowState, FlowEvent)),
                         ids=lambda x: x.value)
def test_every_move_the_table_lacks_raises_and_changes_nothing(state, event):
    f = flow_in(state)
    if (state, event) in FLOW_TRANSITIONS:
        assert f.move(event) is FLOW_TRANSITIONS[(state, event)] is f.state
        return
    with pytest.raises(IllegalTransition) as exc:
        f.move(event)
    assert f.state is state and exc.value.state is state and exc.value.event is event
    assert f"session {SESSION}" in str(exc.value)


def test_the_state_changes_only_through_move():
    f = new_flow()
    with pytest.raises(AttributeError):
        f.state = S.CONFIRMED
    with pytest.raises(TypeError):
        Flow(peer=DEC, session=SESSION, assignment=None, staged=False, _state=S.CONFIRMED)


# The table is two machines side by side (as h11 keeps one state per role): this rank's writing
# (metadata unchecked -> writing -> written) and the decode rank's confirmation, until the room fails.
PHASE = {(0, False): S.WAITING_META, (0, True): S.CONFIRMED_UNCHECKED, (1, False): S.WRITING,
         (1, True): S.CONFIRMED_WRITING, (2, False): S.DONE_SENT, (2, True): S.CONFIRMED}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(list(FlowEvent)), max_size=12))
def test_the_table_is_writing_times_confirmation(events):
    f, phase, confirmed, failed = new_flow(), 0, False, False
    for ev in events:
        legal = not failed and {E.CHECKED: phase == 0, E.WRITTEN: phase == 1, E.CONFIRM: True, E.FAIL: True}[ev]
        if not legal:
            with pytest.raises(IllegalTransition):
                f.move(ev)
        else:
            f.move(ev)
            phase += ev in (E.CHECKED, E.WRITTEN)
            confirmed |= ev is E.CONFIRM
            failed |= ev is E.FAIL
        assert f.state is (S.FAILED if failed else PHASE[(phase, confirmed)])
        assert (f.state in CONFIRMED_STATES) == (confirmed and not failed)
        assert (f.state in UNCHECKED_STATES) == (phase == 0 and not failed)


# -- a real room moves its flow ---------------------------------------------------------------------
def room(num_pages=None):
    return PrefillRoom(room=7, num_pages=num_pages, layout=LAYOUT, me=PREF.incarnation, now=0.0, timeouts=Timeouts(),
                       op_ids=itertools.count(1))


def meta():
    return RoomMeta(src=DEC.incarnation, dst=PREF.incarnation, room=7, session=SESSION, num_pages=N, staged=False,
                    dst_pages=np.arange(N, dtype="<i8").tobytes())


def writer_dones(actions):
    return [a for a in actions if isinstance(a, Send) and isinstance(a.msg, WriterDone)]


def writing_room(num_pages=N):
    r = room(num_pages)
    r.add_meta(DEC, 1, meta(), 1.0)
    if num_pages is None:
        assert r.flows[0].state is S.WAITING_META
        r.init(N, 1.5)
    assert r.flows[0].state is S.WRITING
    ops = [a.op.op_id for a in r.add_chunk(np.arange(N), True, 2.0) if isinstance(a, PostWrite)]
    assert ops and r.flows[0].state is S.WRITING
    return r, ops


@pytest.mark.parametrize("num_pages", [None, N], ids=["pages_at_init", "pages_at_creation"])
def test_a_flow_writes_sends_writer_done_and_is_confirmed(num_pages):
    r, ops = writing_room(num_pages)
    out = []
    for op_id in ops:
        out += r.on_write_done(op_id, True, None, 3.0)
    assert r.flows[0].state is S.DONE_SENT and len(writer_dones(out)) == 1
    r.on_room_done(DEC, SESSION, 4.0)
    assert r.flows[0].state is S.CONFIRMED and r.state is KVPoll.Success


def test_room_done_before_the_last_completion_needs_no_writer_done():
    r, ops = writing_room()
    r.on_room_done(DEC, SESSION, 2.5)
    assert r.flows[0].state is S.CONFIRMED_WRITING and r.state is KVPoll.Transferring
    r.on_room_done(DEC, SESSION, 2.6)   # repeated: no change
    assert r.flows[0].state is S.CONFIRMED_WRITING
    assert not writer_dones(r.on_peer_lost(DEC, "closed", 2.7))   # confirmed: its loss fails nothing
    out = []
    for op_id in ops:
        out += r.on_write_done(op_id, True, None, 3.0)
    assert r.flows[0].state is S.CONFIRMED and r.state is KVPoll.Success and not writer_dones(out)


def test_room_done_before_the_metadata_was_checked_is_kept():
    r = room()
    r.add_meta(DEC, 1, meta(), 1.0)
    r.on_room_done(DEC, SESSION, 1.2)
    assert r.flows[0].state is S.CONFIRMED_UNCHECKED
    r.init(N, 1.5)
    assert r.flows[0].state is S.CONFIRMED_WRITING


@pytest.mark.parametrize("at", ["waiting_meta", "writing", "done_sent"])
def test_a_failed_room_fails_its_flows(at):
    if at == "waiting_meta":
        r = room()
        r.add_meta(DEC, 1, meta(), 1.0)
    else:
        r, ops = writing_room()
        if at == "done_sent":
            for op_id in ops:
                r.on_write_done(op_id, True, None, 3.0)
    assert r.flows[0].state is S(at)
    r.abort(5.0)
    assert r.flows[0].state is S.FAILED and r.state is KVPoll.Failed


def test_a_bad_page_count_fails_the_room_and_the_flow():
    r = room(N + 1)
    r.add_meta(DEC, 1, meta(), 1.0)   # the decode rank expects N pages
    assert r.state is KVPoll.Failed and r.flows[0].state is S.FAILED
