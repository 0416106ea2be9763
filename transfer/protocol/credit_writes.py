"""Prefill side, ring credits: how a staged chunk towards a decode rank that gave this rank
credits becomes writes into them, with no ring-space round trip (transfer/protocol/credits.py).

A chunk goes through credits only when this rank is the only writer of the decode rank's
pieces (prefill TP <= decode TP, per PP stage): pieces written by several prefill ranks keep
the grant path, which reserves all their parts at once (see the deadlock in
docs/protocol.md, "Ring credits"). The room cuts the chunk into pieces itself, each at most
`piece_bytes` (one transfer worker's buffer and the piece cap), the last one also holding the
state pool block when it carries the pools, and takes all of them from the decode rank's
purse at once (CreditPurse.take_all) or none: then the whole chunk goes the grant path
(AllocRequest / AllocGrant) as without credits. Every piece taken is in flight at once,
bounded by the credit (issue 47, item 4).

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
