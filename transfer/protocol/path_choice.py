"""Which path a request takes, staged or direct, from what each path is predicted to cost. Pure.

The decode rank decides per room (RoomMeta.staged), once its writers are connected. Inputs:

- each writer's `WriterCosts`, measured at that prefill rank's start and sent in its HelloAck:
  what one backend write, one range and one byte cost for the memory kind it was measured on,
  and how many bytes per second its gather moves into a staging buffer;
- this decode rank's own scatter rate (bytes per second from its ring into its KV cache);
- the room's `RequestShape`: bytes, writers, and how many ranges each path's writes hold.

Model (docs/path_choice.md): a write costs `per_write_s + ranges * per_range_s + bytes *
per_byte_s`. Direct: each writer posts its ranges in `direct_writes` writes; writers run in
parallel, so the slowest writer's time counts. Staged: `pieces` pieces flow through three
stages (gather at the writer, one write of one range per writer, scatter here) that overlap
from one piece to the next, so it costs one piece through all three stages plus the slowest
stage for every further piece.

Invariants: a forced path is never overridden; staged is chosen only where the ranks can stage
(`can_stage`); without costs from every writer and a scatter rate here, the fixed rule decides
(staged iff the TP sizes differ), as before the model existed; with costs, the fixed rule's path
is left only for one predicted `MARGIN` times faster; predicted times are None exactly when no
prediction was made.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import msgspec
import numpy as np

from ...wire import prebuild_struct_info
from .kinds import StrKind

PATH_ENV = "KVSTAGE_PATH"
# the fixed rule's path is kept unless the other one is predicted this many times faster: the
# costs are measured once, in a fraction of a second, and a close call is not worth a flip
MARGIN = 1.25


class PathMode(StrKind):
    """The configured choice (EngineConfig.path, env KVSTAGE_PATH)."""

    AUTO = "auto"        # the cheaper predicted path (the fixed rule without costs)
    STAGED = "staged"    # always staged (needs staging on both sides, not MLA)
    DIRECT = "direct"    # always direct


class PathVerdict(StrKind):
    STAGED = "staged"
    DIRECT = "direct"


class PathReason(StrKind):
    """Why the verdict (the `reason` label of kvstage_path_choices_total)."""

    FORCED = "forced"            # the configuration named the path
    PREDICTED = "predicted"      # the lower predicted time
    CANNOT_STAGE = "cannot_stage"   # no ring here, a writer without staging, or MLA
    FIXED_RULE = "fixed_rule"    # no costs (calibration off or failed): staged iff TP sizes differ


class WriteCost(msgspec.Struct, frozen=True, kw_only=True):
    """What one backend write costs, measured for one (backend, memory kind)."""

    backend: str
    mem_kind: str                 # "DRAM" or "VRAM": the memory the probe wrote to and from
    per_write_s: float            # fixed cost of one write (post to completion of an empty one)
    per_range_s: float            # each range (descriptor) of a write
    per_byte_s: float             # each byte


class WriterCosts(msgspec.Struct, frozen=True, kw_only=True):
    """A prefill rank's measured costs, sent in its HelloAck."""

    writes: list[WriteCost]
    gather_bytes_per_s: float     # into a staging buffer, its transfer workers' kernel

    def write_cost(self, mem_kind: str) -> WriteCost | None:
        """The cost of writes to `mem_kind` (the decode rank's KV memory); None if not measured."""
        for w in self.writes:
            if w.mem_kind == mem_kind:
                return w
        return None


@dataclass(frozen=True, kw_only=True)
class RequestShape:
    """What one room moves to this decode rank, per path."""

    nbytes: int               # KV bytes landing at this decode rank (both paths)
    writers: int              # prefill ranks writing them (in parallel)
    direct_ranges: int        # ranges of the direct path's writes, all writers together
    direct_writes: int        # backend writes of the direct path, per writer
    pieces: int               # staged: pieces (each one write of one range per writer)


@dataclass(frozen=True)
class PathChoice:
    """The verdict, why, and the predicted seconds of both paths (None: not predicted)."""

    verdict: PathVerdict
    reason: PathReason
    staged_s: float | None = None
    direct_s: float | None = None

    @property
    def staged(self) -> bool:
        return self.verdict is PathVerdict.STAGED

    @property
    def predicted_s(self) -> float | None:
        """The predicted time of the path taken."""
        return self.staged_s if self.staged else self.direct_s


def write_seconds(cost: WriteCost, writes: int, ranges: int, nbytes: int) -> float:
    return writes * cost.per_write_s + ranges * cost.per_range_s + nbytes * cost.per_byte_s


def direct_seconds(shape: RequestShape, cost: WriteCost) -> float:
    """The direct path: each writer its share of the ranges and bytes, writers in parallel."""
    w = max(1, shape.writers)
    return write_seconds(cost, shape.direct_writes, math.ceil(shape.direct_ranges / w), math.ceil(shape.nbytes / w))


def staged_seconds(shape: RequestShape, cost: WriteCost, gather_bps: float, scatter_bps: float) -> float:
    """The staged path: pieces pipelined through gather (writers in parallel), one write of one
    range per writer and piece, and the scatter of all writers' parts here."""
    n = max(1, shape.pieces)
    w = max(1, shape.writers)
    piece = shape.nbytes / n
    gather = piece / w / gather_bps
    write = write_seconds(cost, 1, 1, math.ceil(piece / w))
    scatter = piece / scatter_bps
    return gather + write + scatter + (n - 1) * max(gather, write, scatter)


def fixed_rule(can_stage: bool, tp_differ: bool) -> PathChoice:
    """The rule before costs were measured: staged iff the ranks can stage and TP sizes differ."""
    if not can_stage:
        return PathChoice(PathVerdict.DIRECT, PathReason.CANNOT_STAGE)
    return PathChoice(PathVerdict.STAGED if tp_differ else PathVerdict.DIRECT, PathReason.FIXED_RULE)


def choose_path(*, mode: PathMode, can_stage: bool, tp_differ: bool, shape: RequestShape,
                writers: list[WriterCosts | None], mem_kind: str, scatter_bytes_per_s: float | None,
                margin: float = MARGIN) -> PathChoice:
    """The path of one room. `writers`: each writer's costs (None: it measured none);
    `mem_kind`: this decode rank's KV memory kind, whose write costs count. A forced STAGED
    with `can_stage` false is the caller's error (checked at start or refused at plan time):
    it raises ValueError here rather than move the bytes another way."""
    if mode is PathMode.DIRECT:
        return PathChoice(PathVerdict.DIRECT, PathReason.FORCED)
    if mode is PathMode.STAGED:
        if not can_stage:
            raise ValueError(f"{PATH_ENV}=staged (EngineConfig.path) but these ranks cannot stage")
        return PathChoice(PathVerdict.STAGED, PathReason.FORCED)
    if not can_stage:
        return PathChoice(PathVerdict.DIRECT, PathReason.CANNOT_STAGE)
    costs = [c.write_cost(mem_kind) if c is not None else None for c in writers]
    if not costs or scatter_bytes_per_s is None or scatter_bytes_per_s <= 0 or any(c is None for c in costs):
        return fixed_rule(can_stage, tp_differ)
    staged = max(staged_seconds(shape, c, wc.gather_bytes_per_s, scatter_bytes_per_s)
                 for c, wc in zip(costs, writers, strict=True) if c is not None and wc is not None)
    direct = max(direct_seconds(shape, c) for c in costs if c is not None)
    if tp_differ:   # the fixed rule stages: direct must be clearly faster
        verdict = PathVerdict.DIRECT if direct * margin < staged else PathVerdict.STAGED
    else:
        verdict = PathVerdict.STAGED if staged * margin < direct else PathVerdict.DIRECT
    return PathChoice(verdict, PathReason.PREDICTED, staged_s=staged, direct_s=direct)


def fit_write_cost(backend: str, mem_kind: str, samples: list[tuple[int, int, float]]) -> WriteCost:
    """The per-write, per-range and per-byte costs that best explain measured writes, each
    (ranges, bytes, seconds), by non-negative least squares over the three unknowns. Needs
    writes that differ in ranges at equal bytes and in bytes at equal ranges (the probe
    makes such), else the split is arbitrary; a negative cost (noise) is clipped to 0 and the
    others refitted. Raises ValueError on fewer than 3 samples or a
    time that is not finite and positive."""
    if len(samples) < 3:
        raise ValueError(f"fitting write costs needs 3 or more writes, got {len(samples)}")
    if any(not (math.isfinite(t) and t > 0) or r < 1 or b < 0 for r, b, t in samples):
        raise ValueError(f"a probe write with no ranges or a time that is not finite and positive: {samples}")
    a = np.array([[1.0, r, b] for r, b, _ in samples])
    y = np.array([t for _, _, t in samples])
    scale = a.max(axis=0)                      # columns of similar size: a well-conditioned fit
    keep = [0, 1, 2]
    x = np.zeros(3)
    while keep:
        sol = np.linalg.lstsq(a[:, keep] / scale[keep], y, rcond=None)[0] / scale[keep]
        if (sol >= 0).all():
            x[keep] = sol
            break
        keep = [k for k, v in zip(keep, sol, strict=True) if v >= 0] if (sol >= 0).any() else []
    return WriteCost(backend=backend, mem_kind=mem_kind, per_write_s=float(x[0]), per_range_s=float(x[1]),
                     per_byte_s=float(x[2]))


prebuild_struct_info(globals())  # last: every Struct above is defined (see kvstage.wire)
