"""The rooms (requests) of this rank and the carrying out of their state machines' actions.

Every room state machine returns actions; `RoomBook.apply` is where they happen: messages go
to peers, writes to the write queue, scatters and watermarks to the decode side, and statuses
to the caller's handle. A released room is remembered for a while (`finished`) so late
messages about it get a true answer.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import OrderedDict
from typing import Generic, NamedTuple, NoReturn

from ...hop_trace import TRACE, Hop
from ..poll import KVPoll
from ..protocol.actions import (
    Action,
    AwaitUnit,
    DecodePrefix,
    Dropped,
    PostWrite,
    PublishWatermark,
    ReleaseCredit,
    Released,
    Scatter,
    Send,
    SettleCredits,
    StatusChanged,
)
from ..protocol.kinds import Role, TransferPath
from ..protocol.messages import RoomMeta
from .context import FINISHED_MEMORY, EngineContext
from .handles import RoomStatus
from .interfaces import Later, R, RoomHooks, WriteSink
from .peers import PeerTable

if sys.version_info >= (3, 11):
    from typing import assert_never
else:  # pragma: no cover - Python 3.10 (requires-python), whose typing lacks it
    def assert_never(value: NoReturn) -> NoReturn:
        raise AssertionError(f"unhandled action {value!r}")

log = logging.getLogger("kvstage")

# the states a room enters once its metadata is through: a prefill room has every decode rank's
# metadata (WaitingForInput or Transferring), a decode room sent its own (Transferring)
METADATA_STATES = {"prefill": (KVPoll.WaitingForInput, KVPoll.Transferring), "decode": (KVPoll.Transferring,)}


class FinishedRoom(NamedTuple):
    """How a released room ended, kept for late messages about it (a NamedTuple: read by name,
    or unpacked in this order)."""

    state: KVPoll
    kind: str            # its failure kind, "gone" when it succeeded
    reason: str
    session: int         # the decode room's own session; 0 on a prefill rank


class RoomBook(Generic[R]):
    """The rooms of one role (`R`: PrefillRoom or DecodeRoom). `side` (the role's half, built
    after the book: it uses it) gets the RoomHooks; `writes` (the write queue, built after the
    book too) gets post() and cancel_room()."""

    def __init__(self, ctx: EngineContext, peers: PeerTable, *, side: Later[RoomHooks[R]],
                 writes: Later[WriteSink]):
        self.ctx, self.peers = ctx, peers
        self._side, self._writes = side, writes
        self.rooms: dict[int, R] = {}
        self.status: dict[int, RoomStatus] = {}
        self.finished: OrderedDict[int, FinishedRoom] = OrderedDict()

    def get(self, room_id: int) -> R | None:
        return self.rooms.get(room_id)

    def add(self, room: R, status: RoomStatus) -> None:
        self.rooms[room.room] = room
        self.status[room.room] = status
        self.finished.pop(room.room, None)

    def apply(self, room: R, actions: list[Action]) -> None:
        failed = False
        for a in actions:   # Action is a closed union: every kind has its case (assert_never)
            match a:
                case Send():
                    if type(a.msg) is RoomMeta:
                        self._side().meta_out(room, a)
                    self.peers.send(a.peer, a.msg)
                case PostWrite():
                    self._writes().post(a.op, time.monotonic())
                case AwaitUnit():
                    self._writes().await_unit(a)
                case Scatter():
                    self._side().scatter(a)
                case PublishWatermark():
                    self._side().publish_watermark()
                case ReleaseCredit():
                    self._side().release_credit(a)
                case SettleCredits():
                    self._side().settle_credits(a)
                case StatusChanged():
                    self._status_changed(room, a)
                    failed |= a.state is KVPoll.Failed and not a.released
                case Released():
                    self._released(room)
                case Dropped():
                    self.ctx.stats.count("dropped_messages", a.reason)
                case DecodePrefix():
                    status = self.status.get(room.room)
                    if status is not None:
                        status.decode_prefix_pages = a.pages
                case _:
                    assert_never(a)
        if failed:
            # pieces still waiting for ring space are never started (after the room's own messages)
            self._writes().cancel_room(room.room, time.monotonic())

    def _status_changed(self, room: R, a: StatusChanged) -> None:
        status = self.status.get(room.room)
        if TRACE.on:
            TRACE.hop(Hop.STATUS, room.room, a.state.name + (" (released)" if a.released else ""))
        if status is not None:
            ended = a.state in (KVPoll.Success, KVPoll.Failed)
            if a.state in METADATA_STATES[self.ctx.role]:
                status.timeline.stamp("metadata", time.monotonic())
            status.update(a.state, a.failure, a.failure_kind, a.released, room.totals() if ended else None)
        if a.released:
            return
        stats = self.ctx.stats
        if a.state is KVPoll.Success:
            stats.count("rooms", "success")
            if status is not None:
                self._observe(status)
        elif a.state is KVPoll.Failed:
            stats.count("rooms", "failed")
            stats.count("failures_by_kind", a.failure_kind or "unknown")
            stats.count("rooms_failed_by_kind", a.failure_kind or "unknown")
            log.warning("room %s failed (%s): %s", room.room, a.failure_kind, a.failure)
        self._side().status_changed(room, a)

    def _observe(self, status: RoomStatus) -> None:
        """A request succeeded: its duration from init() and what its writes took, for the
        histograms (transfer/metrics)."""
        end = status.ended()
        totals = end.totals
        if totals is None or totals.path == TransferPath.NONE:
            return
        init = status.timeline.get("init")
        seconds = None if init is None or end.ended_at is None else end.ended_at - init
        if totals.path_reason:   # decode: which path the choice took, and its predicted and actual time
            stats = self.ctx.stats
            stats.count("path_choices", str(totals.path))
            stats.count("path_reasons", totals.path_reason)
            if totals.predicted_s is not None and seconds is not None:
                stats.sum_in("path_predicted_s", str(totals.path), totals.predicted_s)
                stats.sum_in("path_actual_s", str(totals.path), seconds)
        self.ctx.observer.request_done(totals.path, seconds, totals.writes,
                                       status.descriptors if self.ctx.role == Role.PREFILL else None)

    def _released(self, room: R) -> None:
        self.rooms.pop(room.room, None)
        self.status.pop(room.room, None)
        self.finished[room.room] = FinishedRoom(state=room.state, kind=room.failure_kind or "gone",
                                                reason=room.failure or "it succeeded",
                                                session=getattr(room, "session", 0))
        side = self._side()
        side.released(room)
        while len(self.finished) > FINISHED_MEMORY:
            gone, _ = self.finished.popitem(last=False)
            side.forget_finished(gone)

    def fail(self, room_id: int, kind: str, reason: str, now: float) -> None:
        room = self.rooms.get(room_id)
        if room is not None:
            self.apply(room, room.fail(kind, reason, now))
