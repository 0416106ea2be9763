"""Room-id reuse, every decision of protocol/room_uses.py in one table: which use of a reused
room id a message belongs to, on each side, in each situation."""

import pytest

from kvstage.transfer.protocol.actions import PeerKey
from kvstage.transfer.protocol.kinds import FailureKind
from kvstage.transfer.protocol.messages import RoomFailed, RoomMeta
from kvstage.transfer.protocol.room_uses import (
    Bound,
    EarlierUses,
    Parked,
    RoomUse,
    ended_answer,
    failure_use,
    meta_use,
    tombstone_obsolete,
    unserved_answer,
    use_without_sender,
    writer_done_answer,
)

DEC = PeerKey("decode", 0, 7)          # decode incarnation 7
OTHER_ENGINE = PeerKey("decode2", 0, 9)
OLD = EarlierUses().plus({(7, 90)}).plus({(7, 100), (8, 200)})   # two ended uses of the id
NONE = EarlierUses()


def meta(peer, session):
    return Parked(peer, RoomMeta(src=peer.incarnation, dst=1, room=5, session=session, num_pages=4, staged=False))


def failed(peer, session):
    return Parked(peer, RoomFailed(src=peer.incarnation, dst=1, room=5, session=session, kind="aborted", reason=""))


def ended(session, succeeded=True):
    return ended_answer(succeeded=succeeded, kind="aborted", reason="by the caller", last_session=5, session=session,
                        room=5).use


TABLE = [
    # prefill, a sender exists: metadata
    ("earlier use's metadata, acked late", meta_use(OLD, None, None, DEC, 100), RoomUse.STALE),
    ("metadata two uses back", meta_use(OLD, None, None, DEC, 90), RoomUse.STALE),
    ("metadata of a fresh session", meta_use(OLD, None, None, DEC, 101), RoomUse.THIS),
    ("the bound session again (a duplicate)", meta_use(NONE, Bound(DEC, 22), None, DEC, 22), RoomUse.THIS),
    ("that decode rank moved on to another session", meta_use(NONE, Bound(DEC, 22), None, DEC, 33), RoomUse.NEXT),
    ("another incarnation of that decode TP rank", meta_use(NONE, Bound(OTHER_ENGINE, 22), None, DEC, 33),
     RoomUse.THIS),
    ("a failure of session 22 ended this use, now 33", meta_use(NONE, None, (7, 22), DEC, 33), RoomUse.NEXT),
    ("the session whose failure ended this use", meta_use(NONE, None, (7, 22), DEC, 22), RoomUse.THIS),
    # prefill, a sender exists: a RoomFailed that no flow of it is bound to
    ("an earlier use's failure", failure_use(OLD, None, None, DEC, 100), RoomUse.STALE),
    ("that decode TP rank is bound to another session", failure_use(NONE, Bound(DEC, 22), None, DEC, 11),
     RoomUse.STALE),
    ("another engine's failure", failure_use(NONE, None, "decode2", DEC, 11), RoomUse.STALE),
    ("a failure before any metadata of this use", failure_use(OLD, None, None, DEC, 101), RoomUse.THIS),
    # prefill, no sender
    ("metadata before its sender exists", use_without_sender(meta(DEC, 5), ended=False, earlier=NONE, served=()),
     RoomUse.NEXT),
    ("a failure before its sender exists", use_without_sender(failed(DEC, 5), ended=False, earlier=NONE, served=()),
     RoomUse.NEXT),
    ("the ended use's failure again", use_without_sender(failed(DEC, 100), ended=True, earlier=OLD, served=()),
     RoomUse.OVER),
    ("a failure two uses back", use_without_sender(failed(DEC, 90), ended=True, earlier=OLD, served=()),
     RoomUse.OVER),
    ("a newer session's failure for an ended id: the coming sender's", use_without_sender(
        failed(DEC, 101), ended=True, earlier=OLD, served=()), RoomUse.NEXT),
    ("a failure from a rank the ended uses never heard from", use_without_sender(
        failed(OTHER_ENGINE, 101), ended=True, earlier=OLD, served=()), RoomUse.OVER),
    ("a failure for an ended id with no remembered uses", use_without_sender(
        failed(DEC, 101), ended=True, earlier=NONE, served=()), RoomUse.OVER),
    ("metadata the ended use served, again", use_without_sender(meta(DEC, 100), ended=True, earlier=OLD,
                                                                served=frozenset({(7, 100)})), RoomUse.SERVED),
    ("the ended use's own session, not served (it failed)", use_without_sender(meta(DEC, 100), ended=True,
                                                                               earlier=OLD, served=()), RoomUse.OVER),
    ("two uses back: never a new use", use_without_sender(meta(DEC, 90), ended=True, earlier=OLD, served=()),
     RoomUse.OVER),
    ("a newer session of a rank the ended uses knew", use_without_sender(meta(DEC, 101), ended=True, earlier=OLD,
                                                                         served=()), RoomUse.NEXT),
    ("a rank the ended uses never heard from: ambiguous", use_without_sender(meta(OTHER_ENGINE, 101), ended=True,
                                                                             earlier=OLD, served=()), RoomUse.OVER),
    ("an ended id with no remembered uses", use_without_sender(meta(DEC, 101), ended=True, earlier=NONE, served=()),
     RoomUse.OVER),
    # decode, the room ended
    ("the ended use's writer asks again", ended(5), RoomUse.THIS),
    ("a writer of an older use", ended(4), RoomUse.OTHER),
    ("a writer of a newer use", ended(6, succeeded=False), RoomUse.OTHER),
]


@pytest.mark.parametrize("what,got,want", TABLE, ids=[row[0] for row in TABLE])
def test_which_use_a_message_belongs_to(what, got, want):
    assert got is want, what


def test_the_table_reaches_every_verdict():
    assert {row[2] for row in TABLE} == set(RoomUse)


def test_an_ended_room_says_done_only_to_its_own_session():
    assert ended_answer(succeeded=True, kind="gone", reason="it succeeded", last_session=5, session=5,
                        room=77).kind is None
    failed_ = ended_answer(succeeded=False, kind="aborted", reason="by the caller", last_session=5, session=5, room=77)
    assert (failed_.kind, failed_.reason) == ("aborted", "by the caller")
    other = ended_answer(succeeded=True, kind="gone", reason="it succeeded", last_session=5, session=4, room=77)
    assert other.kind is FailureKind.PROTOCOL and "session 4" in other.reason


def test_a_writer_done_that_crossed_the_outcome_is_not_answered_one_asked_again_is():
    """The outcome went to every writer as the room ended at 10.0 (retry 1 s): a WriterDone
    within the retry crossed it; one a retry later is the writer asking again."""
    def answer(now, session=5, succeeded=True):
        return writer_done_answer(succeeded=succeeded, kind="aborted", reason="by the caller", last_session=5,
                                  session=session, room=77, ended_at=10.0, now=now, retry=1.0)
    assert answer(10.0) is None and answer(10.99) is None
    again = answer(11.0)
    assert again is not None and again.use is RoomUse.THIS and again.kind is None        # RoomDone again
    failed_ = answer(12.0, succeeded=False)
    assert failed_ is not None and (failed_.kind, failed_.reason) == ("aborted", "by the caller")
    assert answer(12.0, succeeded=False) is not None and answer(10.5, succeeded=False) is None
    other = answer(10.0, session=4)   # another use of the id: always told, at once
    assert other is not None and other.use is RoomUse.OTHER and other.kind is FailureKind.PROTOCOL


def test_earlier_uses_cover_every_older_session_of_their_ranks():
    uses = EarlierUses().plus({(7, 5)}).plus({(7, 3), (8, 9)})
    assert uses.covers(7, 5) and uses.covers(7, 1) and not uses.covers(7, 6)
    assert uses.covers(8, 9) and not uses.covers(8, 10) and not uses.covers(9, 1)


def test_metadata_no_sender_took_is_answered_with_a_failure_and_a_parked_failure_is_not():
    """Parked metadata dropped at the metadata timeout: its decode room fails now (it was
    acknowledged, so it is never sent again, and would wait for its room deadline)."""
    kind, reason = unserved_answer(meta(DEC, 33), 3.0)
    assert kind is FailureKind.TIMEOUT and "session 33" in reason and "room 5" in reason and "3 s" in reason
    assert unserved_answer(failed(DEC, 33), 3.0) is None   # answered with Quiesced when it came


@pytest.mark.parametrize("room,session,started_room,started_session,want", [
    (42, 1, 42, 2, True),    # a later use of the id started here: the failure could only reach its sender
    (42, 2, 42, 2, False),   # the use itself
    (42, 3, 42, 2, False),   # never older than the use that starts
    (41, 1, 42, 2, False),   # another id
])
def test_a_failure_not_sent_yet_is_dropped_once_a_later_use_of_its_id_starts(room, session, started_room,
                                                                               started_session, want):
    assert tombstone_obsolete(room=room, session=session, started_room=started_room,
                              started_session=started_session) is want
