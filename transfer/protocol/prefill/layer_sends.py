"""A prefill sender's input: which (page, layer) pairs a send() names, the rules each call must
keep, and how sends become the units the room writes. Pure.

The rules are written once: the caller's handle (KVSender) checks them to raise in the caller's
thread, and the prefill room checks them again on the control thread, with the same words. A
sender gets its page count once (at creation or with init(), `check_page_count`), then sends
(`SendLedger` checks each: pages and layers in request order, the last one the send that
completes every (page, layer)); items of a pool init() did not name may come with the last send
(`check_late_items`).

A send names pages (in request order) and a range of layers; the current `send(pages)` is every
layer this rank holds (its PP stage's range). Each layer advances through the request's pages
on its own: a send for layers [a, b) covers the positions that all of those layers reached, and
its pages must agree with the pages earlier sends gave for the same positions. The request's
input is complete when every layer reached the page count.

`LayerGrouper` turns sends into write units (page range x layer range): groups of
`layer_group` layers aligned on the stage's first layer, and the whole stage at once for a
request shorter than the threshold (per-chunk sending, as without layers). A send that covers
whole groups goes out as one unit (a send of every layer is one write, as without layers); a
group a send covers only partly waits until all of its layers were given for the same pages;
whatever is left when the input is complete goes out as it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

__all__ = ["PER_CHUNK", "LayerGrouper", "LayerGrouping", "SendLedger", "SendStep", "Unit", "check_late_items", "check_layers",
           "check_page_count", "group_size"]


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerGrouping:
    """How a prefill rank turns layer-wise sends into writes (EngineConfig.layer_group,
    layerwise_min_tokens and layer_batching): `size` layers per write (0: the whole stage), the
    whole stage for a request of fewer than `min_tokens` tokens, and with `batch`, writes that
    size themselves on a room writing only direct (write_batching.py)."""

    size: int = 0
    min_tokens: int = 0
    batch: bool = False


PER_CHUNK = LayerGrouping()   # every layer of a chunk in one write, as without layer-wise sending


def check_page_count(room: int, current: int | None, num_pages: object) -> int:
    """init(): the page count of a sender created without one. Raises ValueError."""
    if current is not None:
        raise ValueError(f"room {room}: init() called twice, or on a sender created with num_pages")
    if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages <= 0:
        raise ValueError(f"room {room}: num_pages must be a positive int, got {num_pages!r}")
    return num_pages


def check_late_items(room: int, given: Mapping[str, object], late: Mapping[str, object] | None, last: bool) -> None:
    """send(pool_items=...): items of pools init() did not name, on the request's last send
    only (the write carrying them is the last). Raises ValueError."""
    if not late:
        return
    if not last:
        raise ValueError(f"room {room}: pool_items come with the last send only (this send leaves pages or layers "
                         f"unsent)")
    twice = sorted(set(late) & set(given))
    if twice:
        raise ValueError(f"room {room}: items of pool(s) {', '.join(twice)} were given at init() and again with the "
                         f"last send")


def check_layers(room: int, layers: object, stage: range) -> range:
    """`layers` (None: the whole stage) as a non-empty step-1 range inside `stage`. Raises
    ValueError naming the room."""
    if layers is None:
        return stage
    if not isinstance(layers, range) or layers.step != 1:
        raise ValueError(f"room {room}: layers must be a range with step 1 (e.g. range(0, 4)), got {layers!r}")
    if len(layers) == 0:
        raise ValueError(f"room {room}: layers {layers!r} is empty")
    if layers.start < stage.start or layers.stop > stage.stop:
        raise ValueError(f"room {room}: layers [{layers.start}, {layers.stop}) are outside this rank's layers "
                         f"[{stage.start}, {stage.stop})")
    return layers


@dataclass(frozen=True, kw_only=True, slots=True)
class SendStep:
    """What one accepted send() covers: request positions [page_start, page_start + num_pages)
    of `layers`; `last`: the request's input is complete with it."""

    page_start: int
    num_pages: int
    layers: range
    last: bool


class SendLedger:
    """Per layer, how many of the request's pages were sent, and the pages by position.

    `check` validates a send without changing anything; `record` applies a checked one. Both
    the caller's handle (to raise in the caller's thread) and the room keep one."""

    __slots__ = ("room", "stage", "num_pages", "_sent", "_pages", "ended")   # one per room in flight

    def __init__(self, *, room: int, stage: range):
        self.room = room
        self.stage = stage
        self.num_pages: int | None = None
        self._sent = np.zeros(len(stage), dtype=np.int64)   # per layer of the stage
        self._pages: np.ndarray | None = None               # page by position, -1: not given yet
        self.ended = False

    def set_page_count(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._pages = np.full(num_pages, -1, dtype=np.int64)

    @property
    def pages(self) -> np.ndarray:
        """The request's page at each position (-1: not given yet)."""
        assert self._pages is not None, "the page count is not known yet"
        return self._pages

    @property
    def sent_everywhere(self) -> int:
        """Positions every layer reached."""
        return int(self._sent.min())

    def check(self, pages: np.ndarray, layers: object, last: bool | None) -> SendStep:
        room = self.room
        if self.num_pages is None or self._pages is None:
            raise ValueError(f"room {room}: send() before init(): the page count is not known yet")
        if self.ended:
            raise ValueError(f"room {room}: send() after the last chunk")
        rng = check_layers(room, layers, self.stage)
        lo, hi = rng.start - self.stage.start, rng.stop - self.stage.start
        reached = self._sent[lo:hi]
        start = int(reached[0])
        if (reached != start).any():
            behind = rng.start + int(np.argmin(reached))
            raise ValueError(f"room {room}: layers [{rng.start}, {rng.stop}) are at different pages (layer "
                             f"{rng.start} sent {start}, layer {behind} sent {int(reached.min())}): send "
                             f"each group of layers that moved together")
        n = int(pages.size)
        end = start + n
        if layers is not None and n and start:   # (no earlier positions: nothing to repeat)
            earlier = self._pages[:start]
            again = np.isin(pages, earlier[earlier >= 0])
            if again.any():
                raise ValueError(f"room {room}: (page {int(pages[int(np.argmax(again))])}, layers "
                                 f"[{rng.start}, {rng.stop})) was already sent")
        if end > self.num_pages:
            which = "" if rng == self.stage else f" for layers [{rng.start}, {rng.stop})"
            raise ValueError(f"room {room}: {end} pages sent{which}, the sender was created for {self.num_pages}")
        known = self._pages[start:end]
        differ = (known >= 0) & (known != pages)
        if differ.any():
            at = start + int(np.argmax(differ))
            raise ValueError(f"room {room}: page {int(pages[at - start])} at position {at} differs from page "
                             f"{int(known[at - start])} another layer's send gave there")
        after = self._sent.copy()
        after[lo:hi] = end
        complete = bool((after == self.num_pages).all())
        if last and not complete and (after == after[0]).all():
            raise ValueError(f"room {room}: the last chunk ends at page {end} of {self.num_pages}")
        if last and not complete:
            raise ValueError(f"room {room}: the last send leaves (page, layer) pairs unsent: layer "
                             f"{self.stage.start + int(np.argmin(after))} is at page {int(after.min())} of "
                             f"{self.num_pages}")
        return SendStep(page_start=start, num_pages=n, layers=rng, last=complete if last is None else bool(last))

    def record(self, step: SendStep, pages: np.ndarray) -> None:
        assert self._pages is not None
        self._sent[step.layers.start - self.stage.start:step.layers.stop - self.stage.start] += step.num_pages
        self._pages[step.page_start:step.page_start + step.num_pages] = pages
        self.ended = step.last


@dataclass(frozen=True, kw_only=True, slots=True)
class Unit:
    """One write unit of a prefill room: request positions from `page_start`, the cache
    `pages` there, `layers`, and what to wait on before reading them."""

    page_start: int
    pages: np.ndarray
    layers: range
    ready: tuple[object, ...] = ()


def group_size(*, layer_group: int, min_tokens: int, num_tokens: int, stage: range) -> int:
    """Layers per unit: the whole stage below the length threshold (and for layer_group 0)."""
    if layer_group <= 0 or num_tokens < min_tokens:
        return len(stage)
    return min(layer_group, len(stage))


@dataclass(kw_only=True, slots=True)
class _Pending:
    pages: np.ndarray
    layers: set[int] = field(default_factory=set)
    ready: list[object] = field(default_factory=list)


class LayerGrouper:
    """Sends in, units out (see the module docstring)."""

    __slots__ = ("stage", "size", "_pending")   # one per room in flight

    def __init__(self, *, stage: range, size: int):
        self.stage, self.size = stage, size
        self._pending: dict[tuple[int, int, int], _Pending] = {}   # (page_start, num_pages, group) -> layers

    def _group(self, layer: int) -> range:
        first = self.stage.start + (layer - self.stage.start) // self.size * self.size
        return range(first, min(first + self.size, self.stage.stop))

    def add(self, step: SendStep, pages: np.ndarray, ready: tuple[object, ...] = ()) -> list[Unit]:
        """A send's whole groups go out at once, as one unit (a send of every layer stays one
        write); its part of a group it covers only partly waits for the rest of that group."""
        out: list[Unit] = []
        whole: list[int] = []   # layers of the whole groups this send covers, in order
        layer = step.layers.start
        while layer < step.layers.stop and step.num_pages:
            group = self._group(layer)
            upto = min(group.stop, step.layers.stop)
            if layer == group.start and upto == group.stop:
                whole += group
            else:
                key = (step.page_start, step.num_pages, group.start)
                held = self._pending.setdefault(key, _Pending(pages=pages))
                held.layers.update(range(layer, upto))
                held.ready.extend(ready)
                if len(held.layers) == len(group):
                    del self._pending[key]
                    out.append(Unit(page_start=step.page_start, pages=pages, layers=group,
                                    ready=tuple(held.ready)))
            layer = upto
        if whole:
            out.append(Unit(page_start=step.page_start, pages=pages, layers=range(whole[0], whole[-1] + 1),
                            ready=ready))
        if step.last:
            out += self.flush()
        return out

    def flush(self) -> list[Unit]:
        """Every held send, as runs of consecutive layers."""
        out: list[Unit] = []
        for (start, _, _), held in sorted(self._pending.items(), key=lambda kv: kv[0]):
            run: list[int] = []
            for layer in sorted(held.layers) + [-2]:
                if run and layer != run[-1] + 1:
                    out.append(Unit(page_start=start, pages=held.pages, layers=range(run[0], run[-1] + 1),
                                    ready=tuple(held.ready)))
                    run = []
                run.append(layer)
        self._pending.clear()
        return out
