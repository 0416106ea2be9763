"""What the room state machines decide, for the engine shell to carry out.

A state machine method takes an input (a message, a completion, the current time) and
returns a list of these actions; it never performs IO itself. Each role's rooms return their own
union (`PrefillAction`, `DecodeAction`): both hold the `SharedAction`s, and neither holds the
other role's, so a room returning the other role's action is a type error, not a run-time one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..poll import KVPoll
from .credits import CreditSpan
from .kinds import TransferPath
from .messages import PeerMessage
from .pool_parts import PoolCopy
from .tags import Tag
from .token_mapping import Relayout


class PeerKey(NamedTuple):
    """One incarnation of one rank: a restarted rank is a different peer."""

    engine_id: str
    tp_rank: int
    incarnation: int

    def __str__(self) -> str:
        return f"{self.engine_id}/{self.tp_rank}#{self.incarnation & 0xFFFF:04x}"


@dataclass(frozen=True)
class Send:
    peer: PeerKey
    msg: PeerMessage


@dataclass(frozen=True, kw_only=True)
class WriteOp:
    """One backend write request a prefill room wants made (keyword-only: 20 fields)."""

    op_id: int
    room: int
    peer: PeerKey
    staged: bool
    chunk: int
    piece: int
    src_pages: np.ndarray              # this rank's cache pages, in request order
    dst_pages: np.ndarray | None       # direct: destination cache pages
    src_heads: tuple[int, int]
    dst_heads: tuple[int, int]
    nbytes: int
    tag: Tag
    ring_start: int = -1               # staged: linear ring position of the whole region
    writer_offset: int = 0             # staged: this writer's part inside the region
    pools: tuple[PoolCopy, ...] = ()   # state pool copies after the KV bytes: the last page's write
    layers: range                      # the layers it moves (a layer-wise send: a group of them)
    ready: tuple[object, ...] = ()     # waited on (synchronize()) before the layers are read
    credit: CreditSpan | None = None   # staged into a ring credit: its place there (ring_start is its start)
    token_runs: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None   # direct, decode context parallel: the
                                       # runs (source slot, destination slot, tokens) it moves instead of whole pages
    relayout: Relayout | None = None   # direct, decode context parallel, where the rank has staging buffers:
                                       # the same tokens gathered into one and written as the decode's slot runs

    @property
    def num_pages(self) -> int:
        return int(self.src_pages.size)


@dataclass(frozen=True)
class PostWrite:
    """Direct: post now. Staged: gather and post once the peer's watermark allows it."""

    op: WriteOp


@dataclass(frozen=True)
class ScatterPart:
    region_offset: int                 # byte offset of this writer's part inside the ring
    nbytes: int
    dst_heads: tuple[int, int]


@dataclass(frozen=True)
class PoolPlacement:
    """The last piece: where in the ring one pool copy (PoolCopy) of a writer's part lies."""

    ring_offset: int
    copy: PoolCopy


@dataclass(frozen=True, kw_only=True)
class PartCheck:
    """Verify: one writer's part of a landed piece, and the digest its tag carries."""

    ring_offset: int
    nbytes: int
    digest: int
    writer: int


@dataclass(frozen=True, kw_only=True)
class Scatter:
    """Decode (staged): copy a landed piece from the ring into the KV cache."""

    room: int
    key: tuple[int, int]               # (chunk, piece)
    dst_pages: np.ndarray
    parts: tuple[ScatterPart, ...]
    layers: range                      # the layers the piece holds (region blocks: K of each, then V)
    pools: tuple[PoolPlacement, ...] = ()
    checks: tuple[PartCheck, ...] = ()


@dataclass(frozen=True)
class PrepareScatter:
    """Decode (staged): the room's destination pages are known and its pieces will be scattered
    into them. The scatter may validate and index them now (on a GPU: upload them), off the
    request's path, so the first piece that lands finds them ready. A hint: nothing waits for it."""

    room: int
    dst_pages: np.ndarray


@dataclass(frozen=True)
class PublishWatermark:
    """Decode: the ring's watermark moved; tell every writer of the ring."""


@dataclass(frozen=True, kw_only=True)
class StatusChanged:
    state: KVPoll
    failure: str | None = None
    failure_kind: str | None = None
    released: bool = False


@dataclass(frozen=True)
class DecodePrefix:
    """Prefill: the decode side holds the request's first `pages` pages already (its prefix
    cache); they are not sent. For the caller, before it gives the page count."""

    pages: int


@dataclass(frozen=True)
class RoomTotals:
    """What a room moved, for the caller's per-request metrics (see TransferMetrics)."""

    nbytes: int = 0
    writes: int = 0
    path: TransferPath = TransferPath.NONE
    merged: int = 0    # prefill, batching: units written inside another unit's write (write_batching.py)
    predicted_s: float | None = None   # decode: the path choice's predicted time of the path taken
    path_reason: str = ""              # decode: why that path (path_choice.PathReason; "": not chosen)


@dataclass(frozen=True, kw_only=True)
class AwaitUnit:
    """Prefill, a batching room (write_batching.py): wait for `ready` (each object's
    synchronize()) off the control thread, then report unit `seq` of room `room` ready
    (PrefillRoom.on_unit_ready)."""

    room: int
    seq: int
    ready: tuple[object, ...]


@dataclass(frozen=True)
class ReleaseCredit:
    """Decode: a piece written into a ring credit (from `peer`, at `span`) is done with: scattered,
    or dropped with its room. The shell releases it to the ring's CreditLedger (never frees the
    region itself: the credit holds it)."""

    peer: PeerKey
    span: CreditSpan


@dataclass(frozen=True)
class SettleCredits:
    """Prefill: a write into a credit of `peer` completed, or the room took what it needed from
    them: the shell sends the CreditReturns that are due (CreditPurse.returns)."""

    peer: PeerKey


@dataclass(frozen=True)
class Released:
    """Nothing of the room can be touched any more; the shell may forget it."""


@dataclass(frozen=True)
class Dropped:
    """An input was ignored (stale or not for this room); the shell counts it under `reason`."""

    reason: str


SharedAction = Send | StatusChanged | Released | Dropped
"""What both roles' rooms return (room_base.py decides them): the room book carries them out the
same way for both roles."""

PrefillAction = SharedAction | PostWrite | AwaitUnit | SettleCredits | DecodePrefix
"""Everything a prefill room (prefill/room.py) returns: the shared actions and the prefill-only
ones. The prefill book's `match` is exhaustive over it (mypy checks it with assert_never)."""

DecodeAction = SharedAction | Scatter | PrepareScatter | PublishWatermark | ReleaseCredit
"""Everything a decode room (decode/room.py) returns: the shared actions and the decode-only
ones. The decode book's `match` is exhaustive over it (mypy checks it with assert_never)."""
