"""The interfaces the control thread's parts offer each other, declared in one place.

`RoleSide` is the role's half of a rank (prefill_side.py, decode_side.py): the loop, the room
book, the peer table, liveness and the frame router reach it only through the members below.
Every member runs on the control thread, at the moment its docstring says, and must not block:
the thread serves all rooms and peers of the rank. The smaller interfaces are what one part
needs of another that is built after it (a lost peer's listeners, the room book's hooks into
the write queue and the role's side): loop.py builds the parts in dependency order and hands
each of these over in a constructor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    from ..poll import KVPoll
    from ..protocol.actions import (
        Action,
        AwaitUnit,
        ReleaseCredit,
        RoomTotals,
        Scatter,
        Send,
        SettleCredits,
        StatusChanged,
        WriteOp,
    )
    from ..protocol.messages import Heartbeat, Hello, RoomFailed
    from ..protocol.tags import Tag
    from .peers import Peer

# handlers of the role's messages and events, by type: (peer, message, now) and (event, now)
MessageHandler = Callable[["Peer", Any, float], None]
EventHandler = Callable[[Any, float], None]


class Room(Protocol):
    """What the room book reads of a room state machine (protocol/prefill_room.py,
    protocol/decode_room.py); the role's side knows its own room type."""

    @property
    def room(self) -> int: ...

    @property
    def state(self) -> KVPoll: ...

    @property
    def failure(self) -> str | None: ...

    @property
    def failure_kind(self) -> str | None: ...

    def totals(self) -> RoomTotals: ...

    def fail(self, kind: str, reason: str, now: float) -> list[Action]: ...


R = TypeVar("R", bound=Room)
R_contra = TypeVar("R_contra", bound=Room, contravariant=True)


class PeerLossListener(Protocol):
    """Told by `PeerTable.lost` (peers.py) when a connection ended, in the order given to the
    table: the write queue first (its staged pieces for the peer fail), then the role's side."""

    def peer_lost(self, peer: Peer, reason: str, now: float, clean: bool) -> None:
        """On the control thread, once per lost incarnation, after the peer was forgotten
        (backend connection, staging subscription, dealer socket). `clean`: it said goodbye
        with no write of its own in flight."""


class WriteSink(Protocol):
    """What the room book needs of the write queue (write_queue.py)."""

    def post(self, op: WriteOp, now: float) -> None:
        """A room's PostWrite action: a direct write goes to the backend at once, a staged one
        waits for ring space. May complete (fail) the write before it returns."""

    def cancel_room(self, room_id: int, now: float) -> None:
        """The room just failed: its pieces still waiting for ring space never start."""

    def await_unit(self, a: AwaitUnit) -> None:
        """A batching room's AwaitUnit action (write_batching.py): wait for the unit's readiness
        objects off the control thread; a UnitReady event reports back."""


class RoomHooks(Protocol[R_contra]):
    """What the room book (rooms.py) hands to the role's side while it carries out a room's
    actions, on the control thread, in the order the room returned them."""

    def scatter(self, a: Scatter) -> None:
        """Decode, staged: a piece landed whole in the ring; copy it into the cache (queued to
        the scatter thread, whose result comes back as a ScatterDone event)."""

    def publish_watermark(self) -> None:
        """Decode, staged: ring regions were freed; tell every writer of the ring."""

    def release_credit(self, a: ReleaseCredit) -> None:
        """Decode, ring credits: a piece written into a credit is done with (ring_credits.py)."""

    def settle_credits(self, a: SettleCredits) -> None:
        """Prefill, ring credits: give back the credits of a peer that are due (ring_credits.py)."""

    def meta_out(self, room: R_contra, a: Send) -> None:
        """Just before a room's metadata (RoomMeta) goes to a peer (decode: its credits go first)."""

    def status_changed(self, room: R_contra, a: StatusChanged) -> None:
        """After the caller's status took the room's new state (and the counters theirs)."""

    def released(self, room: R_contra) -> None:
        """The room let go of everything and left the book (it is in `finished` now)."""

    def forget_finished(self, room_id: int) -> None:
        """A finished room dropped out of the book's bounded memory of finished rooms."""


class RoleSide(RoomHooks[R_contra], PeerLossListener, Protocol[R_contra]):
    """The role's half of a rank (PrefillSide, DecodeSide): what it handles and when it is
    called. Besides RoomHooks and PeerLossListener:"""

    @property
    def writes_to_peers(self) -> bool:
        """Whether this role writes into its peers' memory (a class constant): a peer whose
        write lease ran out is then lost (liveness.py), since its memory may have been handed
        to someone else."""

    @property
    def handlers(self) -> dict[type, MessageHandler]:
        """The room messages this role handles, by type; the frame router (routing.py) calls
        them with (peer, message, now) once a frame passed its checks."""

    @property
    def events(self) -> dict[type, EventHandler]:
        """The caller's and the helper threads' events this role handles, by type; the loop
        calls them with (event, now) as it drains the event queue."""

    def on_hello(self, msg: Hello, now: float) -> None:
        """A Hello the router let through (from any sender, even one not known yet): a rank
        wants to connect."""

    def on_tag(self, peer: Peer, tag: Tag, now: float) -> None:
        """A notification of a write `peer` made into this rank's memory, decoded, after
        backend.step() returned it."""

    def on_RoomFailed(self, peer: Peer, msg: RoomFailed, now: float) -> None:
        """A RoomFailed, also from a peer whose connection was refused (the router's
        `rejected_failure`): its rooms fail here too."""

    def on_heartbeat(self, peer: Peer, msg: Heartbeat, now: float) -> None:
        """After liveness renewed the peer's lease with the heartbeat."""

    def connect_failed(self, peer: Peer, now: float) -> None:
        """A peer stayed `connecting` past the connect timeout (liveness, at a tick)."""

    def tick_rooms(self, now: float) -> None:
        """At each tick (0.1 s), first of all: every room's deadlines."""

    def tick(self, now: float) -> None:
        """At each tick, after the rooms and the write queue: the side's own deadlines."""

    def closing(self, room: R_contra, now: float) -> list[Action]:
        """The manager closes: what the room must do (its actions are carried out at once)."""

    def room_state(self) -> dict[str, int]:
        """How much per-room state the side holds (stats()["room_state"]); zero once every
        room ended and was released."""

    def credit_bytes(self) -> int:
        """Decode: ring bytes its connected prefill ranks hold as ring credits; prefill: 0."""
        ...

    def quarantined_bytes(self) -> int:
        """Memory held back from reuse because a write may still touch it, for stats() (which
        asks the control thread for it with a Call event)."""

    def stuck_rooms(self) -> list[int]:
        """After an internal error not tied to one room: the rooms it may have left stuck
        (they fail with kind "internal")."""


T = TypeVar("T")
# A part built after the one given this, because each calls the other (the room book and the write
# queue, the book and the role's side, the peer table and its listeners): a function returning it,
# called only once construction is over, never from a constructor.
Later = Callable[[], T]
