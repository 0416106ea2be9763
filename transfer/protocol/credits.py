"""Ring credits: the words both sides of a staged transfer share about a standing share of a
decode rank's staging ring.

A *credit* is one ring region (transfer/protocol/ring.py) the decode rank allocated for one prefill rank
(one incarnation) and handed to it ahead of any request (`CreditGrant`). The prefill rank cuts
its staged writes out of its credits in increasing order (a bump pointer, never reusing a byte
inside a credit), so a write goes out as soon as its data is gathered, without asking for ring
space. When a credit is used up, or the rank has nothing left to write to that decode rank, it
gives the credit back (`CreditReturn`), naming every write it made into it; the decode rank
frees the region once each of those writes was scattered or its request ended.

The rules, decided here and in decode/credits.py (decode) and prefill/credits.py (prefill):

- **Sizing** (`credit_target`): credits go where requests are. A rank with no staged request
  towards the decode rank gets no credit; one with requests gets what its requests still have
  to write, at least one piece (`floor`), at most a fair share of the ring among the ranks that
  have requests (`cap`), so 64 connected prefill ranks of which 2 are busy split the ring
  between those 2. A rank that gives a credit back unused gets none until another room of it
  starts (what it has left goes the grant path or waits for its data).
- **Issue only from free space**: a credit is handed out only where it can be written at once
  (`RingAllocator.fits_now`), never reserved ahead of the watermark: a credit never waits for
  another region to be freed, so holding one can never be part of a wait cycle.
- **One piece per connected rank**: the ring must hold at least one piece per connected prefill
  rank (`check_credit_config`), else every busy rank could not hold its floor at once.
- **Single-writer pieces only**: a piece whose region several prefill ranks fill (heterogeneous
  TP, prefill TP > decode TP) keeps the grant path: writers that take their parts out of their
  own credits, in their own orders, can each hold a part of a piece the other still has to
  write while their credits and the ring are full: a wait cycle
  (tests/unit/test_credit_rules.py builds one).
  A grant allocates all parts of a piece at once and has no such cycle.
- **Fallback**: a write that does not fit its rank's credits goes the grant path
  (AllocRequest / AllocGrant) exactly as without credits; of a chunk, the pieces after the
  first that does not fit go there together, as its remainder (prefill/credits.py).

Pure: no memory, no time; positions are linear ring positions as in ring.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from .kinds import StrKind


class CreditState(StrKind):
    """One credit's life: OPEN (the prefill rank may write into it), RETURNED (it said which
    writes it made and will make no more; the region waits for their scatters) and CLOSED (the
    region was freed). Moves only forward, along CREDIT_TRANSITIONS."""

    OPEN = "open"
    RETURNED = "returned"
    CLOSED = "closed"


CREDIT_TRANSITIONS: dict[CreditState, frozenset[CreditState]] = {
    CreditState.OPEN: frozenset({CreditState.RETURNED, CreditState.CLOSED}),   # CLOSED: its rank was lost
    CreditState.RETURNED: frozenset({CreditState.CLOSED}),
    CreditState.CLOSED: frozenset(),
}


def check_move(old: CreditState, new: CreditState) -> CreditState:
    """`new` when a credit in `old` may move there; raises on an illegal move."""
    if new not in CREDIT_TRANSITIONS[old]:
        raise ValueError(f"a credit cannot move from {old} to {new}")
    return new


class ClaimVerdict(StrKind):
    """What the decode rank makes of one staged write that names a credit position."""

    OK = "ok"                    # inside the writer's credit, overlapping no other write of it
    DUPLICATE = "duplicate"      # the same write again (a notification and its TagsAgain copy)
    OUTSIDE = "outside"          # not inside an open or returned credit of this writer
    OVERLAP = "overlap"          # shares a byte with another write into the same credit
    TOO_LATE = "too_late"        # its credit was returned without naming it


class GrantVerdict(StrKind):
    """What the prefill rank makes of one CreditGrant."""

    OK = "ok"
    DUPLICATE = "duplicate"      # the same grant again (retransmitted): changes nothing
    STALE = "stale"              # another epoch of the ring, or a credit already given back
    MISMATCH = "mismatch"        # does not fit the ring or overlaps a credit held: the peer is faulty


@dataclass(frozen=True, kw_only=True)
class CreditSpan:
    """A place in a credit: `nbytes` from linear ring position `start` of credit `credit`."""

    credit: int
    start: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.start + self.nbytes


@dataclass(frozen=True, kw_only=True)
class WriteRef:
    """One staged write into a credit, as its CreditReturn names it: where, and which use of
    which room it was for (so the decode rank stops waiting for it once that room ended)."""

    room: int
    session: int
    start: int
    nbytes: int


def credit_target(demand: int, *, floor: int, cap: int, align: int) -> int:
    """The bytes of the next credit of a rank whose requests still have `demand` bytes to
    write: 0 for an idle rank, else `demand` between one piece (`floor`) and its fair share
    (`cap`), rounded up to the ring's alignment."""
    if demand <= 0:
        return 0
    n = max(floor, min(demand, max(cap, floor)))
    return -(-n // align) * align


def fair_cap(ring_bytes: int, busy_ranks: int, *, open_per_rank: int = 2) -> int:
    """Each busy rank's share of the ring: it may hold `open_per_rank` credits at once (the
    next is issued before the current one is used up), so one credit is at most
    ring / (busy ranks * open_per_rank)."""
    return ring_bytes // max(1, busy_ranks * open_per_rank)


def check_credit_config(*, ring_bytes: int, piece_bytes: int, prefill_ranks: int) -> None:
    """Raises ValueError when the ring cannot hold one piece for each connected prefill rank,
    naming the options that set them."""
    if piece_bytes <= 0 or ring_bytes <= 0:
        raise ValueError(f"ring credits need a positive ring (ring_mb: {ring_bytes} bytes) and piece "
                         f"(staging_piece_mb: {piece_bytes} bytes)")
    if prefill_ranks * piece_bytes > ring_bytes:
        raise ValueError(f"the staging ring (ring_mb: {ring_bytes} bytes) cannot hold one piece "
                         f"(staging_piece_mb: {piece_bytes} bytes) for each of the {prefill_ranks} connected "
                         f"prefill ranks: raise ring_mb to at least {prefill_ranks * piece_bytes} bytes or lower "
                         "staging_piece_mb")
