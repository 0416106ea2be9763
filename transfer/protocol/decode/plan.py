"""Decode side: how a room from a prefill engine moves (staged or direct, piece sizes), decided
once its prefill ranks are connected. Pure.

A plan is immutable (a frozen dataclass of tuples and read-only maps), so the rooms of one
shape share one: a decode rank holds thousands of rooms in flight but meets few shapes
(prefill engine, TP pair, pages and piece sizes). `SharedPlans.intern` hands every room of a
shape the same plan object (docs/scale.md, "Memory per room")."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from types import MappingProxyType
from typing import Protocol

import msgspec
import numpy as np

from ...layout import KVLayout
from ..actions import PeerKey
from ..head_mapping import Assignment, HeadMapping
from ..kinds import FailureKind
from ..path_choice import PATH_ENV, PathChoice, PathMode, RequestShape, WriterCosts, choose_path, fixed_rule
from ..pieces import max_piece_pages


@dataclass(frozen=True, kw_only=True)
class PathInputs:
    """What the path choice of a room needs besides its pages (path_choice.choose_path):
    the configured mode, each writer's measured costs (None: it measured none), this decode
    rank's KV memory kind and scatter rate (None: not measured)."""

    mode: PathMode
    writers: tuple[WriterCosts | None, ...] = ()
    mem_kind: str = "DRAM"
    scatter_bytes_per_s: float | None = None


_NO_STAGES: Mapping[int, range] = MappingProxyType({})   # no PP: every writer writes every layer


@dataclass(frozen=True, kw_only=True, slots=True)
class RoomPlan:
    """Who writes this decode rank's part of a room, and how (decided when peers connected).

    Immutable, so rooms may share it (SharedPlans): `writer_layers` is kept as a read-only map,
    and `writer_bytes` / `writer_ranks` (derived: each writer's bytes per page, by TP rank, in
    the order of `writers`) are made once per plan, not per room."""

    writers: tuple[tuple[PeerKey, Assignment], ...]
    notices: tuple[PeerKey, ...] = ()             # prefill ranks told about the room, not writing
    staged: bool
    head_page_bytes: int                          # bytes of one head of one page, all layers, K and V
    num_layers: int = 0                           # KV entries the prefill writes: the model's layers and
                                                  # its draft entries (<= this rank's; 0: this rank's)
    max_piece_pages: int = 0                      # staged: largest piece of every entry (ring and buffers)
    piece_bytes: int = 0                          # staged: the cap on a writer's part of a piece (0: none
    ring_align: int = 1                           # beyond max_piece_pages) and the ring's alignment
    ring_epoch: int = 0
    prefill_tp: int = 0
    decode_tp: int = 0
    ring_size: int = 0                            # staged: the ring and the smallest writer buffer, which
    buffer_bytes: int = 0                         # the last piece's pool bytes must fit besides its pages
    writer_layers: Mapping[int, range] = field(default_factory=lambda: _NO_STAGES)   # writer rank -> its PP
                                                  # stage's layers (absent: every layer); read-only (a dict is copied)
    draft_pools: int = 0          # the prefill's draft entries of their own geometry (pools, draft_kv.py)
    can_stage: bool = False       # the staged path is possible (ring, writers' buffers, not MLA): piece
                                  # sizes are set, so for_pages may choose it for any TP sizes
    path: PathInputs | None = None   # the costs the choice per request weighs (None: `staged` as planned)
    choice: PathChoice | None = None  # the path this room's request took and why (for_pages)
    page_shards: int = 1          # > 1: the prefill shards its pages (page_shards.py): the writers share the
                                  # room's cells, each writing the pages it owns (direct only: MLA)
    writer_bytes: Mapping[int, int] = field(init=False, repr=False, compare=False)   # writer rank -> bytes per page
    writer_ranks: tuple[int, ...] = field(init=False, repr=False, compare=False)     # writer ranks, plan order

    def __post_init__(self) -> None:
        if type(self.writer_layers) is not MappingProxyType:
            object.__setattr__(self, "writer_layers", MappingProxyType(dict(self.writer_layers)) if self.writer_layers
                               else _NO_STAGES)
        object.__setattr__(self, "writer_ranks", tuple(p.tp_rank for p, _ in self.writers))
        object.__setattr__(self, "writer_bytes", MappingProxyType(
            {p.tp_rank: self.writer_page_bytes(a) for p, a in self.writers}))

    def for_pages(self, dst_pages: np.ndarray, page_size: int, num_kv: int) -> RoomPlan:
        """This plan for a request of these destination pages: staged or direct by the lower
        predicted time (path_choice.choose_path), the plan unchanged when it has no PathInputs.
        The direct path's ranges are counted from the destination pages' runs (the prefill's
        own page order is not known here: its runs can only split them further)."""
        if self.path is None:
            return self
        n = int(dst_pages.size)
        whole = self.prefill_tp == self.decode_tp
        per_page = num_kv * self.num_layers
        if whole:
            d = np.asarray(dst_pages, dtype=np.int64)
            runs = int(np.count_nonzero(np.diff(d) != 1)) + 1 if n else 0
            ranges = runs * per_page * len(self.writers)
        else:
            ranges = n * per_page * page_size * len(self.writers)
        parts = [self.writer_page_bytes(a) for _, a in self.writers]
        mpp = self.piece_pages(parts) if self.can_stage else 0
        shape = RequestShape(nbytes=n * sum(parts), writers=max(1, len(self.writers)), direct_ranges=ranges,
                             direct_writes=1, pieces=-(-n // mpp) if mpp else 1)
        choice = choose_path(mode=self.path.mode, can_stage=self.can_stage, tp_differ=not whole, shape=shape,
                             writers=list(self.path.writers), mem_kind=self.path.mem_kind,
                             scatter_bytes_per_s=self.path.scatter_bytes_per_s)
        return replace(self, staged=choice.staged, choice=choice)

    def writer_page_bytes(self, a: Assignment) -> int:
        return self.head_page_bytes * a.num_heads

    def piece_pages(self, writer_page_bytes: list[int]) -> int:
        """The most pages of one piece whose writers write `writer_page_bytes` per page: a
        piece of a few layers (a layer group, a PP stage) holds more pages than one of every
        entry, so that it is as large as the cap allows: a layer-wise request then makes as
        few pieces as one sent per chunk, and each backend write stays large."""
        if not self.piece_bytes:
            return self.max_piece_pages
        return (max_piece_pages(writer_page_bytes, self.piece_bytes, self.ring_size, self.ring_align)
                or max_piece_pages(writer_page_bytes, self.buffer_bytes, self.ring_size, self.ring_align))


def plan_key(plan: RoomPlan) -> tuple[object, ...]:
    """What makes two plans one shape: every field that says how the room moves (its writers
    and their heads, the notices, path, piece sizes, ring, TP pair, PP stages, path inputs and
    choice). Two plans with equal keys are equal; the derived fields follow from these."""
    return tuple(_key_part(getattr(plan, f.name)) for f in fields(plan) if f.compare)


def _key_part(v: object) -> object:
    """A plan field as a hashable value equal for equal fields."""
    if isinstance(v, Mapping):
        return tuple(sorted(v.items()))
    if isinstance(v, PathInputs):   # its writers' costs hold lists: their encoding stands for them
        return (v.mode, v.mem_kind, v.scatter_bytes_per_s, msgspec.json.encode(v.writers))
    return v


class Plans(Protocol):
    """What a decode rank's planner offers its rooms' set-up: one plan object per shape."""

    def intern(self, plan: RoomPlan) -> RoomPlan: ...


class SharedPlans:
    """The plans a decode rank handed out, one per shape (plan_key): `intern` returns the plan
    kept for a shape equal to `plan`'s, else keeps `plan`. Bounded: past `limit` shapes the
    oldest is forgotten (its rooms keep their plan; a new room of it gets a new one), so plans
    of peers gone (their incarnations never come back) do not pile up. Sharing is safe because
    a plan is immutable; a room's path choice (RoomPlan.for_pages) makes a new plan only when
    the plan has path inputs."""

    __slots__ = ("_plans", "limit")

    def __init__(self, limit: int = 1024):
        if limit <= 0:
            raise ValueError(f"a plan cache keeps at least one plan, not {limit}")
        self.limit = limit
        self._plans: dict[tuple[object, ...], RoomPlan] = {}

    def intern(self, plan: RoomPlan) -> RoomPlan:
        key = plan_key(plan)
        kept = self._plans.get(key)
        if kept is not None:
            return kept
        if len(self._plans) >= self.limit:
            del self._plans[next(iter(self._plans))]   # the oldest shape
        self._plans[key] = plan
        return plan

    def __len__(self) -> int:
        return len(self._plans)


@dataclass(frozen=True)
class PlanRefused:
    """A room that can never move (plan_room): its failure kind and why."""

    kind: FailureKind
    reason: str


@dataclass(frozen=True, slots=True)
class WriterOffer:
    """What a connected prefill rank offers this decode rank (from its HelloAck)."""

    key: PeerKey
    staging: bool
    buffer_bytes: int
    layers: range | None = None     # the layers it holds (its PP stage); None: every layer


def _writes(mapping: HeadMapping, prefill_rank: int, decode_rank: int) -> Assignment:
    a = mapping.find(prefill_rank, decode_rank)
    assert a is not None, f"prefill rank {prefill_rank} writes nothing to decode rank {decode_rank}"
    return a


def plan_room(layout: KVLayout, mapping: HeadMapping, writers: dict[int, WriterOffer],
              notices: dict[int, PeerKey], *, staging: bool, ring_size: int, ring_align: int,
              piece_cap: int, epoch: int, draft_pools: int = 0,
              path: PathInputs | None = None) -> RoomPlan | PlanRefused:
    """Decide how a room from this prefill engine moves. Without `path` (the fixed rule): the
    staged path when staging is on here (a ring) and at every writer, TP sizes differ and the
    model is not MLA; direct otherwise. With `path`: staged is possible whenever staging is on
    here and at every writer and the model is not MLA, equal TP included (whole pages), and
    RoomPlan.for_pages picks per request; a forced staged path these ranks cannot use is refused.
    Returns the plan, or why not when a single page can never fit."""
    # the entries the prefill holds: its last stage's end (a decode rank may hold more draft
    # entries than the prefill writes; its extra ones stay untouched)
    entries = max((o.layers.stop for o in writers.values() if o.layers is not None), default=layout.num_entries)
    if layout.pp_size > 1:   # a decode stage: its writers hold only its layers, the model has them all
        entries = layout.num_entries
    if entries > layout.num_entries:
        return PlanRefused(FailureKind.LAYOUT, f"the prefill writes {entries} KV entries (layers and draft entries), "
                           f"this decode rank holds {layout.num_entries}")
    if draft_pools and (not layout.draft_own_geometry or draft_pools > layout.draft_entries):
        own = f"{layout.draft_entries} of its own geometry" if layout.draft_own_geometry else \
            f"{layout.draft_layers} of the target's geometry"
        return PlanRefused(FailureKind.LAYOUT, f"the prefill writes {draft_pools} draft KV entries of their own "
                           f"geometry, this decode rank holds {own}")
    hpb = layout.num_kv * entries * layout.page_size * layout.head_bytes
    # writer w is TP rank w % prefill_tp of its PP stage; every stage splits the heads alike
    assigns = tuple((writers[w].key, _writes(mapping, w % mapping.prefill_tp, layout.tp_rank)) for w in sorted(writers))
    can_stage = staging and ring_size > 0 and not layout.mla and all(o.staging for o in writers.values())
    tp_differ = mapping.prefill_tp != mapping.decode_tp
    if path is not None and path.mode is PathMode.STAGED and not can_stage:
        return PlanRefused(FailureKind.LAYOUT, f"{PATH_ENV}=staged (EngineConfig.path) but this room cannot be staged: "
                           + ("the model is MLA" if layout.mla else "no staging ring here" if not (staging and ring_size)
                              else "staging is off at prefill rank(s) "
                              + ", ".join(str(w) for w, o in sorted(writers.items()) if not o.staging)))
    staged = fixed_rule(can_stage, tp_differ).staged if path is None or path.mode is PathMode.AUTO else \
        path.mode is PathMode.STAGED
    mpp, cap = 0, 0
    if staged or (path is not None and can_stage):
        parts = [hpb * a.num_heads for _, a in assigns]
        buffers = min(o.buffer_bytes for o in writers.values())
        # pieces no larger than piece_cap keep gather, write and scatter of consecutive pieces
        # overlapping; the cap never makes a page impossible, only the buffers and the ring do
        cap = min(buffers, piece_cap)
        mpp = max_piece_pages(parts, cap, ring_size, ring_align) or max_piece_pages(parts, buffers, ring_size, ring_align)
        if mpp == 0 and path is not None and path.mode is PathMode.AUTO:
            staged = False   # the direct path still moves it
        elif mpp == 0:
            return PlanRefused(FailureKind.STAGING, f"one page ({sum(parts)} bytes in the ring, up to {max(parts)} per writer buffer) "
                               f"can never fit the staging ring ({ring_size} bytes) or a prefill worker buffer "
                               f"({buffers} bytes)")
    return RoomPlan(writers=assigns, notices=tuple(notices[n] for n in sorted(notices)), staged=staged,
                    head_page_bytes=hpb, num_layers=entries, max_piece_pages=mpp, piece_bytes=cap if mpp else 0,
                    ring_align=ring_align, ring_epoch=epoch, prefill_tp=mapping.prefill_tp,
                    decode_tp=mapping.decode_tp, ring_size=ring_size,
                    buffer_bytes=min(o.buffer_bytes for o in writers.values()) if writers else 0,
                    writer_layers={w: o.layers for w, o in writers.items() if o.layers is not None},
                    draft_pools=draft_pools, can_stage=bool(mpp), path=path, page_shards=mapping.page_shards)
