"""The lifecycle of a room: which status follows which, on which event, as two tables.

A room's status (KVPoll) is what the caller polls, so it only ever moves along these tables; a
move they do not list is a bug in the room and raises IllegalTransition instead of being
ignored (the engine fails that room as `internal`). A move to the same status is allowed only
where a table says so, and then changes nothing. Success and Failed are final: no event leaves
them, and the rooms check `ended` before they would try.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum

from ..poll import KVPoll
from .kinds import StrKind

B, W, T, S, F = (KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring, KVPoll.Success,
                 KVPoll.Failed)

FINAL = frozenset({S, F})


class RoomEvent(StrKind):
    """What moves a room's status."""

    METADATA_IN = "metadata_in"    # prefill: every decode rank's metadata agreed, no input to send yet
    INPUT = "input"                # prefill: every decode rank's metadata agreed and input is there
    PLANNED = "planned"            # decode: the prefill ranks are connected and the path decided
    METADATA_OUT = "metadata_out"  # decode: the destination pages are known and the metadata went out
    SUCCEED = "succeed"            # prefill: every decode rank confirmed; decode: every byte is in place
    FAIL = "fail"


Transitions = Mapping[tuple[KVPoll, RoomEvent], KVPoll]

PREFILL_TRANSITIONS: Transitions = {
    (B, RoomEvent.METADATA_IN): W,
    (B, RoomEvent.INPUT): T,            # the input came before the last metadata
    (W, RoomEvent.INPUT): T,
    (T, RoomEvent.INPUT): T,            # more input: no change
    (T, RoomEvent.SUCCEED): S,
    (B, RoomEvent.FAIL): F,
    (W, RoomEvent.FAIL): F,
    (T, RoomEvent.FAIL): F,
}

DECODE_TRANSITIONS: Transitions = {
    (B, RoomEvent.PLANNED): W,
    (W, RoomEvent.METADATA_OUT): T,
    (T, RoomEvent.SUCCEED): S,
    (B, RoomEvent.FAIL): F,
    (W, RoomEvent.FAIL): F,
    (T, RoomEvent.FAIL): F,
}


class IllegalTransition(RuntimeError):
    """A room (or one of its flows, flows.py) tried a move its table does not list (a bug in
    the room). `room` None: `what` names the flow."""

    def __init__(self, what: str, room: int | None, state: Enum, event: Enum):
        where = what if room is None else f"{what} {room}"
        super().__init__(f"{where}: no move from {state.name} on {event.value}")
        self.room, self.state, self.event = room, state, event


def next_state(table: Transitions, what: str, room: int, state: KVPoll, event: RoomEvent) -> KVPoll:
    """The status `event` moves a room from `state` to; raises IllegalTransition when the
    table has no such move."""
    new = table.get((state, event))
    if new is None:
        raise IllegalTransition(what, room, state, event)
    return new
