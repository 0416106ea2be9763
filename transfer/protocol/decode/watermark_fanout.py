"""Decode side: which prefill ranks are told that the staging ring's watermark moved. Pure.

A staged write waits until its writer's view of the decode rank's ring watermark allows it
(transfer/protocol/ring.py, RemoteWatermark). Sending every move to every connected prefill rank that
stages makes the messages per request grow with the fleet: a decode rank of a large fleet is
connected to dozens of prefill engines, most of which have nothing in its ring
(docs/scale.md). So a writer is told the current watermark when its allocation request comes,
before its grant (`before_grant`; the connection keeps the order, so the update is applied
first): a region granted while the ring has room is then writable at once, and needs no more.
A move is sent only to the writers that still have a region granted here that has not landed
from them, that their view does not allow yet and that the new position does (`publish`, with
`pending_parts`): those are the only ones the move unblocks. A move that unblocks none of a
writer's regions is not sent to it: after a stalled ring moves again, in many small steps, each
blocked region costs one message, not one per step (docs/scale.md). The heartbeats still carry the watermark to every staging
peer (engine/liveness.py), so nothing waits longer than a heartbeat if a message is lost.

Invariant: whenever the watermark moves, every writer with a granted, unlanded region that its
last told position did not allow and the new position allows is told the new position; so a
writer's region that the ring allows is one its last told position allows.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from .room import DecodeRoom


class WatermarkFanout:
    """What one decode rank told each prefill incarnation about its ring's watermark."""

    def __init__(self) -> None:
        self._told: dict[int, int] = {}   # prefill incarnation -> linear watermark it was told last

    def publish(self, pending: Iterable[tuple[int, int]], linear: int, size: int) -> list[int]:
        """The watermark moved to `linear` in a ring of `size` bytes. `pending`: (writer
        incarnation, linear end of a region granted to it whose bytes have not landed from it).
        The writers to tell, in order: those with such a region their last told position does
        not allow and `linear` does (a region ending at `end` is writable once the watermark is at
        `end - size` or later)."""
        out = sorted({p for p, end in pending if self._told.get(p, -1) + size < end <= linear + size})
        for p in out:
            self._told[p] = linear
        return out

    def before_grant(self, peer: int, linear: int) -> bool:
        """An allocation request from `peer`: whether to tell it the watermark `linear` first."""
        if self._told.get(peer, -1) >= linear:
            return False
        self._told[peer] = linear
        return True

    def forget(self, peer: int) -> None:
        """The peer's connection ended: a new one starts from nothing told."""
        self._told.pop(peer, None)


def pending_parts(rooms: Iterable[DecodeRoom]) -> Iterator[tuple[int, int]]:
    """(writer incarnation, region end) of every staged region granted in `rooms` and not landed
    from that writer yet."""
    for room in rooms:
        if room.plan is None or not room.plan.staged or room.tracker is None:
            continue
        pieces = {p.key: p for p in room.tracker.pieces()}
        for chunk, alloc in room.allocs.items():
            for index, region in alloc.regions.items():
                piece = pieces.get((chunk, index))
                if piece is None:
                    continue
                for w in piece.writers:
                    if not piece.has_landed(w) and w in room.writers:
                        yield room.writers[w].peer.incarnation, region.end
