"""What a prefill room keeps per chunk and per decode rank, and which pages it sends.

The decode side may already hold the first pages of a request (its prefix cache): the chunks
the caller gives are the whole request's, and only their pages past the prefix are sent,
numbered as the decode side numbers its destination pages (from the prefix on).

A flow's phase is its `state` (FlowState), which moves only along FLOW_TRANSITIONS, through
`Flow.move`; a move the table lacks is a bug in the room and raises IllegalTransition (as a
room's status does, lifecycle.py). Two things move it independently: this rank's writing
(metadata checked, then every write completed) and the decode rank's RoomDone, which may come
first (the decode side sees the bytes land before this rank reads its completions). The
counters next to it (chunks issued, grants, writes in flight, bytes) are data; which phase the
flow is in is asked of the state alone.

Memory: a prefill rank holds one flow per decode rank of each room in flight (thousands). A
flow so keeps nothing it does not use: its per-chunk maps are the shared empty `NO_ENTRIES` until
the first entry (then a dict of its own, written only through the flow's methods), the
chunks that need no more ring space are bits of one int, its writes in flight a count, and
its landed tags a list only once the first one came.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, TypeVar

import numpy as np

from ..actions import PeerKey
from ..head_mapping import Assignment
from ..kinds import StrKind
from ..lifecycle import IllegalTransition
from ..messages import RoomMeta

__all__ = ["CONFIRMED_STATES", "FLOW_TRANSITIONS", "NO_ENTRIES", "UNCHECKED_STATES", "Chunk", "Flow", "FlowEvent",
           "FlowState", "own_dict", "past_prefix"]

# read-only and empty: every flow's (and a prefill room's) map until it holds something; one
# object in the process (memory measurements leave it out, sim/report.py)
NO_ENTRIES: Mapping[Any, Any] = MappingProxyType({})
_K = TypeVar("_K")
_V = TypeVar("_V")


def _no_entries() -> Mapping[Any, Any]:
    """NO_ENTRIES itself, not a copy (as a field's default_factory: a dataclass refuses an
    unhashable default such as a read-only map)."""
    return NO_ENTRIES


def own_dict(m: Mapping[_K, _V]) -> dict[_K, _V]:
    """`m` when it is a dict of its holder's own, else (the shared `NO_ENTRIES`) a new dict with its
    items: what a holder writes into, never the shared map."""
    return m if isinstance(m, dict) else dict(m)


class FlowState(StrKind):
    """Where one flow (this prefill rank -> one decode rank, one room) is."""

    WAITING_META = "waiting_meta"                # metadata held until init() gives the page count to check it against
    WRITING = "writing"                          # metadata checked; chunks to issue or writes to complete (a
                                                 # notice-only flow writes nothing and stays here)
    DONE_SENT = "done_sent"                      # every write completed, WriterDone sent; awaiting RoomDone
    CONFIRMED = "confirmed"                      # every write completed and RoomDone in: the flow is finished
    CONFIRMED_WRITING = "confirmed_writing"      # RoomDone in while writes' completions are still to come
    CONFIRMED_UNCHECKED = "confirmed_unchecked"  # RoomDone in before the metadata was checked (no correct decode
                                                 # rank sends it then; the flow goes on as a confirmed one)
    FAILED = "failed"                            # the room failed: nothing more is written


class FlowEvent(StrKind):
    """What moves a flow's state."""

    CHECKED = "checked"      # the decode rank's metadata agrees with this rank's page count, prefix and pools
    WRITTEN = "written"      # the last chunk issued and every write of the flow completed (WriterDone due)
    CONFIRM = "confirm"      # RoomDone from the decode rank (a repeated one changes nothing)
    FAIL = "fail"            # the room failed


_S, _E = FlowState, FlowEvent

FLOW_TRANSITIONS: Mapping[tuple[FlowState, FlowEvent], FlowState] = {
    (_S.WAITING_META, _E.CHECKED): _S.WRITING,
    (_S.WRITING, _E.WRITTEN): _S.DONE_SENT,
    (_S.DONE_SENT, _E.CONFIRM): _S.CONFIRMED,
    (_S.WAITING_META, _E.CONFIRM): _S.CONFIRMED_UNCHECKED,
    (_S.CONFIRMED_UNCHECKED, _E.CHECKED): _S.CONFIRMED_WRITING,
    (_S.WRITING, _E.CONFIRM): _S.CONFIRMED_WRITING,
    (_S.CONFIRMED_WRITING, _E.WRITTEN): _S.CONFIRMED,       # no WriterDone: the decode rank confirmed already
    (_S.CONFIRMED_UNCHECKED, _E.CONFIRM): _S.CONFIRMED_UNCHECKED,   # repeated RoomDone: no change
    (_S.CONFIRMED_WRITING, _E.CONFIRM): _S.CONFIRMED_WRITING,
    (_S.CONFIRMED, _E.CONFIRM): _S.CONFIRMED,
    **{(s, _E.FAIL): _S.FAILED for s in FlowState if s is not _S.FAILED},
}

CONFIRMED_STATES = frozenset({_S.CONFIRMED_UNCHECKED, _S.CONFIRMED_WRITING, _S.CONFIRMED})   # RoomDone came
UNCHECKED_STATES = frozenset({_S.WAITING_META, _S.CONFIRMED_UNCHECKED})                     # metadata held


@dataclass(frozen=True, kw_only=True, slots=True)
class Chunk:
    """One write unit: request positions from `page_start` (its `pages` there) x `layers`, and
    what to wait on before its layers are read (layer_sends.py)."""

    index: int
    page_start: int
    pages: np.ndarray
    layers: range
    ready: tuple[object, ...] = ()


@dataclass(kw_only=True, slots=True)
class Flow:
    """This prefill rank -> one decode rank, for this room. `state` changes only through
    `move` (FLOW_TRANSITIONS).

    Invariants: `requested_at`, `asked_again` and `remainders` are `NO_ENTRIES` or dicts of this
    flow's own, written only through `note_asked`, `note_asked_again` and `note_remainder`;
    bit i of `granted_bits` is set once sendable chunk i needs no more ring space (`grant`);
    `writes_in_flight` is the number of the room's write ops towards this flow's decode rank
    (posted and not completed); `pool_dst` is None until the metadata is checked, then the
    decode rank's items (`NO_ENTRIES` when it names none)."""

    peer: PeerKey
    session: int
    assignment: Assignment | None       # None: a notice only, nothing to write
    staged: bool
    dst_pages: np.ndarray | None = None
    meta: RoomMeta | None = None        # kept until init() gives the page count to check it against
    pool_dst: Mapping[str, np.ndarray] | None = None     # the decode rank's state pool items of this request
    issued: int = 0                     # chunks issued (direct) or requested (staged)
    requested_at: Mapping[int, float] = field(default_factory=_no_entries)   # staged: chunk -> when first asked
    asked_again: Mapping[int, float] = field(default_factory=_no_entries)    # staged: chunk -> when last asked
    done_again_at: float | None = None  # WriterDone last re-sent
    granted_bits: int = 0               # staged: bit i set once sendable chunk i needs no more ring space
                                        # (granted, written into credits whole, or none of its layers there)
    remainders: Mapping[int, int] = field(default_factory=_no_entries)   # staged: chunk -> its first pages,
                                        # written into credits; the grant path is asked for the rest
    writes_in_flight: int = 0           # writes posted towards the decode rank and not completed
    writes: int = 0
    nbytes: int = 0
    landed_tags: Sequence[bytes] = ()   # the signed tags of the writes completed (a list once one came)
    active_at: float = 0.0                                        # when a write of it was last posted or completed
    tags_again_at: float = 0.0                                    # TagsAgain last sent
    done_sent_at: float | None = None                             # when it entered DONE_SENT (or CONFIRMED)
    layers: range | None = None         # decode PP: the layers this rank writes there (its stage's overlap
                                        # with the decode rank's); None: every layer of this rank
    stage_stop: int = 0                 # decode PP: the decode rank's stage's end, whose write carries
                                        # the pools (0: the model's last entry)
    _state: FlowState = field(default=FlowState.WAITING_META, init=False, repr=False)

    def note_asked(self, chunk: int, now: float) -> None:
        """The grant path was asked for ring space for `chunk` (a sendable index) at `now`."""
        asked = own_dict(self.requested_at)
        asked[chunk] = now
        self.requested_at = asked

    def note_asked_again(self, chunk: int, now: float) -> None:
        """The AllocRequest for `chunk` was sent again at `now`."""
        again = own_dict(self.asked_again)
        again[chunk] = now
        self.asked_again = again

    def note_remainder(self, chunk: int, pages_in_credits: int) -> None:
        """`chunk`'s first `pages_in_credits` pages were written into credits; the grant path is
        asked for the rest."""
        rest = own_dict(self.remainders)
        rest[chunk] = pages_in_credits
        self.remainders = rest

    def grant(self, chunk: int) -> None:
        """Sendable chunk `chunk` needs no more ring space (a repeated call changes nothing)."""
        self.granted_bits |= 1 << chunk

    def is_granted(self, chunk: int) -> bool:
        """Whether `chunk` needs no more ring space: False for one never granted, and for any
        negative number (a grant's chunk number comes off the wire)."""
        return chunk >= 0 and bool(self.granted_bits >> chunk & 1)

    @property
    def granted_count(self) -> int:
        """How many sendable chunks need no more ring space."""
        return self.granted_bits.bit_count()

    def note_tags(self, tags: Sequence[bytes]) -> None:
        """The signed tags a completed write carried, kept for TagsAgain."""
        if tags:
            kept = self.landed_tags if isinstance(self.landed_tags, list) else list(self.landed_tags)
            kept.extend(tags)
            self.landed_tags = kept

    @property
    def state(self) -> FlowState:
        return self._state

    def move(self, event: FlowEvent) -> FlowState:
        """Move along FLOW_TRANSITIONS; IllegalTransition (state unchanged) when the table has
        no such move. Returns the new state."""
        new = FLOW_TRANSITIONS.get((self._state, event))
        if new is None:
            raise IllegalTransition(f"flow to decode rank {self.peer.tp_rank} ({self.peer.engine_id}) session "
                                    f"{self.session}", None, self._state, event)
        self._state = new
        return new


def past_prefix(chunks: list[Chunk], prefix: int, first_index: int) -> list[Chunk]:
    """The sendable chunks of `chunks` (request page numbers): each one's pages past the first
    `prefix` pages of the request, numbered from the prefix, indexed from `first_index` on."""
    out: list[Chunk] = []
    for chunk in chunks:
        end = chunk.page_start + chunk.pages.size
        if end > prefix:
            skip = max(0, prefix - chunk.page_start)
            out.append(replace(chunk, index=first_index + len(out), page_start=chunk.page_start + skip - prefix,
                               pages=chunk.pages[skip:]))
    return out
