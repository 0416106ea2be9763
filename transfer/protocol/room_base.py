"""What the prefill and the decode room share: identity, status, failure, release.

Each side says which lifecycle table it follows (lifecycle.py), whom a failure is told to and
what happens after it; the status moves, the failure notices and the release report are
written once, here, as shared actions (actions.SharedAction) in the role's own list.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Generic, TypeVar

from ..layout import KVLayout
from ..poll import KVPoll
from ..pool_spec import PoolSpec
from ..timeouts import Timeouts
from .actions import DecodeAction, PeerKey, PrefillAction, Released, Send, StatusChanged
from .kinds import remote_kind
from .lifecycle import FINAL, RoomEvent, Transitions, next_state
from .messages import RoomFailed

A = TypeVar("A", PrefillAction, DecodeAction)
"""The actions of the room's role: a prefill room is a RoomBase[PrefillAction], a decode room a
RoomBase[DecodeAction] (mypy checks this base once for each)."""


class RoomBase(Generic[A]):
    """Memory: a rank holds one room per request in flight, thousands. CPython keeps an
    instance's attributes in a dictionary whose keys all instances share (a few bytes per
    attribute) only while the class has fewer than 30 of them; past that each room gets a
    dictionary of its own (about 1.3 KiB more). Attributes that keep a default for most of a
    room's life are class attributes here (set on the instance only when they change);
    `tests/unit/test_room_memory.py` keeps the rooms under the bound."""

    TRANSITIONS: ClassVar[Transitions]
    PEER_SIDE: ClassVar[str]            # what the other side's ranks are called in failure reasons
    failure: str | None = None          # instance attribute once the room failed
    failure_kind: str | None = None     # a FailureKind, or "remote_<kind>" for a peer's
    released = False
    ended_at: float | None = None       # instance attribute once the room ended (Success or Failed)

    def __init__(self, *, room: int, me: int, layout: KVLayout, now: float, timeouts: Timeouts,
                 pools: tuple[PoolSpec, ...] = ()):
        self.room = room
        self.me = me
        self.layout = layout
        self.timeouts = timeouts
        self.created = now
        self.pools = pools                  # the state pools' specs
        self.state = KVPoll.Bootstrapping

    @property
    def ended(self) -> bool:
        """Success or Failed: the status never changes again."""
        return self.state in FINAL

    # -- status -----------------------------------------------------------------------------
    def _move(self, event: RoomEvent, now: float) -> list[A]:
        """Move the status along the side's table (IllegalTransition when it has no such
        move); report it unless it stayed the same."""
        state = next_state(self.TRANSITIONS, type(self).__name__, self.room, self.state, event)
        if state == self.state:
            return []
        self.state = state
        if state in FINAL:
            self.ended_at = now
        return [StatusChanged(state=state, failure=self.failure, failure_kind=self.failure_kind)] + self._entered(state, now)

    def _entered(self, state: KVPoll, now: float) -> list[A]:
        """What a side does on entering `state` (after reporting it)."""
        return []

    # -- failure ----------------------------------------------------------------------------
    def fail(self, kind: str, reason: str, now: float, origin: PeerKey | None = None) -> list[A]:
        """Fail the room and tell every peer of the room but the one the failure came from."""
        if self.ended:
            return []
        self.failure, self.failure_kind = reason, kind
        out = self._move(RoomEvent.FAIL, now)
        out += [Send(peer, self._failed_msg(peer, session)) for peer, session in self._told_of_failure()
                if peer != origin]
        return out + self._after_failure(now)

    def _fail_remote(self, peer: PeerKey, kind: str, reason: str, now: float) -> list[A]:
        """A peer failed the room with `kind`: fail it here as remote_<kind>, naming the peer."""
        return self.fail(remote_kind(kind), f"{self.PEER_SIDE} rank {peer.tp_rank} ({peer.engine_id}): {reason}", now,
                         origin=peer)

    def _told_of_failure(self) -> Sequence[tuple[PeerKey, int]]:
        """(peer, session) of every peer a failure is told to."""
        raise NotImplementedError

    def _after_failure(self, now: float) -> list[A]:
        return []

    def _failed_msg(self, peer: PeerKey, session: int) -> RoomFailed:
        return RoomFailed(src=self.me, dst=peer.incarnation, room=self.room, session=session,
                          kind=self.failure_kind or "failed", reason=self.failure or "")

    # -- release ----------------------------------------------------------------------------
    def _release(self) -> list[A]:
        """The room's memory is no longer touched: say so (the shell may forget the room)."""
        self.released = True
        return [StatusChanged(state=self.state, failure=self.failure, failure_kind=self.failure_kind, released=True),
                Released()]
