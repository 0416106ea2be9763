"""The space of one staging buffer, shared by the pieces its writes are still reading.

A transfer worker gathers a piece into a free part of its buffer and posts the piece's write from
there; that part is free again only when the write completed (the backend reads it until then).
So a worker may have several pieces in flight, one per part, and gathers the next piece while the
writes of the earlier ones are on the wire (issue 47, "pieces in flight").

`Extents` is the rule, pure: first fit over `[0, size)`, every part starting on a multiple of
`align`, parts freed in any order. Invariants: no two parts in use overlap; every part lies
inside the buffer; a part is given back once. `BufferSpace` is its thread-safe shell: the worker
thread takes (and blocks while no part fits, on a condition, never polling), the backend's owner
thread gives back as each write completes, and `close()` wakes a waiting worker when the engine
stops, so nothing waits for a completion that will not come.
"""

from __future__ import annotations

import bisect
import threading


class SpaceClosed(RuntimeError):
    """The buffer's space was closed (the engine is stopping): no part will be taken from it."""


class Extents:
    """First-fit placement of parts in `[0, size)`, each starting on a multiple of `align`."""

    def __init__(self, size: int, align: int) -> None:
        if size <= 0 or align <= 0:
            raise ValueError(f"a buffer of {size} bytes aligned to {align}: both must be positive")
        self.size, self.align = size, align
        self._starts: list[int] = []        # sorted starts of the parts in use
        self._ends: dict[int, int] = {}     # start -> end (exclusive)
        self.peak = 0                       # the most parts in use at once

    def __len__(self) -> int:
        return len(self._starts)

    def place(self, nbytes: int) -> int | None:
        """The start of a free part of `nbytes` (now in use), or None when none fits yet.
        Raises ValueError for a part that could never fit."""
        if nbytes <= 0 or nbytes > self.size:
            raise ValueError(f"a part of {nbytes} bytes does not fit a staging buffer of {self.size}")
        at = 0
        for i, start in enumerate(self._starts):
            if at + nbytes <= start:
                return self._use(i, at, nbytes)
            at = -(-self._ends[start] // self.align) * self.align
        if at + nbytes <= self.size:
            return self._use(len(self._starts), at, nbytes)
        return None

    def _use(self, i: int, at: int, nbytes: int) -> int:
        self._starts.insert(i, at)
        self._ends[at] = at + nbytes
        self.peak = max(self.peak, len(self._starts))
        return at

    def free(self, at: int) -> None:
        """The part that starts at `at` is free again. Raises KeyError for a part not in use."""
        del self._ends[at]
        self._starts.pop(bisect.bisect_left(self._starts, at))


class BufferSpace:
    """`Extents` shared by a worker thread (take) and the backend's owner thread (give)."""

    def __init__(self, size: int, align: int = 4096) -> None:
        self._extents = Extents(size, align)
        self._cond = threading.Condition()
        self._closed = False

    @property
    def in_use(self) -> int:
        with self._cond:
            return len(self._extents)

    @property
    def peak(self) -> int:
        """The most pieces that were in flight from this buffer at once."""
        with self._cond:
            return self._extents.peak

    def take(self, nbytes: int) -> int:
        """The start of a part of `nbytes`, now the caller's; blocks until the writes in flight
        leave room for it. Raises ValueError if it never could fit, SpaceClosed once closed."""
        with self._cond:
            while True:
                if self._closed:
                    raise SpaceClosed("the staging buffer is closed: the engine is stopping")
                at = self._extents.place(nbytes)
                if at is not None:
                    return at
                self._cond.wait()

    def try_take(self, nbytes: int) -> int | None:
        """`take` that never waits: None when no part fits now (or the space is closed)."""
        with self._cond:
            return None if self._closed else self._extents.place(nbytes)

    def give(self, at: int) -> None:
        """The write that read the part at `at` is over: the part is free (any thread)."""
        with self._cond:
            self._extents.free(at)
            self._cond.notify_all()

    def close(self) -> None:
        """No part will be taken any more: a worker waiting for one gets SpaceClosed."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
