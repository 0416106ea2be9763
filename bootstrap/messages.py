"""The rendezvous protocol: request and reply messages of the bootstrap server.

Every message is a `kvstage.wire.Message` (type tag ``t``, version ``v``) sent through a
`kvstage.wire.Codec`. Requests carry a request id (``rid``) that the reply echoes, so a client
can discard a stale reply to an earlier request it already gave up on.

The field constraints below are the server's storage bounds per record: the server decodes
requests with them, so a record that is too large never reaches the registry.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from ..wire import Codec, Message, prebuild_struct_info

# Hard bounds of one rank record (the registry adds configurable bounds on counts).
MAX_TP = 1024
MAX_ID = 2**63 - 1
MAX_ENGINE_ID = 128
MAX_ENDPOINT = 256
MAX_BACKEND = 32
MAX_IDENTITY = 8192
MAX_MAP_ENTRIES = 32
MAX_KEY = 64
MAX_VALUE = 256
# A Register request with every field at its bound is ~20 KiB; 64 KiB leaves room.
MAX_REQUEST = 64 << 10
# Replies can list many records (a Lookup of a 1024-rank engine); clients accept this much.
MAX_REPLY = 64 << 20

ERROR_KINDS = ("auth", "malformed", "version", "oversized", "full", "conflict", "bad_request",
               "internal")
# Refusals that asking again cannot change: a client fails at once with the server's reason.
# The rest ("internal", and a frame corrupted on the way, "integrity") may pass on a retry.
PERMANENT_KINDS = frozenset({"auth", "malformed", "version", "oversized", "full", "conflict", "bad_request"})

Id = Annotated[int, Meta(ge=0, le=MAX_ID)]
EngineId = Annotated[str, Meta(min_length=1, max_length=MAX_ENGINE_ID)]
TpSize = Annotated[int, Meta(ge=1, le=MAX_TP)]
TpRank = Annotated[int, Meta(ge=0, lt=MAX_TP)]
Role = Literal["prefill", "decode"]
Key = Annotated[str, Meta(min_length=1, max_length=MAX_KEY)]
LayoutValue = Annotated[str, Meta(max_length=MAX_VALUE)] | int | float | bool


class RankEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One rank as it registers: the wire form of `bootstrap.client.RankInfo`."""

    engine_id: EngineId
    role: Role
    tp_size: TpSize
    tp_rank: TpRank
    ctrl_endpoint: Annotated[str, Meta(min_length=1, max_length=MAX_ENDPOINT)]
    backend: Annotated[str, Meta(min_length=1, max_length=MAX_BACKEND)]
    backend_identity: Annotated[str, Meta(max_length=MAX_IDENTITY)]
    layout: Annotated[dict[Key, LayoutValue], Meta(max_length=MAX_MAP_ENTRIES)] = {}
    pools: Annotated[dict[Key, Id], Meta(max_length=MAX_MAP_ENTRIES)] = {}
    incarnation: Id
    dp_rank: Annotated[int, Meta(ge=0, le=MAX_TP)] = 0    # data-parallel rank inside its serving instance


class RecordEntry(RankEntry, frozen=True, kw_only=True):
    """A registered rank: its entry plus the epoch the server assigned and when (wall clock)."""

    epoch: int
    registered_at: float


class StatusRow(msgspec.Struct, frozen=True, kw_only=True):
    """One rank as operators see it (no layout or backend identity: keeps Status small)."""

    engine_id: str
    role: str
    tp_size: int
    tp_rank: int
    epoch: int
    incarnation: int
    ctrl_endpoint: str
    backend: str
    age_s: float        # seconds since its last registration or heartbeat
    stale: bool
    dp_rank: int = 0


# ---- requests (client -> server) ---------------------------------------------------------

class Request(Message, kw_only=True, frozen=True):
    rid: Id = 0


class Register(Request, kw_only=True, frozen=True):
    """Add or refresh a rank. ``epoch_hint``: the epoch this incarnation held before (0: none),
    kept by a server that has no record of the rank (after a restart)."""

    rank: RankEntry
    epoch_hint: Id = 0


class Deregister(Request, kw_only=True, frozen=True):
    """Remove a rank; only the incarnation that holds the record can remove it."""

    engine_id: EngineId
    tp_rank: TpRank
    incarnation: Id


class Lookup(Request, kw_only=True, frozen=True):
    """The live ranks of an engine now (the client polls until all are there)."""

    engine_id: EngineId


class Heartbeat(Request, kw_only=True, frozen=True):
    engine_id: EngineId
    tp_rank: TpRank
    incarnation: Id


class Status(Request, kw_only=True, frozen=True):
    pass


# ---- replies (server -> client) ----------------------------------------------------------

class Reply(Message, kw_only=True, frozen=True):
    rid: int = 0


class RegisterReply(Reply, kw_only=True, frozen=True):
    record: RecordEntry
    fresh: bool         # False: this incarnation was already registered (idempotent retry)


class DeregisterReply(Reply, kw_only=True, frozen=True):
    removed: bool


class LookupReply(Reply, kw_only=True, frozen=True):
    engine_id: str
    known: bool                         # False: no rank of this engine is registered
    role: str = ""
    tp_size: int = 0
    records: list[RecordEntry] = []     # live ranks, sorted by tp_rank
    missing: list[int] = []             # tp ranks with no live record
    stale: list[int] = []               # of those, ranks whose record went stale


class HeartbeatReply(Reply, kw_only=True, frozen=True):
    # ok | unknown (register again) | stale (lease ran out: register again) |
    # superseded (another incarnation holds this rank now: do not fight it)
    state: Literal["ok", "unknown", "stale", "superseded"]


class StatusReply(Reply, kw_only=True, frozen=True):
    started_at: float           # server start, wall clock
    lease_s: float
    auth: bool
    limits: dict[str, int]
    counters: dict[str, int]
    rows: list[StatusRow]


class Error(Reply, kw_only=True, frozen=True):
    """A refused request. ``kind`` is one of ERROR_KINDS; ``text`` says why."""

    kind: str
    text: str = ""


REQUEST_TYPES = (Register, Deregister, Lookup, Heartbeat, Status)
REPLY_TYPES = (RegisterReply, DeregisterReply, LookupReply, HeartbeatReply, StatusReply, Error)


def request_codec(token: bytes | None, max_frame: int = MAX_REQUEST) -> Codec:
    return Codec(REQUEST_TYPES, token=token, max_frame=max_frame)


def reply_codec(token: bytes | None, max_frame: int = MAX_REPLY) -> Codec:
    return Codec(REPLY_TYPES, token=token, max_frame=max_frame)


class _Rid(msgspec.Struct):
    rid: int = 0


def peek_rid(payload: bytes) -> int:
    """Best-effort request id of a frame that failed to decode (0 when there is none)."""
    try:
        rid = msgspec.msgpack.decode(payload, type=_Rid).rid
    except (msgspec.DecodeError, msgspec.ValidationError):
        return 0
    return rid if 0 <= rid <= MAX_ID else 0


prebuild_struct_info(globals())  # last: every Struct above is defined (see kvstage.wire)
