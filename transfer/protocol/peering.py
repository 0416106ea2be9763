"""Decode side: which prefill ranks a request needs and when the engine's view of them is
usable, decided without sockets.

A decode rank learns the prefill engine's ranks from the bootstrap server, connects to the ones
a request needs, and plans the request once all of them answered. These functions make each of
those decisions from plain inputs; the engine's decode side carries them out.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..layout import KVLayout
from .head_mapping import HeadMapping, compute_assignments
from .kinds import StrKind
from .routing import PeerState


@dataclass(frozen=True)
class NeededRanks:
    writers: list[int]      # prefill ranks that write this decode rank's heads
    notices: list[int]      # prefill ranks that only need to hear about the request
    mapping: HeadMapping

    @property
    def all(self) -> list[int]:
        return self.writers + self.notices


def needed_ranks(prefill_tp: int, layout: KVLayout) -> NeededRanks:
    """Raises ValueError when the two TP sizes cannot share the heads."""
    mapping = compute_assignments(prefill_tp, layout.tp_size, layout.total_kv_heads, layout.mla)
    writers, notices = mapping.prefill_peers_of(layout.tp_rank)
    return NeededRanks(list(writers), list(notices), mapping)


class LookupState(StrKind):
    """Where the decode side's view of a prefill engine stands (None: never looked up)."""

    LOOKUP = "lookup"        # a lookup is in flight
    READY = "ready"
    FAILED = "failed"


@dataclass(frozen=True)
class Lookup:
    """What the decode side makes of the bootstrap server's answer about one prefill engine."""

    state: LookupState
    records: list[Any]       # READY: the engine's rank records sorted by rank; empty otherwise
    error: str = ""          # FAILED: why


def read_lookup(engine_id: str, records: list[Any] | None, error: str | None) -> Lookup:
    """The bootstrap server's answer (its records, or why the lookup failed) -> a Lookup."""
    if error is not None:
        return Lookup(LookupState.FAILED, [], error)
    if not records or any(r.role != "prefill" for r in records):
        return Lookup(LookupState.FAILED, [], f"engine {engine_id} is not a prefill engine")
    return Lookup(LookupState.READY, sorted(records, key=lambda r: r.tp_rank))


def records_stale(incarnations: Iterable[int], gone: Iterable[int] | set[int], replaced: Iterable[int] | set[int]) -> bool:
    """The records name a rank we lost or saw replaced: the server may know better now."""
    return any(i in gone or i in replaced for i in incarnations)


def needs_lookup(state: str | None, stale: bool) -> bool:
    """Look the engine up (again) when never looked up, when the last lookup failed, or when a
    ready view names a lost incarnation. A lookup in flight is never repeated."""
    return state is None or state == LookupState.FAILED or (state == LookupState.READY and stale)


def reuse_peer(known_incarnation: int | None, known_state: str | None, record_incarnation: int) -> bool:
    """An existing connection serves the record when it is the same incarnation and not lost."""
    return known_incarnation == record_incarnation and known_state not in (None, PeerState.LOST)


class Gate(StrKind):
    """Whether a request can be planned, from its needed ranks' connection states."""

    GO = "go"                # every needed rank is connected
    WAIT = "wait"            # some are still connecting
    REJECTED = "rejected"    # one refused us


@dataclass(frozen=True)
class GateVerdict:
    gate: Gate
    rejected_by: int | None = None   # REJECTED: the needed rank that refused us


def plan_gate(states: dict[int, str]) -> GateVerdict:
    """Given each needed rank's connection state: REJECTED (with the first rank that refused us),
    WAIT while any is still connecting, GO when all are connected."""
    for rank, state in states.items():
        if state == PeerState.REJECTED:
            return GateVerdict(Gate.REJECTED, rank)
    if any(s != PeerState.CONNECTED for s in states.values()):
        return GateVerdict(Gate.WAIT)
    return GateVerdict(Gate.GO)


def fallback_reason(has_ring: bool, mla: bool, prefill_tp: int, decode_tp: int,
                    non_staging_writers: list[int]) -> str:
    """Why a request asked for staging goes the direct path (for a one-time log line)."""
    if not has_ring:
        return "this rank has no staging ring"
    if mla:
        return "the model is MLA (the latent is replicated: direct whole pages)"
    if prefill_tp == decode_tp:
        return "TP sizes are equal (direct whole pages)"
    return "staging is off at prefill rank(s) " + ", ".join(str(r) for r in non_staging_writers)


class DpMatch(StrKind):
    """How many live prefill engines claim a data-parallel rank."""

    FOUND = "found"          # exactly one
    NONE = "none"            # none yet: the caller may poll again
    AMBIGUOUS = "ambiguous"  # several: a configuration error, waiting cannot help


@dataclass(frozen=True)
class DpEngine:
    match: DpMatch
    engine_id: str = ""      # FOUND: the engine serving the DP rank
    reason: str = ""         # NONE or AMBIGUOUS: why there is none


def engine_for_dp(rows: list[dict[str, Any]], dp_rank: int) -> DpEngine:
    """Which prefill engine serves data-parallel rank `dp_rank` at a rendezvous server, from its
    status rows: FOUND with its engine id, else NONE or AMBIGUOUS with why."""
    engines = sorted({r["engine_id"] for r in rows
                      if r.get("role") == "prefill" and r.get("dp_rank", 0) == dp_rank and not r.get("stale")})
    if len(engines) == 1:
        return DpEngine(DpMatch.FOUND, engine_id=engines[0])
    if not engines:
        return DpEngine(DpMatch.NONE, reason=f"no live prefill engine with DP rank {dp_rank} is registered")
    return DpEngine(DpMatch.AMBIGUOUS, reason=f"prefill engines {', '.join(engines)} all claim DP rank {dp_rank}")
