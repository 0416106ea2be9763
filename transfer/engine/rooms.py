"""The rooms (requests) of this rank and the carrying out of their state machines' actions.

Every room state machine returns actions of its role's union (protocol/actions.py:
`PrefillAction`, `DecodeAction`); each role's book's `apply` is where they happen, one `match`
exhaustive over that union (mypy checks it with assert_never): the shared actions (messages to
peers, statuses to the caller's handle) go to `RoomBook._shared`, the same for both roles; writes
go to the write queue (`PrefillBook`), scatters, watermarks and credits to the decode side
(`DecodeBook`). A released room is remembered for a while (`finished`) so late messages about it
get a true answer.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import ClassVar, Generic, NamedTuple, NoReturn, TypeVar

from ...hop_trace import TRACE, Hop
from ..poll import KVPoll
from ..protocol.actions import (
    AwaitUnit,
    DecodeAction,
    DecodePrefix,
    Dropped,
    PostWrite,
    PrefillAction,
    PrepareScatter,
    PublishWatermark,
    ReleaseCredit,
    Released,
    Scatter,
    Send,
    SettleCredits,
    SharedAction,
    StatusChanged,
)
from ..protocol.decode.room import DecodeRoom
from ..protocol.kinds import TransferPath
from ..protocol.messages import RoomMeta
from ..protocol.prefill.room import PrefillRoom
from .context import FINISHED_MEMORY
from .handles import RoomStatus
from .interfaces import (
    Counters,
    DecodeRoomHooks,
    Later,
    Observer,
    Outbox,
    PrefillRoomHooks,
    R,
    RoomHooks,
    WriteSink,
)

if sys.version_info >= (3, 11):
    from typing import assert_never
else:  # pragma: no cover - Python 3.10 (requires-python), whose typing lacks it
    def assert_never(value: NoReturn) -> NoReturn:
        raise AssertionError(f"unhandled action {value!r}")

log = logging.getLogger("kvstage")


class FinishedRoom(NamedTuple):
    """How a released room ended, kept for late messages about it (a NamedTuple: read by name,
    or unpacked in this order)."""

    state: KVPoll
    kind: str            # its failure kind, "gone" when it succeeded
    reason: str
    session: int         # the decode room's own session; 0 on a prefill rank
    ended_at: float      # when it reached Success or Failed (the control thread's clock)


A = TypeVar("A", PrefillAction, DecodeAction)


class RoomBook(Generic[R, A]):
    """The rooms of one role (`R`: PrefillRoom or DecodeRoom, whose actions are `A`:
    PrefillAction or DecodeAction) and what both roles do with the shared actions; PrefillBook and
    DecodeBook carry out their own union, each in one exhaustive `match` (`apply`).
    `outbox` sends the rooms' messages, `stats` and `observer` take the counters and histograms
    of a request's end, `hooks` (the role's side, built after the book: it uses it) is told a
    room was released."""

    # the states a room enters once its metadata is through (the request's "metadata" stamp)
    METADATA_STATES: ClassVar[tuple[KVPoll, ...]] = ()
    # whether a request's descriptors are reported to the observer (the writer's count)
    REPORTS_DESCRIPTORS: ClassVar[bool] = False

    def __init__(self, *, outbox: Outbox, stats: Counters, observer: Observer, hooks: Later[RoomHooks[R]]):
        self.outbox, self.stats, self.observer = outbox, stats, observer
        self._hooks = hooks
        self.rooms: dict[int, R] = {}
        self.status: dict[int, RoomStatus] = {}
        self.finished: OrderedDict[int, FinishedRoom] = OrderedDict()

    def get(self, room_id: int) -> R | None:
        return self.rooms.get(room_id)

    def add(self, room: R, status: RoomStatus) -> None:
        self.rooms[room.room] = room
        self.status[room.room] = status
        self.finished.pop(room.room, None)

    def apply(self, room: R, actions: Sequence[A]) -> None:
        """Carry out a room's actions, in order (the role's book: one `match` over its union)."""
        raise NotImplementedError

    def _shared(self, room: R, a: SharedAction) -> bool:
        """Carry out an action both roles' rooms return; True when the room just failed (the
        book tells `_failed` once the room's other actions went out)."""
        match a:
            case Send():
                self._send(room, a)
            case StatusChanged():
                self._status_changed(room, a)
                return a.state is KVPoll.Failed and not a.released
            case Released():
                self._released(room)
            case Dropped():
                self.stats.count("dropped_messages", a.reason)
            case _:
                assert_never(a)
        return False

    def _send(self, room: R, a: Send) -> None:
        self.outbox.send(a.peer, a.msg)

    def _failed(self, room_id: int) -> None:
        """The room just failed (after its own messages went out)."""

    def _after_status(self, room: R, a: StatusChanged) -> None:
        """After the caller's status and the counters took the room's new state."""

    def _forget(self, room_id: int) -> None:
        """A finished room dropped out of the bounded memory of finished rooms."""

    def _status_changed(self, room: R, a: StatusChanged) -> None:
        status = self.status.get(room.room)
        if TRACE.on:
            TRACE.hop(Hop.STATUS, room.room, a.state.name + (" (released)" if a.released else ""))
        if status is not None:
            ended = a.state in (KVPoll.Success, KVPoll.Failed)
            if a.state in self.METADATA_STATES:
                status.timeline.stamp("metadata", time.monotonic())
            status.update(a.state, a.failure, a.failure_kind, a.released, room.totals() if ended else None)
        if a.released:
            return
        stats = self.stats
        if a.state is KVPoll.Success:
            stats.count("rooms", "success")
            if status is not None:
                self._observe(status)
        elif a.state is KVPoll.Failed:
            stats.count("rooms", "failed")
            stats.count("failures_by_kind", a.failure_kind or "unknown")
            stats.count("rooms_failed_by_kind", a.failure_kind or "unknown")
            log.warning("room %s failed (%s): %s", room.room, a.failure_kind, a.failure)
        self._after_status(room, a)

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
            stats = self.stats
            stats.count("path_choices", str(totals.path))
            stats.count("path_reasons", totals.path_reason)
            if totals.predicted_s is not None and seconds is not None:
                stats.sum_in("path_predicted_s", str(totals.path), totals.predicted_s)
                stats.sum_in("path_actual_s", str(totals.path), seconds)
        self.observer.request_done(totals.path, seconds, totals.writes,
                                   status.descriptors if self.REPORTS_DESCRIPTORS else None)

    def _released(self, room: R) -> None:
        assert room.ended_at is not None, "a room is released only once it ended"
        self.rooms.pop(room.room, None)
        self.status.pop(room.room, None)
        self.finished[room.room] = FinishedRoom(state=room.state, kind=room.failure_kind or "gone",
                                                reason=room.failure or "it succeeded",
                                                session=getattr(room, "session", 0),
                                                ended_at=room.ended_at)
        self._hooks().released(room)
        while len(self.finished) > FINISHED_MEMORY:
            gone, _ = self.finished.popitem(last=False)
            self._forget(gone)

    def fail(self, room_id: int, kind: str, reason: str, now: float) -> None:
        room = self.rooms.get(room_id)
        if room is not None:
            self.apply(room, room.fail(kind, reason, now))


class PrefillBook(RoomBook[PrefillRoom, PrefillAction]):
    """The prefill rooms: their writes go to `writes` (the write queue, built after the book),
    their credits' settling and the end of their memory to the prefill side."""

    METADATA_STATES = (KVPoll.WaitingForInput, KVPoll.Transferring)   # every decode rank's metadata is in
    REPORTS_DESCRIPTORS = True

    def __init__(self, *, outbox: Outbox, stats: Counters, observer: Observer, hooks: Later[PrefillRoomHooks],
                 writes: Later[WriteSink]):
        super().__init__(outbox=outbox, stats=stats, observer=observer, hooks=hooks)
        self._prefill_hooks, self._writes = hooks, writes

    def apply(self, room: PrefillRoom, actions: Sequence[PrefillAction]) -> None:
        failed = False
        for a in actions:
            match a:
                case Send() | StatusChanged() | Released() | Dropped():
                    failed |= self._shared(room, a)
                case PostWrite():
                    self._writes().post(a.op, time.monotonic())
                case AwaitUnit():
                    self._writes().await_unit(a)
                case SettleCredits():
                    self._prefill_hooks().settle_credits(a)
                case DecodePrefix():
                    status = self.status.get(room.room)
                    if status is not None:
                        status.decode_prefix_pages = a.pages
                case _:
                    assert_never(a)
        if failed:
            self._failed(room.room)

    def _failed(self, room_id: int) -> None:
        # pieces still waiting for ring space are never started
        self._writes().cancel_room(room_id, time.monotonic())

    def _forget(self, room_id: int) -> None:
        self._prefill_hooks().forget_finished(room_id)


class DecodeBook(RoomBook[DecodeRoom, DecodeAction]):
    """The decode rooms: their scatters, watermarks, credits, outgoing metadata and new states go
    to the decode side (built after the book). A decode room posts no write."""

    METADATA_STATES = (KVPoll.Transferring,)   # its own metadata went out

    def __init__(self, *, outbox: Outbox, stats: Counters, observer: Observer, hooks: Later[DecodeRoomHooks]):
        super().__init__(outbox=outbox, stats=stats, observer=observer, hooks=hooks)
        self._decode_hooks = hooks

    def _send(self, room: DecodeRoom, a: Send) -> None:
        if type(a.msg) is RoomMeta:
            self._decode_hooks().meta_out(room, a)
        self.outbox.send(a.peer, a.msg)

    def apply(self, room: DecodeRoom, actions: Sequence[DecodeAction]) -> None:
        failed = False
        for a in actions:
            match a:
                case Send() | StatusChanged() | Released() | Dropped():
                    failed |= self._shared(room, a)
                case Scatter():
                    self._decode_hooks().scatter(a)
                case PrepareScatter():
                    self._decode_hooks().prepare_scatter(a)
                case PublishWatermark():
                    self._decode_hooks().publish_watermark()
                case ReleaseCredit():
                    self._decode_hooks().release_credit(a)
                case _:
                    assert_never(a)
        if failed:
            self._failed(room.room)

    def _after_status(self, room: DecodeRoom, a: StatusChanged) -> None:
        self._decode_hooks().status_changed(room, a)
