"""The interfaces the control thread's parts offer each other, declared in one place.

Every part of the engine (transfer/engine/) receives, in its constructor, only the few things it
uses, each as one of the small Protocols below, and never the whole EngineContext (context.py:
the bag only the loop, loop.py, builds and takes apart). Three kinds:

- The role's half of a rank (prefill_side.py, decode_side.py). `RoleSide` is only what both
  roles do, for the loop; each role's own hooks are separate (`PrefillRoomHooks`,
  `DecodeRoomHooks` for the room book; `HelloSink` and `HeartbeatSink` prefill only, `TagSink`
  decode only), so neither role implements, or raises in, the other's.
- The hooks parts built before another part call back into (a lost peer's listeners, the room
  book's write sink): loop.py builds the parts in dependency order and hands each of these over
  in a constructor, as a `Later` where the two call each other.
- The rank's shared pieces as each part uses them: `Counters` and `PieceCounters` (stats),
  `Outbox` and `PeerOutbox` (send a control message to a peer), `Sockets` (the control socket by
  endpoint), `WritePort`, `PeerLinks`, `PrefillBackend` and `ExpectedTags` (the backend),
  `WriteSeals` and `LandedChecks` (integrity), `Observer` (metrics), `Post` (the event queue),
  and the staging handler's `RingOwner`, `Watermarks`, `PrefillStaging`, `DecodeStaging`,
  `StagedRegions`, `Unsubscribe`. Plain values of the configuration go as values (`me`, the
  `Timeouts`, prefill_side.PrefillRank, decode_planning.PlanFacts).

Every member runs on the control thread unless its docstring says otherwise, and must not block:
the thread serves all rooms and peers of the rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from ..protocol.decode.room import DecodeRoom
from ..protocol.prefill.room import PrefillRoom

if TYPE_CHECKING:
    import numpy as np
    import torch

    from ...staging.workers import PartDigest
    from ..backends.base import Backend
    from ..poll import KVPoll
    from ..protocol.actions import (
        AwaitUnit,
        PeerKey,
        PrepareScatter,
        ReleaseCredit,
        RoomTotals,
        Scatter,
        Send,
        SettleCredits,
        StatusChanged,
        WriteOp,
    )
    from ..protocol.messages import EngineBeat, Heartbeat, Hello, PeerMessage, RoomFailed
    from ..protocol.ring import RingAllocator, Watermark
    from ..protocol.tags import Tag
    from .peers import Peer
    from .stats import Group, Number

# handlers of the role's messages and events, by type: (peer, message, now) and (event, now)
MessageHandler = Callable[["Peer", Any, float], None]
EventHandler = Callable[[Any, float], None]


A_co = TypeVar("A_co", covariant=True)


class Room(Protocol[A_co]):
    """What the room book reads of a room state machine (protocol/prefill/room.py,
    protocol/decode/room.py), whose actions are `A_co` (its role's union, protocol/actions.py);
    the role's side knows its own room type."""

    @property
    def room(self) -> int: ...

    @property
    def state(self) -> KVPoll: ...

    @property
    def failure(self) -> str | None: ...

    @property
    def failure_kind(self) -> str | None: ...

    @property
    def ended_at(self) -> float | None:
        """When the room reached Success or Failed (None before)."""

    def totals(self) -> RoomTotals: ...

    def fail(self, kind: str, reason: str, now: float) -> Sequence[A_co]: ...


T = TypeVar("T")
R = TypeVar("R", bound="Room[Any]")
R_contra = TypeVar("R_contra", bound="Room[Any]", contravariant=True)


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
    """What both roles' sides do while the room book (rooms.py) carries out a room's actions: on
    the control thread, in the order the room returned them. Each role adds its own hooks
    (PrefillRoomHooks, DecodeRoomHooks); neither implements the other's."""

    def released(self, room: R_contra) -> None:
        """The room let go of everything and left the book (it is in `finished` now)."""


class PrefillRoomHooks(RoomHooks[PrefillRoom], Protocol):
    """What the prefill room book (rooms.PrefillBook) hands to the prefill side (PrefillSide),
    on the control thread, besides `released`."""

    def settle_credits(self, a: SettleCredits) -> None:
        """Ring credits: give back the credits of a decode peer that are due (ring_credits.py)."""

    def forget_finished(self, room_id: int) -> None:
        """A finished room dropped out of the book's bounded memory of finished rooms: what the
        side kept about its uses goes too."""


class DecodeRoomHooks(RoomHooks[DecodeRoom], Protocol):
    """What the decode room book (rooms.DecodeBook) hands to the decode side (DecodeSide), on
    the control thread, besides `released`."""

    def scatter(self, a: Scatter) -> None:
        """Staged: a piece landed whole in the ring; copy it into the cache (inline, or queued to
        the scatter thread; its result comes back as a ScatterDone event)."""

    def prepare_scatter(self, a: PrepareScatter) -> None:
        """Staged: a room's destination pages are known; the scatter may make them ready now
        (validated, indexed, uploaded), off the request's path. Never waited for."""

    def publish_watermark(self) -> None:
        """Staged: ring regions were freed; tell every writer of the ring."""

    def release_credit(self, a: ReleaseCredit) -> None:
        """Ring credits: a piece written into a credit is done with (ring_credits.py)."""

    def meta_out(self, room: DecodeRoom, a: Send) -> None:
        """Just before the room's metadata (RoomMeta) goes to a prefill rank: its credits go first."""

    def status_changed(self, room: DecodeRoom, a: StatusChanged) -> None:
        """After the caller's status took the room's new state (and the counters theirs)."""


class PrefillWrites(Protocol):
    """What the prefill side needs of the write queue (write_queue.py), on the control thread."""

    def dispatch(self, peer_inc: int, now: float) -> None:
        """A decode peer's ring watermark moved: its staged pieces whose region is free may go."""

    def forget_room(self, room_id: int) -> None:
        """A released room: nothing of it is kept (its direct rows, its pieces' page lists)."""


class FailureSink(Protocol):
    """Where the frame router (routing.py) hands a RoomFailed from a peer whose connection was
    refused (its `rejected_failure` route): both roles' sides, on the control thread."""

    def on_RoomFailed(self, peer: Peer, msg: RoomFailed, now: float) -> None:
        """Its rooms with that peer fail here too."""


class HelloSink(Protocol):
    """Where the frame router hands a Hello it let through, from any sender, even one not known
    yet: only a prefill rank is connected to (PrefillSide); on the control thread."""

    def on_hello(self, msg: Hello, now: float) -> None:
        """A decode rank wants to connect."""


class TagSink(Protocol):
    """Where the frame router hands the notification of a write a peer made into this rank's
    memory, decoded, after backend.step() returned it: only decode ranks are written to
    (DecodeSide); on the control thread."""

    def on_tag(self, peer: Peer, tag: Tag, now: float) -> None:
        """The write of `peer` described by `tag` landed."""


class HeartbeatSink(Protocol):
    """What liveness (liveness.py) tells the prefill side after a decode rank's heartbeat renewed
    its lease: the write fence moves on, and the heartbeat may carry the decode ring's
    watermark. On the control thread."""

    def on_heartbeat(self, peer: Peer, msg: Heartbeat, now: float) -> None:
        """After liveness renewed the peer's lease with the heartbeat."""


class WriteFences(Protocol):
    """Where a prefill rank's write fences are kept (backend_owner.BackendOwner.fence): writes to
    a peer are not driven past its fence. Engine-pair leases move them (engine_liveness.py)."""

    def fence(self, peer: str, until: float | None) -> None:
        """Writes to `peer` (its backend name) are not driven after `until` (time.monotonic)."""


class SiblingBeats(Protocol):
    """Where a beat from a rank of this rank's own engine goes (engine_liveness.py): such a rank
    is no peer of the peer table, so the frame router hands it over before routing. Control
    thread."""

    def on_sibling_beat(self, msg: EngineBeat, now: float) -> None:
        """A beat whose `sibling` flag is set."""


class LivenessPart(Protocol):
    """The part that keeps the peers' leases (liveness.Liveness, rank-pair leases;
    engine_liveness.EngineLiveness, engine-pair leases), for the loop: its message handlers and
    events, and its tick. Control thread."""

    @property
    def handlers(self) -> dict[type, MessageHandler]:
        """The peer messages it handles, by type."""

    @property
    def events(self) -> dict[type, EventHandler]:
        """The control-thread events it handles, by type."""

    def tick(self, now: float, looked: float | None = None) -> None:
        """Judge the leases (silence up to `looked`) and send the heartbeats due."""


class LeaseHooks(Protocol):
    """What liveness needs of the role's side (both roles), on the control thread at a tick."""

    @property
    def writes_to_peers(self) -> bool:
        """Whether this role writes into its peers' memory (a class constant): a peer whose
        write lease ran out is then lost, since its memory may have been handed to someone else."""

    def connect_failed(self, peer: Peer, now: float) -> None:
        """A peer stayed `connecting` past the connect timeout."""


class RoleSide(RoomHooks[R_contra], PeerLossListener, LeaseHooks, FailureSink, Protocol[R_contra, A_co]):
    """The role's half of a rank (PrefillSide, DecodeSide): only what both roles do, for the
    loop (loop.py). Besides RoomHooks, PeerLossListener, LeaseHooks and FailureSink:"""

    @property
    def handlers(self) -> dict[type, MessageHandler]:
        """The room messages this role handles, by type; the frame router (routing.py) calls
        them with (peer, message, now) once a frame passed its checks."""

    @property
    def events(self) -> dict[type, EventHandler]:
        """The caller's and the helper threads' events this role handles, by type; the loop
        calls them with (event, now) as it drains the event queue."""

    def tick_rooms(self, now: float) -> None:
        """At each tick (0.1 s), first of all: every room's deadlines."""

    def tick(self, now: float) -> None:
        """At each tick, after the rooms and the write queue: the side's own deadlines."""

    def closing(self, room: R_contra, now: float) -> Sequence[A_co]:
        """The manager closes: what the room must do (its actions, of the role's union, are
        carried out at once)."""

    def room_state(self) -> dict[str, int]:
        """How much per-room state the side holds (stats()["room_state"]); zero once every
        room ended and was released."""

    def quarantined_bytes(self) -> int:
        """Memory held back from reuse because a write may still touch it, for stats() (which
        asks the control thread for it with a Call event)."""

    def stuck_rooms(self) -> list[int]:
        """After an internal error not tied to one room: the rooms it may have left stuck
        (they fail with kind "internal")."""


# -- what the parts use of the rank's shared pieces --------------------------------------------------
class Counters(Protocol):
    """The rank's counters (stats.Stats, read by KVManager.stats()): every part counts what it
    decides through these. Any thread may call them (Stats takes a lock); the keys are typed
    (stats.Number, stats.Group), so a misspelt key is a type error."""

    def add(self, key: Number, value: float = 1) -> None:
        """Add `value` to the figure `key` (bytes sent, writes announced...)."""

    def maximum(self, key: Number, value: float) -> None:
        """Raise the figure `key` to `value` if it is larger (a high-water mark)."""

    def set(self, key: Number, value: float) -> None:
        """Set the figure `key` (a level, such as the ring's live bytes)."""

    def count(self, group: Group, kind: str, value: int = 1) -> None:
        """Bump the counter `kind` of `group` (a drop by its reason, a failure by its kind)."""

    def sum_in(self, group: Group, kind: str, value: float) -> None:
        """Add seconds (or any float) to the sum `kind` of `group`."""


class PieceCounters(Counters, Protocol):
    """The write queue's counters: besides Counters, one staged write of a piece (the
    histogram of writes per piece)."""

    def staged_write(self, key: tuple[int, int, int, int]) -> None:
        """One staged write of the piece (peer incarnation, room, chunk, piece)."""


class Observer(Protocol):
    """Where the control thread reports each backend write (the write queue) and each request
    (the room book) as they end; the metrics exporter (transfer/metrics) puts its histograms
    here, context.NoObserver does nothing. Called on the control thread."""

    def write_done(self, path: str, seconds: float) -> None:
        """A write of `path` ("direct", "staged") completed `seconds` after the backend took it."""

    def request_done(self, path: str, seconds: float | None, writes: int, descriptors: int | None) -> None:
        """A request succeeded: its path, its time from init() (None: not known), its writes and,
        on the writing rank, their descriptors (None on a decode rank)."""


class Outbox(Protocol):
    """How a part sends a control message to a known peer, by its key (peers.PeerTable.send):
    dropped and counted when the peer is lost or its send queue is full, never blocking. Called
    on the control thread only (the table owns the dealer sockets)."""

    def send(self, key: PeerKey, msg: PeerMessage) -> None:
        """Queue `msg` to the peer `key` names (its incarnation): sent in order with the
        earlier messages to it, or dropped (and counted) if that incarnation is gone."""


class PeerOutbox(Outbox, Protocol):
    """An Outbox that also looks a peer up by incarnation (peers.PeerTable): the write queue
    and the ring credits. Control thread only."""

    def get(self, incarnation: int) -> Peer | None:
        """The peer of that incarnation, None when it is not (or no longer) known."""


class Sockets(Protocol):
    """The control socket by endpoint (control_socket.ControlSocket), for a peer not (or no
    longer) in the peer table: its Goodbye, a HelloAck, a first Hello. `send` says whether the
    frame was queued; `forget` drops the dealer socket of an endpoint. Control thread only."""

    def send(self, endpoint: str, msg: PeerMessage) -> bool:
        """Queue `msg` to the rank at `endpoint`; False when its send queue is full (dropped)."""

    def forget(self, endpoint: str) -> None:
        """Close the dealer socket of `endpoint` (its peer was lost)."""


class PeerLinks(Protocol):
    """The backend connections of a prefill rank (backend_owner.BackendOwner), which writes into
    its peers: the peer table drops a lost peer's connection here (its pending writes fail).
    Control thread (the backend's owner)."""

    def disconnect(self, peer: str) -> None:
        """Drop the backend connection to `peer` (its backend name): its pending writes fail."""


class WritePort(Protocol):
    """Where the write queue posts a backend write (backend_owner.BackendOwner.submit_write):
    `on_done(ok, reason)` runs exactly once on the control thread when the backend no longer
    touches the source; `on_posted()` just before the backend takes it. Any thread may post;
    the control thread's posts go out one at a time from its step()."""

    def submit_write(self, peer: str, src: np.ndarray, dst: np.ndarray, tag: bytes,
                     on_done: Callable[[bool, str | None], None],
                     on_posted: Callable[[], object] | None = None, *, dst_kind: str | None = None,
                     room: int | None = None) -> None:
        """Post one write of the descriptor rows `src` to `dst` at `peer` (its backend name),
        notified there with `tag`; `dst_kind` is the peer memory's kind, `room` names the
        request in the hop trace."""


class PrefillBackend(Protocol):
    """What the prefill side needs of the backend (backend_owner.BackendOwner) as decode ranks
    connect and heartbeat: a call run on the backend's owner (connect, the memory kinds it
    writes), the write fence of a peer, and the source bytes of writes given up on that the
    backend may still read (stats()' quarantined bytes). Control thread."""

    def call(self, fn: Callable[[Backend], T]) -> T:
        """Run `fn(backend)` on the backend's owner and return its result (or raise)."""

    def fence(self, peer: str, until: float | None) -> None:
        """Writes to `peer` are not driven after `until` (time.monotonic; None: no fence)."""

    def draining_bytes(self) -> int:
        """Source bytes of the writes given up on that the backend may still read."""


class ExpectedTags(Protocol):
    """How many announced writes towards this decode rank have no tag in yet: the backend
    (backend_owner.BackendOwner) polls while there are any (protocol/quiet.py). Set by the
    decode side on the control thread, the backend's owner."""

    expecting: int


class RingOwner(Protocol):
    """The staging ring of a decode rank, as the staging handler (staging/handler.py) holds it:
    its allocator, None without a ring (or once closed). Read on the control thread."""

    @property
    def allocator(self) -> RingAllocator | None:
        """The ring's allocator (its watermark, free space), None without a ring."""


class Unsubscribe(Protocol):
    """The staging handler's subscription to a decode peer's ring watermark (prefill side):
    dropped when the peer is lost. Control thread."""

    def unsubscribe(self, peer: int) -> None:
        """Forget the ring watermark of the decode peer of that incarnation."""


class Watermarks(Protocol):
    """What a prefill rank's ring credits need of its staging handler: a decode peer's published
    watermark (whether it moved: staged pieces may then go), and the size of one staging buffer.
    Control thread."""

    def on_watermark(self, peer: int, epoch: int, wm: Watermark) -> bool:
        """A watermark the decode peer of that incarnation published for its ring `epoch`:
        whether it advanced (staged pieces waiting for its ring may go)."""

    @property
    def buffer_bytes(self) -> int:
        """The size of the smallest staging buffer here (0: none)."""


class PrefillStaging(Watermarks, Protocol):
    """What the prefill side needs of its staging handler (staging/handler.py) as a decode rank
    connects: its staging buffers (none: staging off here), and a subscription to the decode
    ring's watermark. Control thread."""

    @property
    def buffers(self) -> Sequence[object]:
        """The staging buffers of this rank (empty: it does not stage)."""

    def subscribe(self, peer: int, epoch: int, ring_size: int) -> None:
        """Follow the watermark of the ring (`epoch`, `ring_size`) of the decode peer of that
        incarnation."""


class DecodeStaging(RingOwner, Protocol):
    """What the decode side needs of its staging handler: the ring's allocator and a view of a
    ring region (what a scatter copies from). Control thread."""

    def ring_view(self, offset: int, nbytes: int) -> torch.Tensor:
        """The ring's bytes [offset, offset + nbytes) as a tensor (no copy)."""


class LandedChecks(Protocol):
    """The integrity checks of the writes this decode rank receives (integrity.Integrity): a
    landed write's digest (the reason it is corrupt, else None), a scatter's part digests.
    Control thread."""

    def on_landed(self, room: DecodeRoom, tag: Tag) -> str | None:
        """A write of `room` described by `tag` landed whole: why it is corrupt, else None."""

    def scatter_checks(self, s: Scatter) -> tuple[PartDigest, ...]:
        """The digests a scatter checks its ring parts against before it copies them."""


class StagedRegions(Protocol):
    """Whether a decode peer's ring region is free for a staged piece, by the watermark the
    staging handler last heard (the write queue). Control thread."""

    def region_free(self, peer: int, start: int, nbytes: int) -> bool:
        """Whether [start, start + nbytes) of that decode peer's ring is free to write."""


class WriteSeals(Protocol):
    """The integrity checks of the writes this rank sends (integrity.Integrity): the tags of a
    direct write (a digest each with verify on), and a staged piece's sealer. Control thread."""

    def direct_tags(self, op: WriteOp, groups: int = 1) -> list[bytes]:
        """The encoded tags of a direct write posted as `groups` backend writes, one each."""

    def sealer(self, tag: Tag) -> Callable[[int], bytes] | None:
        """What seals a staged piece's tag once gathered (its digest), None with verify off."""


# hand an event to the control thread's queue (loop.EngineLoop.post); any thread may call it
Post = Callable[[object], None]


# A part built after the one given this, because each calls the other (the room book and the write
# queue, the book and the role's side, the peer table and its listeners): a function returning it,
# called only once construction is over, never from a constructor.
Later = Callable[[], T]
