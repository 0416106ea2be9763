"""The backend writes a prefill room makes of one chunk towards one decode rank.

Direct: one write per chunk into the decode rank's own pages, split by page range where it would
exceed `max_ranges` descriptors (a write of millions of ranges would hold the backend for
seconds at a time), each part with its own tag. A rank of a prefill that shards its pages
(page_shards.py) writes only the positions it owns, from its local pages, each part's tag naming
them with a page mask; a part where it owns none is not written. Staged: one write per ring piece the decode rank
granted, this writer's part at its offset inside the piece. The write ending at the request's
last page of the model's last entry also carries the state pool items (pool_parts.py).

Pure: the room (prefill/room.py) keeps the state, decides when a chunk is written and posts
the operations these return.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from ..actions import PeerKey, WriteOp
from ..head_mapping import Assignment
from ..messages import AllocGrant
from ..page_shards import MAX_MASK_PAGES, encode_mask, owned
from ..pool_parts import PoolCopy, block_bytes
from ..tags import Tag, TagKind, make_tag
from .flows import Chunk


@dataclass(frozen=True, slots=True, kw_only=True)
class WriteLimits:
    """What one write of a prefill rank may hold: the same for all its rooms, one object they
    share (a room holds no copy of its own)."""

    max_ranges: int = 65536   # direct path: descriptors a write at most
    relayout_bytes: int = 0   # decode context parallel: the bytes one staging buffer can gather for a
                              # write (0: no buffers, no relayout; token_mapping.Relayout)


DEFAULT_LIMITS = WriteLimits()


@dataclass(frozen=True, kw_only=True)
class ChunkWrites:
    """What every write of one chunk towards one decode rank shares."""

    room: int
    me: int                  # this rank's incarnation: the tags' source
    writer: int              # this rank's global rank
    peer: PeerKey
    session: int
    assignment: Assignment
    chunk: Chunk
    wire: int                # the chunk's number on the wire (PP stages number theirs apart)
    head_page_bytes: int     # one page of the chunk's layers for one head
    pools_at: int | None     # page end (from the prefix) of the write carrying the pools; None: none of this chunk's

    def _tag(self, kind: TagKind, *, chunk: int, piece: int, page_start: int, num_pages: int, nbytes: int,
             epoch: int, ring_start: int = -1, pages_mask: bytes = b"") -> Tag:
        return make_tag(kind, room=self.room, session=self.session, epoch=epoch, src=self.me, writer=self.writer,
                        chunk=chunk, piece=piece, page_start=page_start, num_pages=num_pages,
                        layers=self.chunk.layers, nbytes=nbytes, ring_start=ring_start, pages_mask=pages_mask)


def direct_writes(w: ChunkWrites, *, dst_pages: np.ndarray, ranges_per_page: int, max_ranges: int,
                  pools: Callable[[], tuple[PoolCopy, ...]], op_ids: Iterator[int],
                  shard: tuple[int, int] | None = None) -> list[WriteOp]:
    """The chunk's direct writes. `dst_pages`: the decode rank's pages from the prefix on;
    `ranges_per_page`: descriptors one page of the chunk takes; `pools`: the request's pool
    copies, asked for only by the write that carries them. `shard` (page shards, this rank's
    index among them): the chunk's pages are logical ids; only the positions this rank owns are
    written, from their local pages, and the pools only by the write holding the last one."""
    a, chunk = w.assignment, w.chunk
    step = max(1, max_ranges // ranges_per_page)
    if shard is not None:
        step = min(step, MAX_MASK_PAGES)
    out: list[WriteOp] = []
    for part, lo in enumerate(range(0, chunk.pages.size, step)):
        pages = chunk.pages[lo:lo + step]
        start, span = chunk.page_start + lo, int(pages.size)   # the part's positions (a mask may hold fewer)
        dst = dst_pages[start:start + span]
        ends = start + span == w.pools_at
        mask = b""
        if shard is not None:
            mine = owned(pages, *shard)
            ends = ends and bool(mine.mask[-1])
            if not mine.count:
                continue   # every position of this part lives on other ranks
            mask, pages, dst = encode_mask(mine.mask), mine.local, dst[mine.mask]
        nbytes = pages.size * w.head_page_bytes * a.num_heads
        copies: tuple[PoolCopy, ...] = ()
        if ends:
            copies = pools()
            nbytes += block_bytes(copies)
        tag = w._tag(TagKind.DIRECT, chunk=w.wire, piece=part, page_start=start,
                     num_pages=span, nbytes=nbytes, epoch=w.peer.incarnation,
                     pages_mask=mask)
        out.append(WriteOp(op_id=next(op_ids), room=w.room, peer=w.peer, staged=False, chunk=w.wire, piece=part,
                           src_pages=pages, dst_pages=dst, src_heads=a.src_heads,
                           dst_heads=a.dst_heads, nbytes=nbytes, tag=tag, pools=copies, layers=chunk.layers,
                           ready=chunk.ready))
    return out


def granted_writes(w: ChunkWrites, grant: AllocGrant, *,
                   last_part: Callable[[int], tuple[int, tuple[PoolCopy, ...]]] | None,
                   op_ids: Iterator[int], kind: TagKind = TagKind.STAGED) -> list[WriteOp] | str:
    """The chunk's staged writes, one per granted piece, or why the grant does not match the
    chunk. `last_part(kv_bytes)`: this writer's offset and pool copies in the piece carrying the
    pools (None: the request moves none). `kind` CREDIT: pieces the room cut itself, each placed
    in a ring credit (prefill/credits.py)."""
    a, chunk = w.assignment, w.chunk
    pos = chunk.page_start
    out: list[WriteOp] = []
    for piece in grant.pieces:
        lo = piece.page_start - chunk.page_start
        kv_head_bytes = piece.num_pages * w.head_page_bytes
        nbytes = kv_head_bytes * a.num_heads
        offset = kv_head_bytes * a.dst_heads[0]  # parts follow in head order
        copies: tuple[PoolCopy, ...] = ()
        if piece.page_start + piece.num_pages == w.pools_at and last_part is not None:
            offset, copies = last_part(kv_head_bytes)   # each writer's part ends with its pool block
            nbytes += block_bytes(copies)
        if (piece.page_start != pos or piece.num_pages <= 0 or lo + piece.num_pages > chunk.pages.size
                or offset + nbytes > piece.region_nbytes):
            return f"ring allocation for chunk {grant.chunk} from {w.peer} does not match the chunk: {piece}"
        pos += piece.num_pages
        tag = w._tag(kind, chunk=grant.chunk, piece=piece.index, page_start=piece.page_start,
                     num_pages=piece.num_pages, nbytes=nbytes, epoch=grant.epoch, ring_start=piece.start)
        out.append(WriteOp(op_id=next(op_ids), room=w.room, peer=w.peer, staged=True, chunk=grant.chunk,
                           piece=piece.index, src_pages=chunk.pages[lo:lo + piece.num_pages], dst_pages=None,
                           src_heads=a.src_heads, dst_heads=a.dst_heads, nbytes=nbytes, tag=tag,
                           ring_start=piece.start, writer_offset=offset, pools=copies, layers=chunk.layers,
                           ready=chunk.ready))
    if pos != chunk.page_start + chunk.pages.size:
        return f"ring allocation for chunk {grant.chunk} from {w.peer} does not cover it"
    return out
