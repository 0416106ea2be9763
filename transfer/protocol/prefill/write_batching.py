"""Direct path, layer-wise sending: writes that size themselves. Pure.

On the direct path each write costs a fixed amount besides its bytes (the backend call, the
`WritePosted` announcement, the completion), and the writes of a room go out one after another.
Fixed groups of layers pay that cost once per group whether or not the transfer keeps up with the
forward pass. A batching room instead holds its write units (one layer each) until their layers
are ready, and starts its next write only once the previous one completed: that write takes every
ready unit waiting, merged. While the transfer keeps up, each layer goes alone as soon as it is
computed; once it falls behind, the writes grow by as many layers as were computed meanwhile:
the growing schedule the model in docs/journal/benchmarks-2026-11.md ("Writes that size themselves") asks for,
at the growth this machine's own costs set.

A unit waits for its readiness objects (what the caller gave send(ready=...)) off the control
thread: the batcher hands out an `AwaitUnit` for each, and the shell's report (the room's
`on_unit_ready`) marks it ready. Units leave in the order they came; a unit is merged into the one before it only if
it covers the same pages and the layers right after.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from ..actions import AwaitUnit
from .layer_sends import LayerGrouper, LayerGrouping, Unit, group_size

__all__ = ["UnitBatcher", "merge_units", "plan_units"]


def plan_units(grouping: LayerGrouping, *, room: int, stage: range, num_tokens: int, direct_only: bool,
               unit_ids: Iterator[int]) -> tuple[LayerGrouper, UnitBatcher | None]:
    """How a room turns its sends into units, decided at its first send: groups of `layer_group`
    layers, or, on a room that batches (`grouping.batch`, layer-wise above the threshold,
    `direct_only`: every decode rank known and written directly), one layer each and a batcher."""
    size = group_size(layer_group=grouping.size, min_tokens=grouping.min_tokens, num_tokens=num_tokens, stage=stage)
    if grouping.batch and size < len(stage) and direct_only:
        return LayerGrouper(stage=stage, size=1), UnitBatcher(room=room, ids=unit_ids)
    return LayerGrouper(stage=stage, size=size), None


@dataclass(kw_only=True)
class _Held:
    unit: Unit
    seq: int
    since: float
    ready: bool


class UnitBatcher:
    """The write units of one room on their way to becoming chunks. `ids`: unit numbers unique
    in the process (the room's write ids), so that a report for a unit of an earlier use of the
    same room id, still waited on when that use ended, names no unit of this one."""

    def __init__(self, *, room: int, ids: Iterator[int]):
        self.room = room
        self._held: deque[_Held] = deque()
        self._ids = ids
        self.merged = 0    # units that went out inside another unit's write

    def __len__(self) -> int:
        return len(self._held)

    def add(self, unit: Unit, now: float) -> AwaitUnit | None:
        """Hold `unit`; the wait for its readiness objects, if it has any."""
        seq = next(self._ids)
        self._held.append(_Held(unit=unit, seq=seq, since=now, ready=not unit.ready))
        return AwaitUnit(room=self.room, seq=seq, ready=unit.ready) if unit.ready else None

    def unit_ready(self, seq: int) -> bool:
        """Mark unit `seq` ready; False if it is not held (already gone, or never given)."""
        for held in self._held:
            if held.seq == seq:
                held.ready = True
                return True
        return False

    def take(self) -> list[Unit]:
        """The ready units at the front, merged where they can be, with nothing left to wait on."""
        ready: list[Unit] = []
        while self._held and self._held[0].ready:
            ready.append(self._held.popleft().unit)
        out = merge_units(ready)
        self.merged += len(ready) - len(out)
        return out

    def oldest_waiting(self) -> float | None:
        """Since when the longest-held unit still waits for its layers (None: none does)."""
        return min((h.since for h in self._held if not h.ready), default=None)

    def clear(self) -> None:
        self._held.clear()


def merge_units(units: list[Unit]) -> list[Unit]:
    """Consecutive units of the same pages whose layers follow on, as one unit each run; every
    result has no readiness objects (they were waited on)."""
    out: list[Unit] = []
    for u in units:
        prev = out[-1] if out else None
        if (prev is not None and prev.page_start == u.page_start and prev.layers.stop == u.layers.start
                and (prev.pages is u.pages or np.array_equal(prev.pages, u.pages))):   # one send's units share it
            out[-1] = Unit(page_start=prev.page_start, pages=prev.pages, layers=range(prev.layers.start, u.layers.stop))
        else:
            out.append(Unit(page_start=u.page_start, pages=u.pages, layers=u.layers))
    return out
