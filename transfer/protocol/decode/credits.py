"""The decode rank's side of ring credits: who holds which share of its ring, and whether a
staged write that names a place in a credit may be scattered from there (see credits.py).

Contract with the caller (the decode engine, or the simulator):

- `connect(peer)` when a prefill rank (one incarnation) connects; raises ValueError when the
  ring cannot hold one piece per connected rank. `peer_lost(peer)` once it is lost and its
  last posted write can no longer land (after its quarantine): its credits close.
- `add_demand` when a staged room sends its metadata to a writer, with the bytes that writer
  will write; `end_room` when the room ended (success, failure, abort or reuse of its id).
- `issue()` after any of these and after a release: the credits to hand out now, each to be
  sent as a CreditGrant (and re-sent by `unacknowledged` until the rank used or returned it).
- `claim` for every staged tag that names a credit position, before the room takes it; every
  OK claim is later `release`d exactly once (its piece scattered, or its room dropped it).
- `on_return` for a CreditReturn.

Invariants (the simulator checks them; tests/unit/test_credit_rules.py states them):
credits are disjoint ring regions handed out only where they can be written at once; within a
credit, the writes it accepts never share a byte; a region is freed only when its rank gave it
back (or was lost), every write it named was released or belongs to a room that ended, and no
accepted write in it is still waiting for its scatter. A rank that waits for a credit is served
before any rank that asks after it (no starvation); a rank with no staged request holds none
for longer than it takes to give back the ones it has.
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable
from dataclasses import dataclass, field

from ..credits import (
    ClaimVerdict,
    CreditSpan,
    CreditState,
    WriteRef,
    check_credit_config,
    check_move,
    credit_target,
    fair_cap,
)
from ..ring import Region, RingAllocator

Peer = Hashable
OPEN_PER_RANK = 2   # a rank gets its next credit while it still writes into the current one


@dataclass(frozen=True, kw_only=True)
class Issued:
    """Hand `peer` the credit `credit`: ring region [start, start + nbytes)."""

    peer: Peer
    credit: int
    start: int
    nbytes: int


@dataclass(frozen=True, kw_only=True)
class Claim:
    """The verdict on one staged write, and the credit it is in (OK and DUPLICATE)."""

    verdict: ClaimVerdict
    reason: str = ""
    span: CreditSpan | None = None


@dataclass(frozen=True, kw_only=True)
class ReturnResult:
    """`ok` False: the CreditReturn does not match the credit given (the reason says how); the
    caller fails the peer's requests that wrote into it and treats the peer as faulty. The
    credit then stays closed to reuse until `peer_lost`, and the peer gets no new credit. `freed`: the ring's watermark moved."""

    ok: bool
    reason: str = ""
    rooms: frozenset[tuple[int, int]] = frozenset()   # (room, session) of the writes in the credit
    freed: bool = False


@dataclass(kw_only=True)
class _Credit:
    id: int
    peer: Peer
    region: Region
    state: CreditState = CreditState.OPEN
    spans: list[tuple[int, int]] = field(default_factory=list)   # accepted (start, end), sorted
    rooms: dict[int, tuple[int, int]] = field(default_factory=dict)  # accepted start -> (room, session)
    live: set[int] = field(default_factory=set)                  # accepted starts not released yet
    named: tuple[WriteRef, ...] = ()                             # what its CreditReturn named
    poisoned: bool = False                                       # a bad return: freed only when the peer is lost

    def contains(self, start: int, nbytes: int) -> bool:
        return self.region.start <= start and start + nbytes <= self.region.end

    @property
    def claimed_bytes(self) -> int:
        return sum(e - s for s, e in self.spans)


@dataclass(kw_only=True)
class _Rank:
    credits: dict[int, _Credit] = field(default_factory=dict)   # not yet closed
    demand: dict[tuple[int, int], int] = field(default_factory=dict)   # (room, session) -> bytes left
    next_id: int = 1
    paused: bool = False     # gave a credit back unused: no new one until another room of it starts

    def open(self) -> list[_Credit]:
        return [c for c in self.credits.values() if c.state is CreditState.OPEN and not c.poisoned]

    @property
    def wanted(self) -> int:
        """Bytes its live rooms still have to write, as far as credits go: 0 for a rank that
        gave a credit back unused (what it has left goes the grant path, or waits for data:
        it gets a new credit when another room of it starts) and for a rank that returned a
        credit wrongly (none until it is lost)."""
        if self.paused or any(c.poisoned for c in self.credits.values()):
            return 0
        return sum(self.demand.values())


class CreditLedger:
    """Ring credits of one decode ring. `floor`: one piece (the largest single writer's part a
    piece may hold), the smallest credit worth giving."""

    def __init__(self, ring: RingAllocator, *, floor: int):
        if floor <= 0 or floor > ring.size:
            raise ValueError(f"a credit floor of {floor} bytes does not fit a {ring.size}-byte ring")
        self.ring = ring
        self.floor = floor
        self._ranks: dict[Peer, _Rank] = {}
        self._waiting: list[Peer] = []    # ranks with demand and no open credit, in arrival order
        self._orphans: dict[Peer, _Rank] = {}   # lost ranks' credits whose accepted writes still scatter

    # -- queries --------------------------------------------------------------------------
    def credits_of(self, peer: Peer) -> list[CreditSpan]:
        """The credits `peer` holds (open or returned, not closed yet)."""
        r = self._ranks.get(peer)
        return [] if r is None else [CreditSpan(credit=c.id, start=c.region.start, nbytes=c.region.nbytes)
                                     for c in r.credits.values()]

    def held_bytes(self, peer: Peer) -> int:
        r = self._ranks.get(peer)
        return 0 if r is None else sum(c.region.nbytes for c in r.credits.values())

    # -- connections and demand -------------------------------------------------------------
    def connect(self, peer: Peer) -> None:
        if peer in self._ranks:
            return
        check_credit_config(ring_bytes=self.ring.size, piece_bytes=self.floor, prefill_ranks=len(self._ranks) + 1)
        self._ranks[peer] = _Rank()

    def add_demand(self, peer: Peer, room: int, session: int, nbytes: int) -> None:
        r = self._ranks.get(peer)
        if r is None or nbytes <= 0:
            return
        r.demand[(room, session)] = r.demand.get((room, session), 0) + nbytes
        r.paused = False
        if not r.open() and peer not in self._waiting:
            self._waiting.append(peer)

    def end_room(self, room: int, session: int) -> bool:
        """The room's use ended: its demand goes, and a returned credit stops waiting for its
        writes that never arrived. True when the watermark moved."""
        for r in self._ranks.values():
            r.demand.pop((room, session), None)
        return self._close_settled()

    # -- issuing ----------------------------------------------------------------------------
    def issue(self) -> list[Issued]:
        """The credits to hand out now. Ranks without an open credit come first, in the order
        they started waiting; a rank that cannot be served holds everyone behind it (so it is
        never overtaken for ever); then busy ranks whose newest credit is half used get their
        next one while space is left."""
        out: list[Issued] = []
        for peer, r in self._ranks.items():   # ranks that just ran out of open credits queue up
            if r.wanted > 0 and not r.open() and peer not in self._waiting:
                self._waiting.append(peer)
        busy = sum(1 for r in self._ranks.values() if r.wanted > 0)
        cap = fair_cap(self.ring.size, busy, open_per_rank=OPEN_PER_RANK)
        while self._waiting:
            peer = self._waiting[0]
            head = self._ranks.get(peer)
            if head is None or head.wanted <= 0 or head.open():
                self._waiting.pop(0)
                continue
            got = self._give(peer, head, cap)
            if got is None:
                return out
            self._waiting.pop(0)
            out.append(got)
        for peer, r in self._ranks.items():
            opened = r.open()
            if (r.wanted > 0 and 0 < len(opened) < OPEN_PER_RANK
                    and 2 * opened[-1].claimed_bytes >= opened[-1].region.nbytes):
                got = self._give(peer, r, cap)
                if got is not None:
                    out.append(got)
        return out

    def _give(self, peer: Peer, r: _Rank, cap: int) -> Issued | None:
        n = min(credit_target(r.wanted, floor=self.floor, cap=cap, align=self.ring.align), self.ring.size)
        if not self.ring.fits_now(n):
            return None
        region = self.ring.allocate(n)
        assert isinstance(region, Region) and self.ring.is_free(region)
        c = _Credit(id=r.next_id, peer=peer, region=region)
        r.next_id += 1
        r.credits[c.id] = c
        return Issued(peer=peer, credit=c.id, start=region.start, nbytes=region.nbytes)

    def unacknowledged(self, peer: Peer) -> list[Issued]:
        """Open credits of `peer` no write used yet: their CreditGrant may have been lost, so
        the caller sends them again (a rank takes a repeated grant as a duplicate)."""
        r = self._ranks.get(peer)
        return [] if r is None else [Issued(peer=peer, credit=c.id, start=c.region.start, nbytes=c.region.nbytes)
                                     for c in r.open() if not c.spans]

    # -- writes -----------------------------------------------------------------------------
    def claim(self, peer: Peer, start: int, nbytes: int, room: int, session: int) -> Claim:
        """Check a staged write of `peer` at linear `start` against the credits given to it."""
        r = self._ranks.get(peer)
        c = None if r is None else next((c for c in r.credits.values() if c.contains(start, nbytes)), None)
        if c is None or nbytes <= 0 or c.poisoned:
            return Claim(verdict=ClaimVerdict.OUTSIDE, reason=f"write of {nbytes} bytes at ring position {start} from "
                         f"{peer} is not inside a credit it holds")
        span = CreditSpan(credit=c.id, start=start, nbytes=nbytes)
        i = bisect.bisect_left(c.spans, (start, start + nbytes))
        if i < len(c.spans) and c.spans[i] == (start, start + nbytes) and c.rooms[start] == (room, session):
            return Claim(verdict=ClaimVerdict.DUPLICATE, span=span)
        if (i < len(c.spans) and c.spans[i][0] < start + nbytes) or (i > 0 and c.spans[i - 1][1] > start):
            return Claim(verdict=ClaimVerdict.OVERLAP, reason=f"write of {nbytes} bytes at ring position {start} from "
                         f"{peer} overlaps another write into its credit {c.id}")
        if c.state is CreditState.RETURNED and all(w.start != start for w in c.named):
            return Claim(verdict=ClaimVerdict.TOO_LATE, reason=f"write at ring position {start} from {peer} is not "
                         f"among the writes its returned credit {c.id} named")
        c.spans.insert(i, (start, start + nbytes))
        c.rooms[start] = (room, session)
        c.live.add(start)
        self.wrote(peer, room, session, nbytes)
        return Claim(verdict=ClaimVerdict.OK, span=span)

    def wrote(self, peer: Peer, room: int, session: int, nbytes: int) -> None:
        """`nbytes` of the room's demand arrived (claim calls it; the caller does for a write
        into a granted region)."""
        r = self._ranks.get(peer)
        left = None if r is None else r.demand.get((room, session))
        if r is not None and left is not None:
            r.demand[(room, session)] = max(0, left - nbytes)

    def release(self, peer: Peer, span: CreditSpan) -> bool:
        """An accepted write is done with: scattered, or dropped with its room. True when the
        watermark moved."""
        r = self._ranks.get(peer) or self._orphans.get(peer)
        c = None if r is None else r.credits.get(span.credit)
        if c is None or span.start not in c.live:
            raise KeyError(f"no accepted write of {peer} at {span.start} in credit {span.credit}")
        c.live.discard(span.start)
        return self._close_settled()

    # -- returns and losses -----------------------------------------------------------------
    def on_return(self, peer: Peer, credit: int, writes: list[WriteRef]) -> ReturnResult:
        """`peer` gives back `credit`, naming every write it made into it that completed."""
        r = self._ranks.get(peer)
        c = None if r is None else r.credits.get(credit)
        if c is None:   # closed already (a repeated return), or never given: nothing of ours
            return ReturnResult(ok=True)
        if c.state is CreditState.RETURNED:
            same = tuple(sorted(writes, key=lambda w: w.start)) == c.named
            return ReturnResult(ok=same, reason="" if same else f"credit {credit} returned twice with different writes")
        spans = sorted((w.start, w.start + w.nbytes) for w in writes)
        rooms = frozenset((w.room, w.session) for w in writes) | frozenset(c.rooms.values())
        bad = [w for w in writes if w.nbytes <= 0 or not c.contains(w.start, w.nbytes)]
        bad += [w for w in writes if w.start in c.rooms and c.rooms[w.start] != (w.room, w.session)]
        overlap = any(a[1] > b[0] for a, b in zip(spans, spans[1:]))
        if bad or overlap:
            c.poisoned = True
            return ReturnResult(ok=False, rooms=rooms, reason=f"{peer} returned credit {credit} "
                                f"[{c.region.start}, +{c.region.nbytes}) naming writes outside it, overlapping, or "
                                f"of other rooms than their tags: {bad or spans}")
        c.state = check_move(c.state, CreditState.RETURNED)
        c.named = tuple(sorted(writes, key=lambda w: w.start))
        if r is not None and not writes and not c.spans:
            r.paused = True
        return ReturnResult(ok=True, rooms=rooms, freed=self._close_settled())

    def peer_lost(self, peer: Peer) -> bool:
        """`peer` is gone and none of its writes can land any more: every credit of it closes
        (its accepted writes still waiting for a scatter keep theirs until released)."""
        r = self._ranks.pop(peer, None)
        if peer in self._waiting:
            self._waiting.remove(peer)
        if r is None:
            return False
        moved = False
        for c in r.credits.values():
            if c.state is CreditState.OPEN:
                c.state = check_move(c.state, CreditState.RETURNED)
            c.named = ()
            c.poisoned = False
            if c.live:    # keep it, under a rank nobody can write as, until its scatters end
                self._orphans.setdefault(peer, _Rank()).credits[c.id] = c
            else:
                moved |= self._free(c)
        return moved

    def _settled(self, c: _Credit, live_rooms: set[tuple[int, int]]) -> bool:
        if c.state is not CreditState.RETURNED or c.poisoned or c.live:
            return False
        return all(w.start in c.rooms or (w.room, w.session) not in live_rooms for w in c.named)

    def _close_settled(self) -> bool:
        live_rooms = {k for r in self._ranks.values() for k in r.demand}
        moved = False
        for ranks in (self._ranks, self._orphans):
            for peer, r in list(ranks.items()):
                for c in list(r.credits.values()):
                    if self._settled(c, live_rooms):
                        moved |= self._free(c)
                        del r.credits[c.id]
                if ranks is self._orphans and not r.credits:
                    del ranks[peer]
        return moved

    def _free(self, c: _Credit) -> bool:
        c.state = check_move(c.state, CreditState.CLOSED)
        return self.ring.free(c.region) is not None
