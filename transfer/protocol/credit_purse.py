"""The prefill rank's side of ring credits towards one decode rank: the credits it holds, where
its next staged write goes, and which credits it gives back (see credits.py).

Contract with the caller (the prefill engine, or the simulator):

- `on_grant` for every CreditGrant; a MISMATCH verdict means the decode rank's credit does not
  fit its ring or overlaps one already held: the caller fails the requests towards that rank.
- `take(nbytes, room, session)` when a single-writer staged write's data is gathered: the place
  to write it, or None, and then the write goes the grant path (AllocRequest) as without
  credits. A None also retires every open credit (it will be given back once its writes
  completed), so a rank that waits for a grant holds no open credit.
- `take_all(sizes, room, session)`: the writes of one chunk, each placed as `take` would, or
  none of them (a chunk whose remainder could not be numbered apart, credit_writes.py).
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
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .credits import CreditSpan, CreditState, GrantVerdict, WriteRef, check_move


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
