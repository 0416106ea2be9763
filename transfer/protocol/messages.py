"""Rank-to-rank control messages: typed, versioned msgspec Structs (see kvstage.wire).

Every message names its sender's incarnation (`src`) and the receiver incarnation it is meant
for (`dst`; 0 only in Hello, before the sender knows it), so nothing from a previous life of
either peer is ever applied to the current one. Room-level messages carry the receiver's
random `session` so a room id reused later cannot pick up stragglers of its earlier use.
"""

from __future__ import annotations

import msgspec
import numpy as np

from ...wire import Codec, Message, WireError, prebuild_struct_info
from ..layout import LayoutSummary
from .path_choice import WriterCosts


class PeerMessage(Message, kw_only=True, frozen=True):
    src: int
    dst: int = 0


class RoomMessage(PeerMessage, kw_only=True, frozen=True):
    """A message about one use of a room: the room id and the decode side's session of it.
    Encoded exactly as when each message declared the two fields itself, right after `dst`."""

    room: int
    session: int


class PoolMemory(msgspec.Struct, frozen=True, kw_only=True):
    """Where one state pool's tensors live at a decode rank, for direct writes into its items."""

    name: str
    addrs: list[int]            # per tensor
    item_strides: list[int]     # bytes between items, per tensor
    head_strides: list[int]     # bytes between heads (heads pools; 0 when replicated), per tensor
    mem_kind: str = "DRAM"      # the pool's own region: its kind may differ from the KV's
    device: int = 0
    own_writes: bool = False    # direct path: its items go in writes of their own (StatePool.own_writes)


class KVMemory(msgspec.Struct, frozen=True, kw_only=True):
    """Where a decode rank's KV cache lives, for direct writes into its pages."""

    k_addrs: list[int]
    v_addrs: list[int]          # empty for MLA
    num_pages: int
    page_stride: int            # bytes between pages of one layer (page_size * token_stride)
    token_stride: int           # bytes between tokens (local_heads * head_dim * elem)
    mem_kind: str = "DRAM"
    device: int = 0
    pools: list[PoolMemory] = []


class RingInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A decode rank's staging ring, advertised to its writers."""

    addr: int
    size: int
    epoch: int
    mem_kind: str = "DRAM"
    device: int = 0


class Hello(PeerMessage, kw_only=True, frozen=True):
    """decode -> prefill, once per peer: who I am, how to write to me, what I hold."""

    engine_id: str
    role: str
    tp_size: int
    tp_rank: int
    ctrl_endpoint: str
    backend: str
    backend_identity: bytes
    layout: LayoutSummary
    kv: KVMemory
    ring: RingInfo | None = None
    staging: bool = False
    lease_s: float = 10.0
    conn: int = 0               # this connection's number: a new Hello of the same incarnation has a higher one
    verify: bool = False        # end-to-end digests on (both sides must agree)
    # since version 5 (decode pipeline parallelism, stage_mapping.py): the decode engine's PP
    # size and this rank's stage's layers [stage_start, stage_stop) (stage_stop 0: every layer);
    # tp_size is then one stage's TP size and tp_rank the engine rank, pp_rank * tp_size + tp_rank
    pp_size: int = 1
    stage_start: int = 0
    stage_stop: int = 0
    # since version 6 (decode context parallel, token_mapping.py): the decode rank's DCP group size
    # and its rank in it (KVLayout.dcp_size / dcp_rank); 1 and 0 without DCP
    dcp_size: int = 1
    dcp_rank: int = 0


class HelloAck(PeerMessage, kw_only=True, frozen=True):
    """prefill -> decode: accepted (or why not), and what the writer side offers."""

    ok: bool
    reason: str = ""
    engine_id: str = ""
    tp_size: int = 0
    tp_rank: int = 0
    backend_name: str = ""
    staging: bool = False
    buffer_bytes: int = 0       # smallest per-worker staging buffer: bounds one write
    lease_s: float = 10.0
    conn: int = 0               # the Hello's connection number
    costs: WriterCosts | None = None   # what this rank's writes and gathers cost, measured at its start
                                       # (protocol/path_choice.py; None: not measured), since version 3
    credits: bool = False       # takes ring credits (CreditGrant; transfer/protocol/credits.py), since version 4: a
                                # peer without it gets every staged piece through AllocRequest / AllocGrant


class RoomMeta(RoomMessage, kw_only=True, frozen=True):
    """decode -> prefill, per room: where this room's pages go."""

    num_pages: int              # the whole request, prefix included
    staged: bool
    dst_pages: bytes = b""      # little-endian int64 page indices (direct path), past the prefix
    prefix_pages: int = 0       # the first pages of the request this decode rank already holds
    pool_items: dict[str, bytes] = {}  # state pool -> this rank's item indices (little-endian int64)

    def pages(self) -> np.ndarray:
        if len(self.dst_pages) % 8:
            raise WireError("malformed", "dst_pages is not a whole number of int64")
        return np.frombuffer(self.dst_pages, dtype="<i8")

    def items(self) -> dict[str, np.ndarray]:
        if any(len(b) % 8 for b in self.pool_items.values()):
            raise WireError("malformed", "pool_items are not whole numbers of int64")
        return {k: np.frombuffer(b, dtype="<i8") for k, b in self.pool_items.items()}


class MetaAck(RoomMessage, kw_only=True, frozen=True):
    """prefill -> decode: room metadata received (the decode side stops re-sending it)."""



class AllocRequest(RoomMessage, kw_only=True, frozen=True):
    """prefill -> decode (staged): this chunk (pages x layers) is ready; where in your ring
    does it go?"""

    chunk: int
    page_start: int
    num_pages: int
    layer_start: int
    num_layers: int


class Piece(msgspec.Struct, frozen=True, array_like=True):
    """One ring region of a chunk. Writers' parts follow each other in writer order, each
    num_pages * (that writer's bytes per page) long; both sides derive them from the mapping."""

    index: int
    page_start: int
    num_pages: int
    start: int          # linear ring position of the region
    region_nbytes: int


class AllocGrant(RoomMessage, kw_only=True, frozen=True):
    """decode -> prefill (staged): the pieces a chunk was split into, in ring order."""

    chunk: int
    epoch: int
    pieces: list[Piece]


class WatermarkUpdate(PeerMessage, kw_only=True, frozen=True):
    """decode -> prefill: the ring's oldest live position moved."""

    epoch: int
    round: int
    tail: int


class CreditGrant(PeerMessage, kw_only=True, frozen=True):
    """decode -> prefill (staged, credits): a standing share of my ring, [start, start + nbytes)
    in linear ring positions of `epoch`, yours to cut single-writer staged writes from without
    asking (transfer/protocol/credits.py). The ring's watermark rides along: the region is free under it.
    Re-sent until a write used it or it came back; a repeated grant changes nothing."""

    epoch: int
    credit: int         # the credit's number: grows with every credit given to one rank
    start: int
    nbytes: int
    wm_round: int
    wm_tail: int


class CreditWrite(msgspec.Struct, frozen=True, array_like=True):
    """One write a prefill rank made into a credit, as its CreditReturn names it."""

    room: int
    session: int
    start: int
    nbytes: int


class CreditReturn(PeerMessage, kw_only=True, frozen=True):
    """prefill -> decode (credits): I take nothing more from this credit and none of my writes
    into it is in flight; these completed. Re-sent until CreditAck."""

    epoch: int
    credit: int
    writes: list[CreditWrite]


class CreditAck(PeerMessage, kw_only=True, frozen=True):
    """decode -> prefill (credits): your CreditReturn arrived."""

    epoch: int
    credit: int


class WriterDone(RoomMessage, kw_only=True, frozen=True):
    """prefill -> decode: all my writes for the room completed locally (tags should follow)."""

    writes: int
    nbytes: int


class TagsAgain(RoomMessage, kw_only=True, frozen=True):
    """prefill -> decode: the signed tags of this writer's writes for the room that completed, as
    their backend notifications carried them. A write its backend reported complete has put its
    bytes in place, so the decode rank takes a tag from here as from a notification, each only
    once: a lost notification (Mooncake only logs a notify that fails) costs a heartbeat, not the
    request. Sent only while the decode rank may be waiting for one of those tags: the room is
    unconfirmed, the writer finished writing or still has writes to complete, and none was
    posted or completed for a heartbeat (PrefillRoom._tags_again, prefill/room.py)."""

    tags: list[bytes]


class WritePosted(RoomMessage, kw_only=True, frozen=True):
    """prefill -> decode: the backend took my write of this chunk and piece; its tag follows.
    The decode rank polls its backend only while such writes are announced and their tags are
    not in (protocol/quiet.py), so it needs no polling while the prefill computes."""

    chunk: int
    piece: int
    group: int = 0      # which backend write of a direct write split by memory kind (Tag.group)


class RoomDone(RoomMessage, kw_only=True, frozen=True):
    """decode -> prefill: every byte of the room is in place."""



class RoomFailed(RoomMessage, kw_only=True, frozen=True):
    """either way: the room failed or was aborted here; kind says which failure."""

    kind: str
    reason: str


class Quiesced(RoomMessage, kw_only=True, frozen=True):
    """prefill -> decode: no write of mine for this room is in flight or will be posted."""



class Heartbeat(PeerMessage, kw_only=True, frozen=True):
    """Lease renewal between connected peers: my sequence number, and the highest of yours
    I have received (the ack that lets a writer know how long it may still write)."""

    seq: int
    ack: int = 0
    wm_epoch: int = 0           # decode -> prefill: the ring's current watermark rides along, so a
    wm_round: int = 0           # lost WatermarkUpdate costs at most one heartbeat interval
    wm_tail: int = 0


class Goodbye(PeerMessage, kw_only=True, frozen=True):
    """The sender is done with us: it is closing, or it declared us lost. Fail what depends on
    it. `clean`: it closed with no write of its still in flight (nothing to quarantine).
    `conn`: the connection it ends; a late Goodbye of an earlier connection between the same two
    incarnations must not end a newer one (0: whichever is current)."""

    reason: str = ""
    clean: bool = False
    conn: int = 0


class Vouch(msgspec.Struct, frozen=True, array_like=True):
    """In an EngineBeat: rank `rank` (an incarnation) was alive when it stamped `seq`, and the
    stamp has been held by relays for at least `age` seconds since (protocol/engine_leases.py)."""

    rank: int
    seq: int
    age: float


class Ack(msgspec.Struct, frozen=True, array_like=True):
    """In an EngineBeat: rank `by` heard rank `rank` with stamp `seq` (or a later one) and counts
    its lease from no earlier than that stamp's time (protocol/engine_leases.py)."""

    by: int
    rank: int
    seq: int


class EngineBeat(PeerMessage, kw_only=True, frozen=True):
    """One heartbeat per pair of engines, or between the ranks of one engine
    (protocol/engine_leases.py): the stamps the sender vouches for and the acknowledgements it
    carries. `links`: a beat to a sibling names, per peer engine, the ranks of it the sender is
    connected to, and `everies` the slot length each of those engines told it (both empty in a
    beat to another engine); `every`: a beat to another engine gives the sender engine's own slot
    length, so the two engines settle on the longer. Sent only by ranks that run engine-pair
    leases (EngineConfig.leases, KVSTAGE_LEASES=engine; engine/engine_liveness.py); a new message
    of the union, at the current wire version: every other message's bytes are unchanged, and a
    rank of a build without it refuses the frame as malformed (the peer is then lost for
    silence, as with any mismatch of the lease mode)."""

    vouches: list[Vouch] = []
    acks: list[Ack] = []
    links: dict[str, list[int]] = {}
    everies: dict[str, float] = {}
    every: float = 0.0
    sibling: bool = False


PEER_MESSAGES: tuple[type[PeerMessage], ...] = (
    Hello, HelloAck, RoomMeta, MetaAck, AllocRequest, AllocGrant, WatermarkUpdate,
    WriterDone, RoomDone, RoomFailed, Quiesced, Heartbeat, Goodbye, WritePosted, TagsAgain,
    CreditGrant, CreditReturn, CreditAck,   # the credit messages are new: the others' bytes are unchanged
    EngineBeat)                             # new too (engine-pair leases): the others' bytes are unchanged


def peer_codec(token: bytes | None, max_frame: int | None = None) -> Codec[PeerMessage]:
    """The codec of the rank-to-rank control plane."""
    if max_frame is None:
        return Codec(PEER_MESSAGES, token)
    return Codec(PEER_MESSAGES, token, max_frame)


def encode_pages(pages: np.ndarray) -> bytes:
    return np.ascontiguousarray(pages, dtype="<i8").tobytes()


prebuild_struct_info(globals())  # last: every Struct above is defined (see kvstage.wire)
