"""Prefill side: which staged writes may go now, and which writes ran out of time.

A staged piece may only be gathered and written once the decode ring's watermark shows its
region free; until then it waits, per decode peer, in arrival order. `StagedQueue` keeps those
waits and answers, for each new watermark or tick, what to dispatch and what to cancel.
`WriteDeadlines` remembers when each posted write must have completed. Both are pure: the
engine's write queue performs the gathers, the writes and the room updates they decide.
"""

from __future__ import annotations

from collections.abc import Callable

from .actions import WriteOp
from .kinds import StrKind


class Readiness(StrKind):
    """What to do with a waiting staged piece now (StagedQueue.take_ready)."""

    GO = "go"            # its ring region is free: gather and write it
    CANCEL = "cancel"    # its room failed or is gone: drop it


class StagedQueue:
    def __init__(self) -> None:
        self._by_peer: dict[int, list[tuple[WriteOp, float]]] = {}

    def __len__(self) -> int:
        return sum(len(q) for q in self._by_peer.values())

    def holds(self, op_id: int) -> bool:
        """Whether the op of that id waits here."""
        return any(op.op_id == op_id for queue in self._by_peer.values() for op, _ in queue)

    def add(self, peer: int, op: WriteOp, now: float) -> None:
        self._by_peer.setdefault(peer, []).append((op, now))

    def take_ready(self, peer: int, room_live: Callable[[int], bool],
                   region_free: Callable[[WriteOp], bool]) -> list[tuple[Readiness, WriteOp, float]]:
        """(CANCEL, op, since) for pieces whose room failed or is gone, (GO, op, since) for
        pieces whose ring region is free, in queue order; the rest keep waiting. The queue is
        updated before the caller acts, so acting may safely change it again."""
        out: list[tuple[Readiness, WriteOp, float]] = []
        keep = []
        for op, since in self._by_peer.get(peer, ()):
            if not room_live(op.room):
                out.append((Readiness.CANCEL, op, since))
            elif region_free(op):
                out.append((Readiness.GO, op, since))
            else:
                keep.append((op, since))
        self._set(peer, keep)
        return out

    def cancel_room(self, room: int) -> list[WriteOp]:
        """Every waiting piece of the room, removed."""
        out = []
        for peer, queue in list(self._by_peer.items()):
            mine = [op for op, _ in queue if op.room == room]
            if mine:
                out += mine
                self._set(peer, [(op, s) for op, s in queue if op.room != room])
        return out

    def drop_peer(self, peer: int) -> list[WriteOp]:
        return [op for op, _ in self._by_peer.pop(peer, [])]

    def expire(self, now: float, limit: float) -> list[WriteOp]:
        """Pieces that waited longer than `limit` seconds for ring space, removed."""
        out = []
        for peer, queue in list(self._by_peer.items()):
            late = [op for op, since in queue if now - since > limit]
            if late:
                out += late
                self._set(peer, [(op, s) for op, s in queue if now - s <= limit])
        return out

    def _set(self, peer: int, queue: list[tuple[WriteOp, float]]) -> None:
        if queue:
            self._by_peer[peer] = queue
        else:
            self._by_peer.pop(peer, None)


class WriteDeadlines:
    """op id -> (room, the time its write must have completed by)."""

    def __init__(self) -> None:
        self._at: dict[int, tuple[int, float]] = {}

    def __contains__(self, op_id: int) -> bool:
        return op_id in self._at

    def __len__(self) -> int:
        return len(self._at)

    def start(self, op_id: int, room: int, at: float) -> None:
        self._at[op_id] = (room, at)

    def restart(self, op_id: int, at: float) -> None:
        """The write left the queue and was posted: its time counts from now (if still tracked)."""
        if op_id in self._at:
            self._at[op_id] = (self._at[op_id][0], at)

    def done(self, op_id: int) -> None:
        self._at.pop(op_id, None)

    def expired(self, now: float) -> list[tuple[int, int]]:
        """(op id, room) of every write past its deadline, removed."""
        late = [(op_id, room) for op_id, (room, at) in self._at.items() if now > at]
        for op_id, _ in late:
            del self._at[op_id]
        return late
