"""Whether a prefill rank can serve the decode rank whose Hello it got, decided without sockets.

A decode rank connects with one Hello (messages.py): its layout summary, its PP stage, the
memory it offers to be written (its KV cache, its staging ring, its state pools, each with its
memory kind), its backend and whether it checks digests. `admit_hello` compares that with what
this prefill rank is (`PrefillFacts`) and returns the decode rank's stage and every reason it
cannot be served; the engine's shell (engine/prefill_side.py) then connects the backend, which
may add one more reason, and answers with a HelloAck that names them all.

Invariant: a Hello is admitted (no problems) only if every byte this rank would write has a
place of the same geometry at the decode rank, in memory this rank's backend can write.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..layout import LayoutSummary
from .messages import Hello
from .pool_parts import writers_mismatch
from .stage_mapping import DecodeStage, decode_stage_of
from .token_mapping import check_dcp_rank

#: The names a rank's registered regions go by (regions.py builds them; the reasons below name them).
KV_REGION = "kv"


def pool_region_name(pool: str) -> str:
    return f"pool {pool!r}"


@dataclass(frozen=True, kw_only=True)
class PrefillFacts:
    """What a prefill rank compares a decode rank's Hello with."""

    summary: LayoutSummary            # its layout summary (pools included)
    tp_size: int
    total_kv_heads: int
    mla: bool
    num_layers: int                   # the model's
    stage: range                      # the model layers of its PP stage (every layer without PP)
    draft_layers: int = 0             # draft entries it writes as layers after the model's last (KVLayout.draft_layers)
    verify: bool                      # end-to-end digests on here
    backend: str                      # "nixl" or "mooncake"
    memory_kinds: tuple[str, ...]     # the memory kinds its backend writes into ("DRAM", "VRAM")


@dataclass(frozen=True)
class Admission:
    """The decode rank's PP stage (None: no PP there) and why it cannot be served (empty: it can)."""

    stage: DecodeStage | None
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems


def admit_hello(msg: Hello, me: PrefillFacts) -> Admission:
    """Every reason this prefill rank cannot write to the decode rank that sent `msg`: a stage
    outside the model, a layout or pool geometry that differs, pools no prefill rank could write
    whole, digests on one side only, another backend, memory its backend cannot write into."""
    stage, problems = decode_stage_of(pp_size=msg.pp_size, tp_size=msg.tp_size, rank=msg.tp_rank,
                                      stage_start=msg.stage_start, stage_stop=msg.stage_stop,
                                      num_layers=me.num_layers, draft_layers=me.draft_layers)
    theirs = stage.model_layers(me.num_layers) if stage is not None else range(me.num_layers)
    shared = range(max(me.stage.start, theirs.start), min(me.stage.stop, theirs.stop))
    problems += me.summary.mismatches(msg.layout, shared)
    dcp = check_dcp_rank(msg.dcp_size, msg.dcp_rank, msg.tp_size, msg.tp_rank % msg.tp_size if msg.tp_size > 0 else 0)
    if dcp:   # a pairing of two well-formed DCP groups is judged per request (PrefillRoom.add_meta)
        problems.append(f"decode context parallel: {dcp}")
    if not problems and me.summary.pools:
        problems += [p for p in [writers_mismatch(me.summary.pools, me.tp_size, msg.tp_size, me.total_kv_heads,
                                                  me.mla)] if p]
    if msg.verify != me.verify:
        problems.append(f"verify: {'on' if me.verify else 'off'} here vs {'on' if msg.verify else 'off'} at "
                        f"peer (EngineConfig(verify=...) / KVSTAGE_VERIFY must agree on both sides)")
    if msg.backend != me.backend:
        problems.append(f"backend: {me.backend!r} here vs {msg.backend!r} at peer")
    problems += unwritable_peer_kinds(msg.kv.mem_kind, msg.ring.mem_kind if msg.ring is not None else None,
                                      {p.name: p.mem_kind for p in msg.kv.pools}, me.memory_kinds, me.backend)
    return Admission(stage, tuple(problems))


def unwritable_peer_kinds(
    kv_kind: str, ring_kind: str | None, pool_kinds: Mapping[str, str], kinds: Sequence[str], backend: str
) -> list[str]:
    """Which of a decode rank's advertised regions this writer's backend cannot write into."""
    named = [(KV_REGION, kv_kind)] + ([("staging ring", ring_kind)] if ring_kind is not None else [])
    named += [(pool_region_name(n), k) for n, k in sorted(pool_kinds.items())]
    return [
        f"the peer's {name} region is {kind} memory, which this {backend} build cannot write into "
        f"(it handles {', '.join(kinds)})"
        for name, kind in named
        if kind not in kinds
    ]
