"""Validated page lists kept per room, so a gather or scatter of a piece does the host work on its
page list ONCE (docs/staging_kernels.md, "Host work per call").

Every gather/scatter of a piece takes the same page list: the prefill rank gathers a piece once
per decode rank that needs other heads of it, and once per layer group of a layer-wise chunk; the
decode rank scatters each writer's part of a landed piece into the same pages. Per call, the
list used to be validated on the host (range, duplicates), turned into an index tensor, and, for
a cache on a GPU, uploaded: a copy from pageable memory, which waits for the stream first (a host
synchronisation on every call).

A `PlanCache` keeps, per room, the validated lists it saw (`PageIndex`: the host copy, its runs of
consecutive pages, the index tensor per device, uploaded once).

A list that is ONE run of consecutive pages (a one-page piece, a piece of contiguous pages) is
never uploaded: its index is a view of a tensor 0, 1, 2, ... per device (`COUNTING`), built once
and complete before any thread may use it. On a GPU that saves the one-page request's gather and
scatter their upload, and the wait for it (docs/staging_kernels.md, "Host work per call").

A list is found by VALUE (its dtype and bytes), never by identity, so a new or changed list
never reuses a stale entry, and an entry can only be shared by calls that would have built the
same one. What it was validated against (the cache's page count, whether repeats are allowed) is
part of the key.

Most pieces are gathered once, though, and each is a slice of a larger array: the protocol cuts
a chunk's pieces out of the chunk's page array, and the decode rank its pieces out of the room's.
Such a slice is served from that whole array, validated and indexed (uploaded) once for all its
pieces; a piece's index is a view of it. The array's identity only finds the entry: the piece's
values are compared with the kept copy on every call, so an array written to is taken again.

Bounded: at most `max_rooms` rooms (least recently used dropped first), `per_room` lists per
room, and `max_bytes` of host and device index memory in all. `forget(room)` drops a room's
lists when the room is released (TransferWorkers / ScatterWorker.forget_room, called from the
engine's release hooks). Thread-safe: the transfer workers of a rank share one, and the control
thread releases rooms in it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .page_lists import check_pages

__all__ = ["COUNTING", "Counting", "PageIndex", "PageRun", "PlanCache", "needs_upload", "page_runs"]

MAX_ROOMS = 64
PER_ROOM = 16
MAX_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class PageRun:
    """Consecutive cache pages [page, page + length) at list positions [position, + length)."""

    position: int
    page: int
    length: int


def page_runs(pages: np.ndarray, max_runs: int) -> tuple[PageRun, ...] | None:
    """The list as runs of consecutive pages, or None when it has more than `max_runs`."""
    if max_runs <= 0:
        return None
    breaks = np.flatnonzero(np.diff(pages) != 1) + 1
    if breaks.shape[0] + 1 > max_runs:
        return None
    starts = [0, *breaks.tolist()]
    ends = [*breaks.tolist(), int(pages.shape[0])]
    return tuple(PageRun(s, int(pages[s]), e - s) for s, e in zip(starts, ends, strict=True))


def needs_upload(device: torch.device, pages: object) -> bool:
    """Whether a page list would be uploaded for a cache on `device`: an integer array of more
    than one run of consecutive pages, for a cache off the CPU (on the CPU an index shares the
    host array; one run is a view of `COUNTING`)."""
    if device.type == "cpu" or not isinstance(pages, np.ndarray) or pages.ndim != 1 or pages.size == 0 \
            or pages.dtype.kind not in "iu":
        return False
    return page_runs(pages, 1) is None


class Counting:
    """0, 1, 2, ... as an int64 tensor per device (8 bytes a page, up to the largest page asked
    for), grown when a view asks for more: the index of a run of consecutive pages
    [start, start + n) is `view(device, start, n)`, with no upload.

    Invariants: a tensor once handed out is never written (growing makes a new one; views of
    the old one keep it alive); on a GPU a new tensor is complete before it is handed out, so
    any thread's stream may read it. Thread-safe."""

    MIN = 1024

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_device: dict[torch.device, torch.Tensor] = {}

    def view(self, device: torch.device, start: int, n: int) -> torch.Tensor:
        if start < 0 or n < 0:
            raise ValueError(f"a run of consecutive pages starts at a page >= 0 and has >= 0 pages, got {start}, {n}")
        t = self._by_device.get(device)
        if t is None or t.shape[0] < start + n:
            with self._lock:
                t = self._by_device.get(device)
                if t is None or t.shape[0] < start + n:
                    size = max(start + n, 2 * (t.shape[0] if t is not None else 0), self.MIN)
                    t = torch.arange(size, dtype=torch.int64, device=device)
                    if device.type == "cuda":   # once per growth: complete before any stream reads it
                        torch.cuda.current_stream(device).synchronize()
                    self._by_device[device] = t
        return t[start:start + n]


#: the counting tensors every PlanCache's lists share (one per device)
COUNTING = Counting()


def _upload(host: np.ndarray, device: torch.device) -> torch.Tensor:
    """The list as an int64 tensor on `device`. On the CPU it shares `host` (which the entry owns);
    elsewhere it is copied once and the copy completes before any thread may use it (one stream
    synchronisation per list, not per call)."""
    index = torch.from_numpy(host)
    if index.device == device:
        return index
    index = index.to(device)
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    return index


class PageIndex:
    """One validated page list as plans need it: its host copy (owned, never the caller's
    memory), its runs for a given limit on runs, and its index tensor per device. `part(at, n)`:
    the list's slice [at, at + n), whose index is a view of this one's (no upload of its own),
    or of `COUNTING` when the slice is one run."""

    __slots__ = ("host", "n", "_runs", "_index", "nbytes", "_parent", "_at", "_parts")

    def __init__(self, host: np.ndarray, parent: PageIndex | None = None, at: int = 0) -> None:
        self.host = host
        self.n = int(host.shape[0])
        self._runs: dict[int, tuple[PageRun, ...] | None] = {}
        self._index: dict[torch.device, torch.Tensor] = {}
        self._parent, self._at = parent, at
        self._parts: dict[tuple[int, int], PageIndex] = {}
        #: counted against PlanCache.max_bytes: the host copy and one device copy of it
        self.nbytes = 2 * host.nbytes

    def runs(self, max_runs: int) -> tuple[PageRun, ...] | None:
        if max_runs <= 0:
            return None
        try:
            return self._runs[max_runs]
        except KeyError:
            runs = self._runs[max_runs] = page_runs(self.host, max_runs)
            return runs

    def index(self, device: torch.device) -> torch.Tensor:
        """The list as an int64 tensor on `device`: a view of `COUNTING` when it is one run, else
        a view of its whole list's index (a part), else its own upload."""
        t = self._index.get(device)
        if t is None:
            run = self.runs(1) if self.n else None
            if run is not None:
                t = COUNTING.view(device, run[0].page, self.n)
            elif self._parent is not None:
                t = self._parent.index(device)[self._at:self._at + self.n]
            else:
                t = _upload(self.host, device)
            self._index[device] = t
        return t

    def part(self, at: int, n: int) -> PageIndex:
        key = (at, n)
        got = self._parts.get(key)
        if got is None:
            got = self._parts[key] = PageIndex(self.host[at:at + n], self, at)
        return got


class _WholeList:
    """A room's whole page list (the array its pieces are slices of), validated once; whether it
    repeats a page is worked out on the first scatter that asks (a gather never does)."""

    __slots__ = ("index", "_unique", "nbytes", "addr")

    def __init__(self, host: np.ndarray, addr: int) -> None:
        self.index = PageIndex(host)
        self._unique: bool | None = None
        self.nbytes = self.index.nbytes
        self.addr = addr     # where the caller's array starts: a piece's offset in it

    @property
    def unique(self) -> bool:
        if self._unique is None:
            self._unique = bool(np.unique(self.index.host).size == self.index.n)
        return self._unique

    def holds(self, at: int, pages: np.ndarray) -> bool:
        """Whether [at, at + n) of the list holds `pages`' values (bytes compared when both are int64)."""
        mine = self.index.host[at:at + pages.size]
        if pages.dtype == np.int64:
            return mine.tobytes() == pages.tobytes()
        return bool(np.array_equal(mine, pages))


def _addr(a: np.ndarray) -> int:
    addr: int = a.__array_interface__["data"][0]
    return addr


def slice_of(pages: object) -> np.ndarray | None:
    """The array that owns `pages`' memory when `pages` is a contiguous 1-D integer slice of a
    contiguous 1-D array (a piece of a room's page list: the protocol cuts pieces out of the
    room's array), else None."""
    if not isinstance(pages, np.ndarray):
        return None
    base = pages.base
    if (not isinstance(base, np.ndarray) or base.ndim != 1 or pages.ndim != 1 or pages.size == 0
            or base.dtype != pages.dtype or pages.dtype.kind not in "iu"
            or not base.flags.c_contiguous or not pages.flags.c_contiguous):
        return None
    return base


def value_key(pages: object) -> tuple[str, bytes] | None:
    """(dtype, bytes) of a 1-D integer page list on the host, or None when it is not one (a
    device tensor, a float list, ...: those are validated per call, and raise there)."""
    if isinstance(pages, torch.Tensor):
        if pages.device.type != "cpu" or pages.dim() != 1 or pages.dtype.is_floating_point \
                or pages.dtype.is_complex or pages.dtype == torch.bool:
            return None
        arr = pages.detach().numpy()
    elif isinstance(pages, np.ndarray):
        arr = pages
    elif isinstance(pages, Sequence) and not isinstance(pages, (str, bytes)):
        arr = np.asarray(pages)
    else:
        return None
    if arr.ndim != 1 or arr.dtype.kind not in "iu" or arr.size == 0:
        return None
    return arr.dtype.str, arr.tobytes()


#: a kept list's key within its room: its value, or the whole list a piece is a slice of
_Key = tuple[Hashable, ...]


class PlanCache:
    """Validated page lists per room, found by value; bounded and thread-safe (module docstring)."""

    def __init__(self, max_rooms: int = MAX_ROOMS, per_room: int = PER_ROOM, max_bytes: int = MAX_BYTES) -> None:
        if max_rooms < 1 or per_room < 1 or max_bytes < 0:
            raise ValueError("a PlanCache keeps at least one list of one room")
        self.max_rooms, self.per_room, self.max_bytes = max_rooms, per_room, max_bytes
        self._lock = threading.Lock()
        self._rooms: OrderedDict[Hashable, OrderedDict[_Key, PageIndex | _WholeList]] = OrderedDict()
        self._bytes = 0
        self.hits = self.misses = 0

    def pages(self, room: Hashable, pages: Any, limit: int, what: str, *, unique: bool) -> PageIndex:
        """`pages` validated (`check_pages`: the same errors) for a cache of `limit` pages, from
        what `room` keeps: the whole list `pages` is a slice of, or an equal list; else validated
        now and kept under `room`."""
        base = slice_of(pages)
        if base is not None:
            got = self._piece(room, base, pages, limit, what, unique)
            if got is not None:
                return got
        vk = value_key(pages)
        if vk is None:
            return PageIndex(check_pages(pages, limit, what, unique=unique, copy=True))
        key = (*vk, limit, unique)
        hit = self._get(room, key)
        if isinstance(hit, PageIndex):
            return hit
        entry = PageIndex(check_pages(pages, limit, what, unique=unique, copy=True))
        self._put(room, key, entry)
        return entry

    def prepare(self, room: Hashable, pages: object, limit: int, what: str, device: torch.device, *,
                unique: bool) -> bool:
        """The whole array `pages` is (or is a slice of), validated and indexed for `device` now
        and kept under `room`, as the first call on a piece of it would: that call then finds it.
        True when kept; False when a piece of it would be validated on its own (see `pages`)."""
        if not isinstance(pages, np.ndarray) or pages.ndim != 1 or pages.size == 0:
            return False
        base = pages if pages.base is None else slice_of(pages)
        if base is None or base.dtype.kind not in "iu" or not base.flags.c_contiguous:
            return False
        got = self._piece(room, base, base, limit, what, unique)
        if got is None:
            return False
        got.index(device)
        return True

    def _piece(self, room: Hashable, base: np.ndarray, pages: np.ndarray, limit: int, what: str,
               unique: bool) -> PageIndex | None:
        """`pages` as a slice of the room's whole list `base`, validated and indexed once for the
        whole list; None when that list does not validate (the piece then is, on its own),
        repeats a page for a destination, or `pages` does not lie inside it."""
        key = ("whole", id(base), base.dtype.str, base.size, limit)
        whole = self._get(room, key)
        if isinstance(whole, _WholeList):
            at, rem = divmod(_addr(pages) - whole.addr, pages.itemsize)
        if not isinstance(whole, _WholeList) or rem or not 0 <= at <= base.size - pages.size \
                or not whole.holds(at, pages):
            # first seen, or the values changed (the array was written to, or is a new one at the
            # address of a freed one): the whole list again, by value
            try:
                whole = _WholeList(check_pages(base, limit, what, unique=False, copy=True), _addr(base))
            except ValueError:
                return None
            self._put(room, key, whole)
            at, rem = divmod(_addr(pages) - whole.addr, pages.itemsize)
            if rem or not 0 <= at <= base.size - pages.size:
                return None
        if unique and not whole.unique:
            return None
        with self._lock:
            return whole.index.part(at, pages.size)

    def _get(self, room: Hashable, key: _Key) -> PageIndex | _WholeList | None:
        with self._lock:
            bucket = self._rooms.get(room)
            hit = bucket.get(key) if bucket is not None else None
            if bucket is None or hit is None:
                self.misses += 1
                return None
            self.hits += 1
            bucket.move_to_end(key)
            self._rooms.move_to_end(room)
            return hit

    def _put(self, room: Hashable, key: _Key, entry: PageIndex | _WholeList) -> None:
        with self._lock:
            bucket = self._rooms.get(room)
            if bucket is None:
                bucket = self._rooms[room] = OrderedDict()
            else:
                self._rooms.move_to_end(room)
            old = bucket.pop(key, None)
            self._bytes -= old.nbytes if old is not None else 0
            bucket[key] = entry
            self._bytes += entry.nbytes
            while len(bucket) > self.per_room:
                self._bytes -= bucket.popitem(last=False)[1].nbytes
            while len(self._rooms) > self.max_rooms or (self._bytes > self.max_bytes and len(self._rooms) > 1):
                self._drop(next(iter(self._rooms)))

    def _drop(self, room: Hashable) -> None:
        bucket = self._rooms.pop(room, None)
        if bucket is not None:
            self._bytes -= sum(e.nbytes for e in bucket.values())

    def forget(self, room: Hashable) -> None:
        """Drop every list kept for `room` (it was released)."""
        with self._lock:
            self._drop(room)

    def clear(self) -> None:
        with self._lock:
            self._rooms.clear()
            self._bytes = 0

    def rooms(self) -> list[Hashable]:
        with self._lock:
            return list(self._rooms)

    def __len__(self) -> int:
        with self._lock:
            return sum(len(b) for b in self._rooms.values())

    @property
    def nbytes(self) -> int:
        return self._bytes
