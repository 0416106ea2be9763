"""Telling the uses of a reused room id apart, on the prefill side, without sockets.

Room ids are reused, and a decode rank re-sends its room messages until they are acknowledged,
so a message of an earlier use can reach a later use's sender. A decode rank numbers its
sessions in increasing order (one per receiver), so remembering, per decode incarnation, the
highest session the id's earlier uses dealt with tells every earlier use's message apart,
however many uses back it was sent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable


@dataclass(frozen=True)
class EarlierUses:
    """Per decode incarnation, the highest session an earlier use of one room id dealt with."""

    last: dict = field(default_factory=dict)

    def covers(self, incarnation: int, session: int) -> bool:
        """The session belongs to an earlier use (never to a later one)."""
        return session <= self.last.get(incarnation, 0)

    def knows(self, incarnation: int) -> bool:
        return incarnation in self.last

    def plus(self, pairs: Iterable[tuple[int, int]]) -> "EarlierUses":
        """These and the (decode incarnation, session) pairs of one more ended use."""
        last = dict(self.last)
        for inc, session in pairs:
            last[inc] = max(session, last.get(inc, 0))
        return EarlierUses(last)


def finished_room_meta(earlier: EarlierUses, served: frozenset | tuple, incarnation: int, session: int) -> str:
    """Room metadata for a room id whose last use ended here, and no sender yet.
    "served": a retransmission of metadata that use served (no news); "new_use": a newer session
    from a decode incarnation the earlier uses dealt with, so a new use of the id whose sender is
    not created yet (park it, like any early metadata); "over": metadata that may belong to the
    ended use (tell the decode side the room is over here, rather than let it wait)."""
    if (incarnation, session) in served:
        return "served"
    if earlier.knows(incarnation) and not earlier.covers(incarnation, session):
        return "new_use"
    return "over"
