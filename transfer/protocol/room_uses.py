"""Room-id reuse: which use of a reused room id a message belongs to, decided in one place.

Room ids are reused, and a decode rank re-sends its room messages until they are acknowledged,
so a message of an earlier use can reach a later use's sender, and one of a later use can come
before that use's sender exists. A decode rank numbers its sessions in increasing order (one per
receiver), so remembering, per decode incarnation, the highest session the id's earlier uses
dealt with tells every earlier use's message apart, however many uses back it was sent.

Every decision returns a RoomUse; the rooms and the engine's sides only act on it:
- prefill, a sender exists: `meta_use` (metadata) and `failure_use` (a RoomFailed);
- prefill, no sender: `use_without_sender` (park it, drop it, or tell the decode side the room
  is over here; `finished_meta_use` and `finished_failure_use` once the id's last use ended);
- prefill, metadata parked for a sender that never came: `unserved_answer` (fail the decode
  room with a reason rather than let it wait for its room deadline);
- decode, the room ended here: `ended_answer` (what to answer a writer that still asks);
- decode, a room failed before its metadata went out: `tombstone_obsolete` (its RoomFailed,
  not sent yet, is dropped once a later use of the id started here).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from .actions import PeerKey
from .kinds import FailureKind, StrKind
from .messages import RoomFailed, RoomMeta


class RoomUse(StrKind):
    """Which use of a room id a message belongs to, and so what is done with it."""

    THIS = "this"        # the use at hand: apply it
    STALE = "stale"      # an earlier use's (a late retransmission): drop it
    NEXT = "next"        # a later use's, whose sender is not created yet: park it for that sender
    SERVED = "served"    # prefill, the id's last use ended: metadata that use served again (no news)
    OVER = "over"        # prefill, the id's last use ended: it may be that use's (tell the decode side)
    OTHER = "other"      # decode, the id's last use ended: a writer bound to another use (never "done")


@dataclass(frozen=True, slots=True)
class EarlierUses:
    """Per decode incarnation, the highest session an earlier use of one room id dealt with.

    Never changed once made (`plus` makes a new one), so one instance may serve many rooms:
    NO_EARLIER_USES, for every room id without an earlier use."""

    last: dict[int, int] = field(default_factory=dict)

    def covers(self, incarnation: int, session: int) -> bool:
        """The session belongs to an earlier use (never to a later one)."""
        return session <= self.last.get(incarnation, 0)

    def knows(self, incarnation: int) -> bool:
        return incarnation in self.last

    def plus(self, pairs: Iterable[tuple[int, int]]) -> EarlierUses:
        """These and the (decode incarnation, session) pairs of one more ended use."""
        last = dict(self.last)
        for inc, session in pairs:
            last[inc] = max(session, last.get(inc, 0))
        return EarlierUses(last)


NO_EARLIER_USES = EarlierUses()   # a room id used for the first time: shared by every such room (memory
                                  # measurements leave it out, sim/report.py)


@dataclass(frozen=True, slots=True)
class Bound:
    """The decode rank (and its session) a prefill room's flow of one decode TP rank is bound to."""

    peer: PeerKey
    session: int


@dataclass(frozen=True, slots=True)
class Parked:
    """A room message for a prefill room id that has no sender (yet), kept for it."""

    peer: PeerKey
    msg: RoomMeta | RoomFailed

    @property
    def is_meta(self) -> bool:
        return isinstance(self.msg, RoomMeta)


# -- prefill, a sender exists ------------------------------------------------------------------------
def meta_use(earlier: EarlierUses, bound: Bound | None, failed_by: tuple[int, int] | None, peer: PeerKey,
             session: int) -> RoomUse:
    """Metadata from `peer` with `session` reaching a sender: STALE (a retransmission from the
    id's earlier use), NEXT (a decode incarnation this use already dealt with under another
    session has moved on: its room of this use is over there) or THIS. `bound`: the flow of
    that decode TP rank; `failed_by`: (incarnation, session) of the failure that ended this use."""
    if earlier.covers(peer.incarnation, session):
        return RoomUse.STALE
    if bound is not None and bound.peer == peer and bound.session != session:
        return RoomUse.NEXT
    if failed_by is not None:
        failed_incarnation, failed_session = failed_by
        if failed_incarnation == peer.incarnation and failed_session != session:
            return RoomUse.NEXT
    return RoomUse.THIS


def failure_use(earlier: EarlierUses, bound: Bound | None, decode_engine: str | None, peer: PeerKey,
                session: int) -> RoomUse:
    """A RoomFailed reaching a sender that has no flow of that peer and session: STALE when it
    is an earlier use's, or the flow of that decode TP rank is bound to another session, or it
    comes from another engine than the room is bound to (nothing of this use went to that
    session: answer Quiesced); THIS otherwise."""
    if (earlier.covers(peer.incarnation, session) or bound is not None
            or (decode_engine is not None and peer.engine_id != decode_engine)):
        return RoomUse.STALE
    return RoomUse.THIS


# -- prefill, no sender ------------------------------------------------------------------------------
def finished_meta_use(earlier: EarlierUses, served: frozenset[tuple[int, int]] | tuple[()], incarnation: int,
                      session: int) -> RoomUse:
    """Room metadata for a room id whose last use ended here: SERVED (a retransmission of
    metadata that use served), NEXT (a newer session from a decode incarnation the earlier uses
    dealt with: a new use of the id whose sender is not created yet) or OVER (it may belong to
    the ended use: tell the decode side the room is over here, rather than let it wait)."""
    if (incarnation, session) in served:
        return RoomUse.SERVED
    if earlier.knows(incarnation) and not earlier.covers(incarnation, session):
        return RoomUse.NEXT
    return RoomUse.OVER


def finished_failure_use(earlier: EarlierUses, incarnation: int, session: int) -> RoomUse:
    """A RoomFailed for a room id whose last use ended here: NEXT when it names a newer session
    of a decode incarnation the earlier uses dealt with (a new use's decode room failed, maybe
    right after its metadata, parked here too: the coming sender must fail before it writes
    anything), OVER otherwise (it may be the ended use's, which has nothing in flight)."""
    if earlier.knows(incarnation) and not earlier.covers(incarnation, session):
        return RoomUse.NEXT
    return RoomUse.OVER


def use_without_sender(item: Parked, *, ended: bool, earlier: EarlierUses,
                       served: frozenset[tuple[int, int]] | tuple[()]) -> RoomUse:
    """A room message for an id with no sender: NEXT (park it until the sender is created)
    unless the id's last use `ended` here; then a failure is decided by `finished_failure_use`
    and metadata by `finished_meta_use`."""
    if not ended:
        return RoomUse.NEXT
    if not item.is_meta:
        return finished_failure_use(earlier, item.peer.incarnation, item.msg.session)
    return finished_meta_use(earlier, served, item.peer.incarnation, item.msg.session)


def unserved_answer(item: Parked, waited: float) -> tuple[str, str] | None:
    """Parked metadata whose sender never came within the metadata timeout (`waited` seconds):
    (kind, reason) of the RoomFailed its decode room is told, so it fails now rather than at its
    room deadline (its metadata was acknowledged: it is never sent again). A parked failure needs
    no answer (it was answered with Quiesced when it came): None."""
    if not item.is_meta:
        return None
    return (FailureKind.TIMEOUT, f"no prefill sender of room {item.msg.room} took this metadata (session "
                                 f"{item.msg.session}) within {waited:g} s")


# -- decode, the room ended ------------------------------------------------------------------------
@dataclass(frozen=True)
class EndedAnswer:
    """What a decode rank answers a writer asking about a room id whose last use ended: RoomDone
    when `kind` is None, else RoomFailed with `kind` and `reason`."""

    use: RoomUse
    kind: str | None = None
    reason: str = ""


def ended_answer(*, succeeded: bool, kind: str, reason: str, last_session: int, session: int,
                 room: int) -> EndedAnswer:
    """Only the session the ended use had may hear "done" (THIS); a writer bound to another use
    (OTHER) hears a protocol failure, and never succeeds."""
    if session != last_session:
        return EndedAnswer(RoomUse.OTHER, FailureKind.PROTOCOL,
                           f"room {room} has no use of session {session} here (a writer bound to metadata "
                           f"of another use of the id)")
    return EndedAnswer(RoomUse.THIS) if succeeded else EndedAnswer(RoomUse.THIS, kind, reason)


def repeats_outcome(*, ended_at: float, now: float, retry: float) -> bool:
    """Whether a decode rank answers a writer's WriterDone about a room it ended (RoomDone or
    RoomFailed again). The outcome went to every writer when the room ended, so a WriterDone
    that crossed it on the way (one that comes within `retry` of the end: a writer sends it as
    its own writes complete, and again only `retry` later while it hears nothing) needs no
    answer; one that comes later is the writer asking again, whose answer may have been lost
    (a dropped message, a connection made anew): answered. A lost outcome so costs at most two
    of the writer's retries, and a one-page request no second RoomDone per writer."""
    return now - ended_at >= retry


def writer_done_answer(*, succeeded: bool, kind: str, reason: str, last_session: int, session: int, room: int,
                       ended_at: float, now: float, retry: float) -> EndedAnswer | None:
    """The answer to a WriterDone about a room that ended here (and was released): the
    outcome again only when the writer is asking again (`repeats_outcome`); None when it
    crossed the outcome on the way. A WriterDone of another use of the id is always answered
    (ended_answer: a protocol failure)."""
    if session == last_session and not repeats_outcome(ended_at=ended_at, now=now, retry=retry):
        return None
    return ended_answer(succeeded=succeeded, kind=kind, reason=reason, last_session=last_session, session=session,
                        room=room)


# -- decode, a room failed before its metadata went out ---------------------------------------------
def tombstone_obsolete(*, room: int, session: int, started_room: int, started_session: int) -> bool:
    """A RoomFailed not yet sent for `room`'s use `session` (it failed before its metadata went
    out; its prefill ranks were not reachable yet) is obsolete once a later use of the same id
    (`started_session`) started on this decode rank: that use may start only after every prefill
    rank's previous use of the id ended (docs/api.md, room ids), so the failure could only reach
    the later use's sender, which has no metadata of this rank yet and would fail by it, and the
    later use would then wait for a sender that never serves it."""
    return room == started_room and session < started_session
