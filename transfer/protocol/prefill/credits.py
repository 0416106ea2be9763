"""The prefill rank's ring credits: the credits it holds towards each decode rank
(`CreditPurse`), and how a staged chunk is cut to fit them (`cut_pieces`, the remainder's
number). The words both sides share are transfer/protocol/credits.py.

## The purse

`CreditPurse` is the rank's side towards one decode rank: the credits it holds, where its
next staged write goes, and which credits it gives back.

Contract with the caller (the prefill engine, or the simulator):

- `on_grant` for every CreditGrant; a MISMATCH verdict means the decode rank's credit does not
  fit its ring or overlaps one already held: the caller fails the requests towards that rank.
- `take(nbytes, room, session)` when a single-writer staged write's data is gathered: the place
  to write it, or None, and then the write goes the grant path (AllocRequest) as without
  credits. A None also retires every open credit (it will be given back once its writes
  completed), so a rank that waits for a grant holds no open credit.
- `take_all(sizes, room, session)`: the writes of one chunk, each placed as `take` would, or
  none of them (a chunk whose remainder could not be numbered apart, below).
- `take_some(sizes, room, session)`: the longest first part of a chunk's writes that fits,
  placed as successive `take`s would place them; when it is not all of them, every open credit
  is retired as `take`'s None retires them, and the rest goes the grant path.
- `done(span, ok)` when the backend completed that write (ok: its bytes and tag are in place).
- `idle()` when the rank has no staged request towards this decode rank: every open credit is
  retired, so an idle rank holds no ring space.
- `returns()` on every tick: the CreditReturns to send now (retired credits with no write in
  flight), each re-sent until `on_ack`.
- `lost()` when the decode rank is lost or restarted: everything is dropped.

Invariants: writes taken from one credit never share a byte and lie inside it, in increasing
order; a credit is named in a CreditReturn only when no write into it is in flight, and that
return names every write into it that completed; after a credit was returned nothing more is
taken from it, and a grant of it arriving again is ignored.

## A chunk's writes into credits

How a staged chunk towards a decode rank that gave this rank credits becomes writes into them,
with no ring-space round trip.

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

from dataclasses import dataclass, field
from typing import Protocol

from ..actions import PeerKey
from ..credits import CreditSpan, CreditState, GrantVerdict, WriteRef, check_move
from ..pieces import plan_pieces


@dataclass(kw_only=True)
class _Held:
    id: int
    start: int
    nbytes: int
    used: int = 0                                  # bytes taken, from start
    state: CreditState = CreditState.OPEN
    retired: bool = False                          # no more takes; returned once nothing is in flight
    in_flight: dict[int, WriteRef] = field(default_factory=dict)   # start -> write posted, not completed
    written: list[WriteRef] = field(default_factory=list)          # completed writes

    @property
    def end(self) -> int:
        return self.start + self.nbytes


@dataclass(frozen=True, kw_only=True)
class GiveBack:
    """Send a CreditReturn for `credit`, naming `writes`."""

    credit: int
    writes: tuple[WriteRef, ...]


class CreditPurse:
    """The credits of one decode ring (`epoch`, `ring_size` bytes) held by this prefill rank."""

    def __init__(self, *, epoch: int, ring_size: int):
        self.epoch = epoch
        self.ring_size = ring_size
        self._held: dict[int, _Held] = {}
        self._seen_to = 0                  # every credit id up to this one was seen (ids are dense: 1, 2, ...)
        self._seen: set[int] = set()       # ids above it seen: a grant of a seen id not held any more
                                           # was given back (stale); a lower id than the newest may still
                                           # be new (its grant was lost, then re-sent after a later one)

    @property
    def free_bytes(self) -> int:
        """What open credits can still take."""
        return sum(h.nbytes - h.used for h in self._held.values() if not h.retired)

    def on_grant(self, *, credit: int, epoch: int, start: int, nbytes: int) -> GrantVerdict:
        held = self._held.get(credit)
        if epoch != self.epoch or (held is None and (credit <= self._seen_to or credit in self._seen)):
            return GrantVerdict.STALE
        if held is not None:
            return GrantVerdict.DUPLICATE if (held.start, held.nbytes) == (start, nbytes) else GrantVerdict.MISMATCH
        if nbytes <= 0 or start < 0 or start % self.ring_size + nbytes > self.ring_size:
            return GrantVerdict.MISMATCH
        if any(start < h.end and h.start < start + nbytes for h in self._held.values()):
            return GrantVerdict.MISMATCH
        self._held[credit] = _Held(id=credit, start=start, nbytes=nbytes)
        self._seen.add(credit)
        while self._seen_to + 1 in self._seen:
            self._seen_to += 1
            self._seen.discard(self._seen_to)
        return GrantVerdict.OK

    def take(self, nbytes: int, room: int, session: int) -> CreditSpan | None:
        """Where a write of `nbytes` goes: the oldest open credit with room for it. An open
        credit too full for it is retired on the way (used up)."""
        if nbytes <= 0:
            raise ValueError(f"a write has a positive size, got {nbytes}")
        for h in sorted(self._held.values(), key=lambda h: h.start):
            if not h.retired and h.nbytes - h.used < nbytes:
                h.retired = True
            if not h.retired:
                at = h.start + h.used
                h.used += nbytes
                h.in_flight[at] = WriteRef(room=room, session=session, start=at, nbytes=nbytes)
                return CreditSpan(credit=h.id, start=at, nbytes=nbytes)
        self.idle()   # the grant path takes over: hold nothing open meanwhile
        return None

    def take_all(self, sizes: list[int], room: int, session: int) -> list[CreditSpan] | None:
        """Each write of `sizes` placed as successive `take`s would place them, or None (and,
        as `take`'s None, every open credit retired) when one of them would not fit: then
        nothing was taken."""
        if not sizes or min(sizes) <= 0:
            raise ValueError(f"writes have positive sizes, got {sizes}")
        left = {h.id: h.nbytes - h.used for h in self._held.values() if not h.retired}
        order = sorted((h for h in self._held.values() if h.id in left), key=lambda h: h.start)
        for n in sizes:   # the same walk as take(), on copies
            fit = None
            for h in order:
                if h.id in left and left[h.id] < n:
                    del left[h.id]
                if h.id in left:
                    fit = h.id
                    break
            if fit is None:
                self.idle()
                return None
            left[fit] -= n
        spans = [self.take(n, room, session) for n in sizes]
        assert all(s is not None for s in spans), "take_all placed what take did not"
        return [s for s in spans if s is not None]

    def take_some(self, sizes: list[int], room: int, session: int) -> list[CreditSpan]:
        """The places of the first writes of `sizes` that fit, in order, as successive `take`s
        give them, up to the first that does not fit: then (as `take`'s None) every open credit
        is retired, so a rank that asks for the rest holds no open credit while it waits for its
        grant. Each write is placed at most once: the rest is the caller's to ask for."""
        if not sizes or min(sizes) <= 0:
            raise ValueError(f"writes have positive sizes, got {sizes}")
        spans: list[CreditSpan] = []
        for n in sizes:
            span = self.take(n, room, session)
            if span is None:
                break
            spans.append(span)
        return spans

    def holds(self, span: CreditSpan) -> bool:
        """Whether `span` is a write in flight here (not after `lost`)."""
        h = self._held.get(span.credit)
        return h is not None and span.start in h.in_flight

    def done(self, span: CreditSpan, ok: bool) -> None:
        h = self._held.get(span.credit)
        if h is None or span.start not in h.in_flight:
            raise KeyError(f"no write in flight at {span.start} in credit {span.credit}")
        ref = h.in_flight.pop(span.start)
        if ok:
            h.written.append(ref)

    def idle(self) -> None:
        for h in self._held.values():
            h.retired = True

    def returns(self) -> list[GiveBack]:
        """Retired credits with nothing in flight: give them back (again, until acknowledged)."""
        out = []
        for h in self._held.values():
            if h.retired and not h.in_flight:
                if h.state is CreditState.OPEN:
                    h.state = check_move(h.state, CreditState.RETURNED)
                out.append(GiveBack(credit=h.id, writes=tuple(h.written)))
        return out

    def on_ack(self, credit: int) -> None:
        h = self._held.get(credit)
        if h is not None and h.state is CreditState.RETURNED:
            del self._held[credit]

    def lost(self) -> None:
        self._held.clear()



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
(decode/room.py, landed_key: 24 bits)."""


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
