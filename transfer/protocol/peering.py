"""Decode side: which prefill ranks a request needs and when the engine's view of them is
usable, decided without sockets.

A decode rank learns the prefill engine's ranks from the bootstrap server, connects to the ones
a request needs, and plans the request once all of them answered. These functions make each of
those decisions from plain inputs; the engine's decode side carries them out.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..layout import KVLayout
from .head_mapping import HeadMapping, compute_assignments
from .kinds import Role, StrKind
from .page_shards import ShardSide, pairing_problem
from .routing import PeerState
from .stage_mapping import sources_of


@dataclass(frozen=True)
class NeededRanks:
    writers: list[int]      # prefill ranks that write this decode rank's heads
    notices: list[int]      # prefill ranks that only need to hear about the request
    mapping: HeadMapping    # of one PP stage (every stage has the same TP size and head split)
    layers: dict[int, range] = field(default_factory=dict)   # needed rank -> the layers it holds
    draft_pools: int = 0    # draft entries of its own geometry the engine writes (as pools, draft_kv.py)

    @property
    def all(self) -> list[int]:
        return self.writers + self.notices


def needed_ranks(prefill_tp: int, layout: KVLayout, stages: tuple[range, ...] | None = None,
                 draft_pools: int = 0, page_shards: int = 1) -> NeededRanks:
    """The prefill ranks a decode rank deals with. `stages`: each PP stage's layers, in stage
    order (None: one stage of every layer); rank s * prefill_tp + p is TP rank p of stage s,
    and each stage's ranks write the decode rank's heads for their own layers. A decode rank
    with PP deals only with the stages overlapping its own, each for the overlap
    (stage_mapping.sources_of). Raises ValueError when the two TP sizes cannot share the heads
    or the stages do not hold every layer of this rank's stage. `page_shards` > 1: the prefill
    shards its pages over its TP group (page_shards.py): every one of its ranks writes this rank,
    and a pairing kvstage does not serve raises ValueError naming both sides."""
    problem = pairing_problem(
        ShardSide(tp_size=prefill_tp, mla=layout.mla, page_shards=page_shards, pp_size=len(stages or (0,)),
                  draft_pools=draft_pools),
        ShardSide(tp_size=layout.tp_size, mla=layout.mla, page_shards=layout.page_shards, pp_size=layout.pp_size,
                  dcp_size=layout.dcp_size))
    if problem:
        raise ValueError(problem)
    mapping = compute_assignments(prefill_tp, layout.tp_size, layout.total_kv_heads, layout.mla, page_shards)
    writers, notices = mapping.prefill_peers_of(layout.tp_rank)
    stages = stages if stages is not None else (range(layout.num_layers),)
    # decode PP: only the prefill stages holding some of this rank's stage, each for the overlap
    # (the last stage's draft entries as far as the prefill writes them: decode-only speculation
    # leaves the decode's further ones unwritten)
    mine = range(layout.layers.start, min(layout.layers.stop, max(stages[-1].stop, layout.num_layers)))
    held = sources_of(stages, mine) if layout.pp_size > 1 else dict(enumerate(stages))
    layers = {s * prefill_tp + p: stage for s, stage in held.items() for p in writers + notices}
    if layout.layers.stop < layout.num_layers:   # a decode stage before the last: the draft is not here
        draft_pools = 0
    return NeededRanks([s * prefill_tp + w for s in held for w in writers],
                       [s * prefill_tp + n for s in held for n in notices], mapping, layers,
                       draft_pools)


# What a PP prefill rank registers besides its layout summary (bootstrap RankInfo.layout):
# its engine's PP size and its stage's layers. Its registered tp_size and tp_rank are the
# engine's rank count and its rank (KVLayout.ranks, KVLayout.rank). Every rank also registers
# how many ways its engine shards its KV pages (KVLayout.page_shards; absent: 1).
PP_SIZE, STAGE_START, STAGE_STOP, PAGE_SHARDS = "pp_size", "stage_start", "stage_stop", "page_shards"
# From its layout summary: the draft's entries and geometry (LayoutSummary.draft_*), compared
# with the target's total_kv_heads and head_dim to tell a draft of its own geometry.
DRAFT_LAYERS, DRAFT_HEADS, DRAFT_HEAD_DIM = "draft_layers", "draft_kv_heads", "draft_head_dim"


def stage_record(layout: KVLayout) -> dict[str, int]:
    assert layout.stage is not None, "set by KVLayout"
    return {PP_SIZE: layout.pp_size, STAGE_START: layout.stage.start, STAGE_STOP: layout.stage.stop,
            PAGE_SHARDS: layout.page_shards}


@dataclass(frozen=True)
class PrefillStages:
    """A prefill engine's pipeline: the TP size of each stage and each stage's layers (the
    last stage's followed by the draft KV entries the engine writes, if any)."""

    tp_size: int
    layers: tuple[range, ...]    # by PP rank
    draft_pools: int = 0         # draft entries of their own geometry, written as pools (draft_kv.py)
    page_shards: int = 1         # how many ways the engine shards its KV pages (page_shards.py)


def read_stages(engine_id: str, records: list[Any], num_layers: int) -> PrefillStages:
    """The PP stages of a prefill engine from its rank records (sorted by rank, every rank
    there), checked to tile the model's `num_layers` layers in order; the last stage's range
    goes on over the engine's draft KV entries of the target's geometry (layout summary
    `draft_layers`; a draft of its own geometry is `draft_pools`, moved as pools). Raises
    ValueError saying which stage is wrong."""
    def field_of(rec: Any, name: str, default: int) -> int:
        return int(rec.layout.get(name, default)) if isinstance(getattr(rec, "layout", None), dict) else default

    ranks = records[0].tp_size
    pp = field_of(records[0], PP_SIZE, 1)
    if pp <= 0 or ranks % pp or any(field_of(r, PP_SIZE, 1) != pp for r in records):
        raise ValueError(f"prefill engine {engine_id}: its ranks disagree on the PP size or {ranks} ranks are not "
                         f"{pp} stages of equal TP size")
    tp = ranks // pp
    stages: list[range] = []
    for s in range(pp):
        seen = {range(field_of(r, STAGE_START, 0), field_of(r, STAGE_STOP, num_layers))
                for r in records[s * tp:(s + 1) * tp]}
        if len(seen) != 1:
            raise ValueError(f"prefill engine {engine_id}: the ranks of PP stage {s} disagree on its layers: "
                             f"{sorted((x.start, x.stop) for x in seen)}")
        stages.append(seen.pop())
    at = 0
    for s, stage in enumerate(stages):
        if stage.start != at or stage.stop <= stage.start or stage.stop > num_layers:
            raise ValueError(f"prefill engine {engine_id}: its PP stages' layers "
                             f"{', '.join(f'[{x.start}, {x.stop})' for x in stages)} do not tile the model's "
                             f"{num_layers} layers (stage {s} should start at layer {at})")
        at = stage.stop
    if at != num_layers:
        raise ValueError(f"prefill engine {engine_id}: its PP stages' layers end at layer {at}, the model has "
                         f"{num_layers}")
    # the draft lives on the last stage (KVLayout): its ranks agree on it, the others have none
    drafts = {field_of(r, DRAFT_LAYERS, 0) for r in records[(pp - 1) * tp:]}
    if len(drafts) != 1 or min(drafts) < 0:
        raise ValueError(f"prefill engine {engine_id}: its ranks disagree on the draft KV entries: {sorted(drafts)}")
    early = sorted({d for r in records[:(pp - 1) * tp] if (d := field_of(r, DRAFT_LAYERS, 0))})
    if early:
        raise ValueError(f"prefill engine {engine_id}: ranks of PP stages before the last register draft KV "
                         f"entries ({early}); the draft belongs to the last stage")
    draft = drafts.pop()
    shards = {field_of(r, PAGE_SHARDS, 1) for r in records}
    if len(shards) != 1 or min(shards) < 1:
        raise ValueError(f"prefill engine {engine_id}: its ranks disagree on how many ways its KV pages are "
                         f"sharded: {sorted(shards)}")
    rec = records[-1]
    own = draft and (field_of(rec, DRAFT_HEADS, 0), field_of(rec, DRAFT_HEAD_DIM, 0)) != (
        field_of(rec, "total_kv_heads", 0), field_of(rec, "head_dim", 0))
    if not own:
        stages[-1] = range(stages[-1].start, stages[-1].stop + draft)
    return PrefillStages(tp, tuple(stages), draft if own else 0, shards.pop())


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
    if not records or any(r.role != Role.PREFILL for r in records):
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
                      if r.get("role") == Role.PREFILL and r.get("dp_rank", 0) == dp_rank and not r.get("stale")})
    if len(engines) == 1:
        return DpEngine(DpMatch.FOUND, engine_id=engines[0])
    if not engines:
        return DpEngine(DpMatch.NONE, reason=f"no live prefill engine with DP rank {dp_rank} is registered")
    return DpEngine(DpMatch.AMBIGUOUS, reason=f"prefill engines {', '.join(engines)} all claim DP rank {dp_rank}")
