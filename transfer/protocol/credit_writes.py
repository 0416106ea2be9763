"""Prefill side, ring credits: how a staged chunk towards a decode rank that gave this rank
credits becomes writes into them, with no ring-space round trip (transfer/protocol/credits.py).

A chunk goes through credits only when this rank is the only writer of the decode rank's
pieces (prefill TP <= decode TP, per PP stage): pieces written by several prefill ranks keep
the grant path, which reserves all their parts at once (see the deadlock in
docs/protocol.md, "Ring credits"). The room cuts the chunk into pieces itself, each at most
`piece_bytes` (one transfer worker's buffer and the piece cap), the last one also holding the
state pool block when it carries the pools, and takes from the decode rank's purse the
longest first run of them that fits (CreditPurse.take_some). Every piece taken is in flight at
once, bounded by the credit (issue 47, item 4).

**The remainder.** When the credits hold only the first k of the chunk's N pieces, those k go
through the credits and the pages after them, the chunk's *remainder*, go the grant path
(AllocRequest / AllocGrant) under a number of their own, `remainder_number`: the chunk's own
wire number plus REMAINDER. The credit pieces are (chunk, 0..k-1); the granted ones are
(remainder, 0..m-1), over other pages: no (chunk, piece) of the room is named twice, and no
page is written twice (the decode room refuses a piece over pages another piece holds,
whichever came first). A room whose chunks could number REMAINDER or more (`most_chunks`, its
pages x layer entries x PP stages, bounds the numbers: every chunk covers (page, layer) cells
no other chunk covers) never splits a chunk: its chunks go wholly through credits or wholly
through grants. With k = 0 the whole chunk goes the grant path under its own number, as
without credits. Either way, once a chunk asks for ring space its rank holds no open credit
(take_some retired them), so its grant waits only for regions whose writes need no grant.

Pure: the purses are the shell's, handed to the room in its constructor.
"""

from __future__ import annotations

from typing import Protocol

from .actions import PeerKey
from .credit_purse import CreditPurse
from .pieces import plan_pieces


class CreditPurses(Protocol):
    """What a prefill room uses of its rank's ring credits (the engine shell holds one
    CreditPurse per decode peer that takes credits)."""

    @property
    def piece_bytes(self) -> int:
        """The largest write into a credit: a transfer worker's buffer, and the piece cap."""
        ...

    def purse(self, peer: PeerKey) -> CreditPurse | None:
        """The credits `peer` gave this rank; None: it gives none (an older peer, no ring, or
        credits off), and every staged chunk towards it goes the grant path."""
        ...


REMAINDER = 1 << 23
"""Added to a chunk's wire number, the number of its remainder (the part after its pieces written
into credits, asked for through the grant path). Below the decode room's bound on chunk numbers
(decode_room.landed_key: 24 bits)."""


def remainder_number(wire: int, *, most_chunks: int) -> int | None:
    """The wire number of chunk `wire`'s remainder; None when the room cannot number one apart
    from every chunk's own number (`most_chunks`, the most chunk numbers the room could use,
    exceeds REMAINDER): then the chunk is not split."""
    if most_chunks > REMAINDER or not 0 <= wire < REMAINDER:
        return None
    return wire + REMAINDER


def chunk_number(wire: int, *, splits: bool) -> tuple[int, bool]:
    """(the chunk's own wire number, whether `wire` names its remainder) of a number on the wire
    (an AllocGrant's); `splits`: whether the room numbers remainders at all (remainder_number
    is not None for its chunks)."""
    if splits and wire >= REMAINDER:
        return wire - REMAINDER, True
    return wire, False


def cut_pieces(page_start: int, num_pages: int, *, page_bytes: int, piece_bytes: int,
               last_extra: int = 0) -> list[tuple[int, int]] | None:
    """(start, count) pieces of pages [page_start, page_start + num_pages), each of at most
    `piece_bytes` at `page_bytes` per page, the last one with `last_extra` bytes more (the pool
    block). None when not even one page (with the pool block) fits."""
    if num_pages <= 0 or page_bytes <= 0:
        raise ValueError(f"a chunk has pages of positive size, got {num_pages} pages of {page_bytes} bytes")
    most = piece_bytes // page_bytes
    if most <= 0:
        return None
    pieces = plan_pieces(page_start, num_pages, most, 0)
    if last_extra:
        start, count = pieces[-1]
        n = (piece_bytes - last_extra) // page_bytes
        if n <= 0:
            return None
        if count > n:
            pieces = pieces[:-1] + [(start, count - n), (start + count - n, n)]
    return pieces
