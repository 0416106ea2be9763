"""A RoomFailed fails only the use of a room id it was meant for (engine + session + use).

Room ids are reused; a decode rank re-sends RoomFailed until the prefill side quiesces, so a
failure of an earlier use (its Quiesced reply lost) can reach a later sender of the same id.
"""

import itertools

import numpy as np
import torch

from kvstage.transfer.config import Timeouts
from kvstage.transfer.layout import KVLayout
from kvstage.transfer.poll import KVPoll
from kvstage.transfer.protocol.actions import Dropped, PeerKey, Send
from kvstage.transfer.protocol.messages import Quiesced, RoomMeta
from kvstage.transfer.protocol.prefill.room import PrefillRoom
from kvstage.transfer.protocol.room_uses import EarlierUses

LAYOUT = KVLayout(
    num_layers=2, total_kv_heads=2, head_dim=4, dtype=torch.uint8, page_size=2, tp_size=1, tp_rank=0, mla=False
)  # P=1 prefill rank
ME = 1000
DEC_A = PeerKey("decodeA", 0, 2000)
DEC_B = PeerKey("decodeB", 0, 3000)
N = 4


def room(stale=frozenset()):
    return PrefillRoom(room=7, num_pages=N, layout=LAYOUT, me=ME, now=0.0, timeouts=Timeouts(metadata=50),
                       op_ids=itertools.count(1), stale=EarlierUses().plus(stale))


def meta(peer, session):
    return RoomMeta(
        src=peer.incarnation,
        dst=ME,
        room=7,
        session=session,
        num_pages=N,
        staged=False,
        dst_pages=np.arange(N, dtype="<i8").tobytes(),
    )


def quiesced_for(actions, session):
    return any(isinstance(a, Send) and isinstance(a.msg, Quiesced) and a.msg.session == session for a in actions)


def test_stale_room_failed_of_another_session_leaves_the_bound_room_alone():
    r = room()
    r.add_meta(DEC_A, 1, meta(DEC_A, 22), 1.0)
    assert r.state is KVPoll.WaitingForInput
    acts = r.on_room_failed(DEC_A, 11, "aborted", "aborted by the decode caller", 2.0)  # use 1's session
    assert r.state is KVPoll.WaitingForInput, r.failure
    assert quiesced_for(acts, 11)  # nothing of this use went to session 11: the decode side may stop asking
    assert Dropped("stale_room_failed") in acts


def test_room_failed_from_another_engine_leaves_the_bound_room_alone():
    r = room()
    r.add_meta(DEC_B, 1, meta(DEC_B, 22), 1.0)
    acts = r.on_room_failed(DEC_A, 11, "aborted", "earlier use", 2.0)
    assert r.state is KVPoll.WaitingForInput, r.failure
    assert Dropped("stale_room_failed") in acts


def test_room_failed_of_the_bound_session_fails_the_room():
    r = room()
    r.add_meta(DEC_A, 1, meta(DEC_A, 22), 1.0)
    r.on_room_failed(DEC_A, 22, "aborted", "aborted by the decode caller", 2.0)
    assert r.state is KVPoll.Failed and r.failure_kind == "remote_aborted"


def test_room_failed_before_any_metadata_fails_the_room_at_once():
    r = room()  # the decode room failed before its metadata went out (tombstone)
    r.on_room_failed(DEC_A, 22, "bootstrap", "lookup failed", 1.0)
    assert r.state is KVPoll.Failed


def test_session_of_an_earlier_use_never_fails_a_new_use():
    first = room()
    first.add_meta(DEC_A, 1, meta(DEC_A, 11), 1.0)
    first.on_room_failed(DEC_A, 11, "aborted", "use 1", 2.0)
    assert first.state is KVPoll.Failed and first.released
    second = room(stale=first.sessions())
    acts = second.on_room_failed(DEC_A, 11, "aborted", "use 1, retransmitted", 3.0)
    assert second.state is KVPoll.Bootstrapping, second.failure
    assert quiesced_for(acts, 11) and Dropped("stale_room_failed") in acts


def test_parked_failure_applies_only_to_metadata_of_its_own_session():
    # arrived before this sender existed: bound to the session it names, not to this use
    r = room()
    assert r.on_room_failed(DEC_A, 11, "aborted", "before the sender", 1.0, early=True) == []
    assert r.state is KVPoll.Bootstrapping
    r.add_meta(DEC_A, 1, meta(DEC_A, 22), 2.0)
    assert r.state is KVPoll.WaitingForInput, r.failure

    r = room()
    r.on_room_failed(DEC_A, 22, "aborted", "before the sender", 1.0, early=True)
    r.add_meta(DEC_A, 1, meta(DEC_A, 22), 2.0)
    assert r.state is KVPoll.Failed and r.failure_kind == "remote_aborted"


def test_parked_failure_binds_after_a_lease_when_no_metadata_of_its_rank_came():
    # the decode room failed before its metadata went out: no metadata will ever bind it
    lease = Timeouts(metadata=50).lease
    r = room()
    r.on_room_failed(DEC_A, 11, "aborted", "aborted by the decode caller", 0.5, early=True)
    assert r.tick(lease) == [] and r.state is KVPoll.Bootstrapping  # within the lease: may be an earlier use's
    r.tick(lease + 0.1)
    assert r.state is KVPoll.Failed and r.failure_kind == "remote_aborted"
    assert "before its room metadata went out" in r.failure and r.failed_by == (DEC_A.incarnation, 11)


def test_parked_failure_of_a_rank_that_then_sent_another_session_never_binds():
    lease = Timeouts(metadata=50).lease
    r = room()
    r.on_room_failed(DEC_A, 11, "aborted", "an earlier use", 0.5, early=True)
    r.add_meta(DEC_A, 1, meta(DEC_A, 22), 1.0)  # this use's session: session 11 was an earlier use
    r.tick(lease + 1.0)
    assert r.state is KVPoll.WaitingForInput, r.failure


def test_metadata_retransmitted_from_an_earlier_use_is_stale():
    first = room()
    first.add_meta(DEC_A, 1, meta(DEC_A, 11), 1.0)
    first.on_room_failed(DEC_A, 11, "aborted", "use 1", 2.0)
    second = room(stale=first.sessions())
    assert second.meta_use(DEC_A, 11) == "stale"  # its MetaAck was late: never bound to use 2
    assert second.meta_use(DEC_A, 5) == "stale"  # a use further back
    assert second.meta_use(DEC_A, 22) == "this"
    assert second.meta_use(DEC_B, 11) == "this"  # another engine's session 11 is not use 1's


def test_metadata_of_a_new_session_from_a_rank_this_use_dealt_with_is_the_next_use():
    r = room()
    r.add_meta(DEC_A, 1, meta(DEC_A, 22), 1.0)
    assert r.meta_use(DEC_A, 22) == "this"  # a duplicate: add_meta ignores it
    assert r.meta_use(DEC_A, 33) == "next"  # its room of this use is over there
    failed = room()
    failed.on_room_failed(DEC_A, 22, "aborted", "before its metadata", 1.0)
    assert failed.state is KVPoll.Failed and failed.meta_use(DEC_A, 33) == "next"
