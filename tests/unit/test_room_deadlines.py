"""A room never stays in a state past its deadline (issue 49 item 4): for every state a room
can be stuck in when its peer stops answering, the clock passing the deadline that covers that
state ends it Failed, with a reason that names the deadline; a moment before, it is still live.

The rooms are pure (time is an argument), so the clock is `tick(now)`; a decode room that waits
for its plan is ended by the engine's planner, driven here with fakes. A state whose wait is on
the room's own caller (a prefill sender waiting for input, a decode receiver waiting for init())
has no room deadline: a peer that stops answering there is ended by its lease
(`test_a_silent_peer_ends_every_live_state_through_its_lease`).
"""

import itertools

import numpy as np
import pytest
import torch

from kvstage.transfer.config import Timeouts
from kvstage.transfer.engine.decode_planning import EnginePlanner, EngineView
from kvstage.transfer.engine.prefill_sources import PrefillSource
from kvstage.transfer.engine.rooms import DecodeBook
from kvstage.transfer.engine.stats import Stats
from kvstage.transfer.layout import KVLayout
from kvstage.transfer.poll import KVPoll
from kvstage.transfer.protocol.actions import PeerKey, PostWrite
from kvstage.transfer.protocol.decode.room import DecodeRoom, RoomPlan
from kvstage.transfer.protocol.head_mapping import compute_assignments
from kvstage.transfer.protocol.kinds import FailureKind
from kvstage.transfer.protocol.leases import Lease
from kvstage.transfer.protocol.messages import RoomMeta, WriterDone
from kvstage.transfer.protocol.prefill.room import PrefillRoom

B, W, T, F = KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring, KVPoll.Failed
LAYOUT = KVLayout(num_layers=2, total_kv_heads=2, head_dim=4, dtype=torch.uint8, page_size=2, tp_size=1, tp_rank=0,
                  mla=False)   # one prefill rank
PREF = PeerKey("prefill", 0, 1000)
DEC = [PeerKey("decode", 0, 2000), PeerKey("decode", 1, 2001)]
N, SESSION, T0 = 4, 22, 5.0   # T0: when the room reached the state (its clock starts later than 0)
TO = Timeouts()


def secs(x: float) -> str:
    return f"{x:g} s"


# -- prefill --------------------------------------------------------------------------------------
def prefill() -> PrefillRoom:
    return PrefillRoom(room=7, num_pages=N, layout=LAYOUT, me=PREF.incarnation, now=0.0, timeouts=TO,
                       op_ids=itertools.count(1))


def meta(dec: PeerKey, staged: bool = False) -> RoomMeta:
    return RoomMeta(src=dec.incarnation, dst=PREF.incarnation, room=7, session=SESSION, num_pages=N, staged=staged,
                    dst_pages=b"" if staged else np.arange(N, dtype="<i8").tobytes())


def p_no_metadata():
    return prefill(), 0.0


def p_input_but_no_metadata():
    r = prefill()
    r.add_chunk(np.arange(N), True, T0)
    return r, 0.0


def p_one_of_two_decode_ranks():
    r = prefill()
    r.add_meta(DEC[0], 2, meta(DEC[0]), T0)   # decode TP 2: this rank serves both decode ranks
    return r, 0.0


def p_a_parked_failure():
    r = prefill()
    r.on_room_failed(DEC[0], SESSION, "aborted", "aborted by the decode caller", T0, early=True)
    return r, 0.0


def p_no_ring_space():
    r = prefill()
    r.add_meta(DEC[0], 1, meta(DEC[0], staged=True), T0)
    r.add_chunk(np.arange(N), True, T0)     # asks for ring space: never granted
    return r, T0


def p_no_confirmation():
    r = prefill()
    r.add_meta(DEC[0], 1, meta(DEC[0]), T0)
    ops = [a.op for a in r.add_chunk(np.arange(N), True, T0) if isinstance(a, PostWrite)]
    assert ops
    for op in ops:
        r.on_write_done(op.op_id, True, None, T0)   # every write landed, WriterDone sent: no RoomDone comes
    return r, T0


PREFILL = [
    # (name, the room in its state, the state, the deadline from the clock's start, failure kind, reason words)
    ("Bootstrapping: no metadata", p_no_metadata, B, TO.metadata, FailureKind.TIMEOUT,
     ["no room metadata from any decode rank", secs(TO.metadata)]),
    ("Bootstrapping: the input is in, no metadata", p_input_but_no_metadata, B, TO.metadata, FailureKind.TIMEOUT,
     ["no room metadata", secs(TO.metadata)]),
    ("Bootstrapping: one of two decode ranks sent metadata", p_one_of_two_decode_ranks, B, TO.metadata,
     FailureKind.TIMEOUT, ["decode rank(s) [1]", secs(TO.metadata)]),
    ("Bootstrapping: a failure parked before the sender, no metadata", p_a_parked_failure, B, TO.lease,
     "remote_aborted", ["before its room metadata went out"]),
    ("Transferring: staged, no ring allocation", p_no_ring_space, T, TO.watermark, FailureKind.TIMEOUT,
     ["no ring allocation for chunk 0", secs(TO.watermark)]),
    ("Transferring: every write landed, never confirmed", p_no_confirmation, T, TO.arrival + TO.scatter,
     FailureKind.TIMEOUT, ["did not confirm the room", secs(TO.arrival + TO.scatter), "of the last write"]),
]


@pytest.mark.parametrize("name,build,state,deadline,kind,words", PREFILL, ids=[row[0] for row in PREFILL])
def test_a_prefill_room_never_outlives_its_deadline(name, build, state, deadline, kind, words):
    r, start = build()
    assert r.state is state
    r.tick(start + deadline)            # the deadline itself: still live
    assert r.state is state, r.failure
    r.tick(start + deadline + 0.01)
    assert r.state is F and r.failure_kind == kind, (r.failure_kind, r.failure)
    assert all(w in r.failure for w in words), r.failure


# -- decode ---------------------------------------------------------------------------------------
def decode() -> DecodeRoom:
    return DecodeRoom(room=7, session=SESSION, me=DEC[0].incarnation, layout=LAYOUT, now=0.0, timeouts=TO)


def plan() -> RoomPlan:
    a = compute_assignments(1, 1, LAYOUT.total_kv_heads, False).find(0, 0)
    hpb = LAYOUT.num_kv * LAYOUT.num_layers * LAYOUT.page_size * LAYOUT.head_bytes
    return RoomPlan(writers=((PREF, a),), notices=(), staged=False, head_page_bytes=hpb)


def d_inited_not_planned():
    r = decode()
    r.init(np.arange(N), T0)
    return r, T0


def d_metadata_out_no_write():
    r = decode()
    r.on_plan(plan(), 1.0)
    r.init(np.arange(N), T0)
    return r, T0


def d_writer_done_tags_missing():
    r = decode()
    r.on_plan(plan(), 1.0)
    r.init(np.arange(N), 1.0)
    r.on_writer_done(PREF, WriterDone(src=PREF.incarnation, dst=DEC[0].incarnation, room=7, session=SESSION, writes=1,
                                      nbytes=64), T0)   # its one write's notification never comes
    return r, T0


DECODE = [
    ("Bootstrapping after init: never planned", d_inited_not_planned, B, TO.room, FailureKind.TIMEOUT,
     ["room not complete", secs(TO.room), "after init"]),
    ("Transferring: metadata out, no write comes", d_metadata_out_no_write, T, TO.room, FailureKind.TIMEOUT,
     ["room not complete", secs(TO.room), "after init"]),
    ("Transferring: writes reported done, a notification missing", d_writer_done_tags_missing, T, TO.arrival,
     FailureKind.TIMEOUT, ["reported 1 writes done but only 0 notifications", secs(TO.arrival)]),
]


@pytest.mark.parametrize("name,build,state,deadline,kind,words", DECODE, ids=[row[0] for row in DECODE])
def test_a_decode_room_never_outlives_its_deadline(name, build, state, deadline, kind, words):
    r, start = build()
    assert r.state is state
    r.tick(None, start + deadline)
    assert r.state is state, r.failure
    r.tick(None, start + deadline + 0.01)
    assert r.state is F and r.failure_kind == kind, (r.failure_kind, r.failure)
    assert all(w in r.failure for w in words), r.failure


class FakeSide:
    def status_changed(self, room, a):
        pass

    def released(self, room):
        pass


@pytest.mark.parametrize("init", [False, True], ids=["before init", "after init"])
def test_a_decode_room_whose_prefill_engine_never_answers_fails_at_its_plan_deadline(init):
    """Bootstrapping: the prefill engine's lookup or connection never completes; the planner
    ends the room bootstrap + connect after its creation (before the room deadline, after init)."""
    stats = Stats()
    book = DecodeBook(outbox=None, stats=stats, observer=None, hooks=FakeSide)
    planner = EnginePlanner(me=1, layout=None, timeouts=TO, stats=stats, post=None, sock=None, ring=None, facts=None,
                            hello=None, peers=None, book=book, lookup=lambda source, timeout: [])
    r = decode()
    if init:
        r.init(np.arange(N), 0.0)
    book.rooms[r.room] = r
    source = PrefillSource(engine_id="p")
    planner.engines[source.key] = EngineView(source=source, engine_id="p", rooms={r.room})   # still looking up
    limit = TO.bootstrap + TO.connect
    planner.plan_deadlines(limit)
    assert r.state is B, r.failure
    planner.plan_deadlines(limit + 0.01)
    assert r.state is F and r.failure_kind == FailureKind.CONNECT, r.failure
    assert secs(limit) in r.failure and "prefill engine p not ready" in r.failure


# -- a silent peer, in every live state -----------------------------------------------------------
def lease_runs_out() -> float:
    """When the engine declares a peer that stopped answering at 0 lost: its lease's end."""
    lease = Lease(TO.lease, 0.0)
    assert lease.alive(TO.lease)
    assert not lease.alive(TO.lease + 0.01)
    return TO.lease + 0.01


def p_waiting_for_input():
    r = prefill()
    r.add_meta(DEC[0], 1, meta(DEC[0]), 0.0)
    return r


def p_writing():
    r = prefill()
    r.add_meta(DEC[0], 1, meta(DEC[0]), 0.0)
    r.add_chunk(np.arange(2), False, 0.0)   # a write in flight
    return r


SILENT_PREFILL = [(W, p_waiting_for_input), (T, p_writing)]


@pytest.mark.parametrize("state,build", SILENT_PREFILL, ids=[s.name for s, _ in SILENT_PREFILL])
def test_a_silent_peer_ends_every_live_state_through_its_lease(state, build):
    r = build()
    assert r.state is state
    now = lease_runs_out()
    r.on_peer_lost(DEC[0], "no heartbeat within the lease", now)
    assert r.state is F and r.failure_kind == FailureKind.PEER_LOST and "lease" in r.failure, r.failure


def d_planned():
    r = decode()
    r.on_plan(plan(), 0.0)
    return r


def d_transferring():
    r = d_planned()
    r.init(np.arange(N), 0.0)
    return r


@pytest.mark.parametrize("state,build", [(W, d_planned), (T, d_transferring)], ids=["WaitingForInput", "Transferring"])
def test_a_silent_writer_ends_every_live_decode_state_through_its_lease(state, build):
    r = build()
    assert r.state is state
    now = lease_runs_out()
    r.on_peer_lost(PREF, "no heartbeat within the lease", None, now)
    assert r.state is F and r.failure_kind == FailureKind.PEER_LOST and "lease" in r.failure, r.failure
    assert r.released   # nothing of the lost writer's can land any more (no quarantine given)


def test_a_failed_decode_room_holds_its_memory_for_a_silent_writer_only_until_its_quarantine():
    """Failed, not released: the writer never says Quiesced; its lease ends, then its backend's
    stall bound (the quarantine) passes and the room lets its pages go."""
    r = d_transferring()
    r.abort(None, 1.0)
    assert r.state is F and not r.released
    now = lease_runs_out()
    quarantine = TO.quarantine_for("mooncake")
    r.on_peer_lost(PREF, "no heartbeat within the lease", None, now, quarantine=quarantine)
    r.tick(None, now + quarantine - 0.01)
    assert not r.released
    r.tick(None, now + quarantine)
    assert r.released


def test_an_ended_decode_room_answers_a_writer_done_only_when_the_writer_asks_again():
    """Its outcome went to the writer as it ended (RoomFailed here: aborted at T0); a WriterDone
    that crossed it gets no second answer, one a heartbeat later does (room_uses.repeats_outcome)."""
    r, _ = d_metadata_out_no_write()
    sent = r.abort(None, T0)
    assert r.state is F and [type(a.msg).__name__ for a in sent if hasattr(a, "msg")] == ["RoomFailed"]
    done = WriterDone(src=PREF.incarnation, dst=DEC[0].incarnation, room=7, session=SESSION, writes=1, nbytes=64)
    assert r.on_writer_done(PREF, done, T0 + 0.01) == []
    again = r.on_writer_done(PREF, done, T0 + TO.heartbeat)
    assert [type(a.msg).__name__ for a in again] == ["RoomFailed"] and again[0].peer == PREF
