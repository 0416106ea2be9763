"""The one interface the rest of kvstage uses to move bytes: NIXL and Mooncake implement it.

A backend object is NOT thread-safe by contract: exactly one thread (the engine's backend
thread) calls it, so neither implementation relies on NIXL's strict sync mode or on the GIL.
Every call returns promptly; writes are posted and then polled, never waited on here.

Descriptors are N x 3 uint64 numpy arrays of (address, length, device id), source and
destination row by row with equal lengths, as NIXL takes them; Mooncake reads the same arrays.
"""

from __future__ import annotations

import abc
import atexit
import contextlib
import enum
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


class BackendError(RuntimeError):
    """A backend operation failed in a way the caller must handle (bad range, unknown peer...)."""


@dataclass(frozen=True, kw_only=True)
class MemRegion:
    """A contiguous range of memory to register: host (DRAM) or device (VRAM)."""

    addr: int
    length: int
    device: int = 0
    kind: str = "DRAM"  # "DRAM" or "VRAM"


@dataclass
class Registration:
    """What register() returns; pass it back to deregister(). Opaque `handle` is the backend's."""

    regions: tuple[MemRegion, ...]
    handle: object = None
    active: bool = True


class WriteState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


@dataclass(kw_only=True)
class WriteHandle:
    """One posted write request. `reason` is set when state is FAILED."""

    peer: str
    nbytes: int
    ndesc: int
    handle: object = None
    state: WriteState = WriteState.PENDING
    reason: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)   # each backend's own entries, read back by it


@dataclass(frozen=True)
class ArrivedTag:
    """A notification that arrived with a completed write: the tag bytes and who sent them."""

    peer: str
    tag: bytes


def descriptor_array(rows: Sequence[tuple[int, int, int]] | np.ndarray) -> np.ndarray:
    """Coerce descriptors to the N x 3 uint64 array both backends take (C-contiguous)."""
    arr = np.ascontiguousarray(np.asarray(rows, dtype=np.uint64))
    if arr.ndim != 2 or arr.shape[1] != 3:
        raise ValueError(f"descriptors must be N x 3 (address, length, device), got shape {arr.shape}")
    return arr


class RangeIndex:
    """The union of some [addr, addr + length) ranges, for "is every row inside?" checks.

    Backends use it to reject writes from unregistered local memory (and, for Mooncake, into
    ranges a peer never advertised) with a clear BackendError before anything is posted.
    """

    def __init__(self, ranges: Sequence[tuple[int, int]] = ()):
        spans = sorted((int(a), int(a) + int(n)) for a, n in ranges if int(n) > 0)
        merged: list[list[int]] = []
        for start, end in spans:
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        self._starts = np.array([m[0] for m in merged], dtype=np.uint64)
        self._ends = np.array([m[1] for m in merged], dtype=np.uint64)

    def __len__(self) -> int:
        return len(self._starts)

    def outside(self, descs: np.ndarray) -> np.ndarray:
        """Indices of the rows of an N x 3 descriptor array not wholly inside one range."""
        addr = descs[:, 0]
        end = addr + descs[:, 1]
        if len(self._starts) == 0:
            return np.arange(len(descs))
        i = np.searchsorted(self._starts, addr, side="right").astype(np.int64) - 1
        ok = i >= 0
        j = np.where(ok, i, 0)
        ok &= end <= self._ends[j]
        ok &= end >= addr  # no uint64 wrap-around
        return np.flatnonzero(~ok)


MEMORY_KINDS = ("DRAM", "VRAM")


def check_regions(regions: Sequence[MemRegion]) -> tuple[MemRegion, ...]:
    """The regions of one register() call, checked the same way by every backend."""
    regions = tuple(regions)
    if not regions:
        raise ValueError("regions: nothing to register")
    for r in regions:
        if r.kind not in MEMORY_KINDS:
            raise ValueError(f"regions: kind must be one of {MEMORY_KINDS}, got {r.kind!r}")
        if r.length <= 0 or r.addr <= 0:
            raise ValueError(f"regions: bad region {r}")
    return regions


def check_write_request(
    src: Sequence[tuple[int, int, int]] | np.ndarray,
    dst: Sequence[tuple[int, int, int]] | np.ndarray,
    tag: bytes,
) -> tuple[np.ndarray, np.ndarray, bytes]:
    """The checks every backend makes before posting a write; raises BackendError.

    Returns the descriptor arrays (N x 3 uint64, C-contiguous) and the tag as bytes.
    """
    try:
        s = descriptor_array(src)
        d = descriptor_array(dst)
    except (ValueError, TypeError, OverflowError) as exc:
        raise BackendError(f"bad descriptors: {exc}") from exc
    if not isinstance(tag, (bytes, bytearray, memoryview)):
        raise BackendError(f"tag must be bytes, got {type(tag).__name__}")
    if len(tag) == 0:
        raise BackendError("tag must not be empty (NIXL sends no notification for an empty message)")
    if len(s) == 0:
        raise BackendError("a write needs at least one descriptor row")
    if len(s) != len(d):
        raise BackendError(f"length mismatch: {len(s)} source rows but {len(d)} destination rows")
    bad = np.flatnonzero(s[:, 1] != d[:, 1])
    if len(bad):
        i = int(bad[0])
        raise BackendError(
            f"length mismatch at row {i}: source {int(s[i, 1])} bytes, destination {int(d[i, 1])} bytes"
            f" ({len(bad)} rows differ)"
        )
    zero = np.flatnonzero(s[:, 1] == 0)
    if len(zero):
        raise BackendError(f"row {int(zero[0])} has length 0 ({len(zero)} zero-length rows)")
    return s, d, bytes(tag)


class Backend(abc.ABC):
    """A transfer backend owned by a single thread.

    Life cycle: construct -> register(...) memory -> identity() is published to peers ->
    connect(peer identity) -> post_write()/poll_write() and drain_tags() -> disconnect -> close.
    """

    #: "nixl" or "mooncake"
    kind: str = ""
    #: the memory kinds this build can register and write into (a peer advertising another kind
    #: is refused at connect, naming the region; a local region of another kind at start-up)
    memory_kinds: tuple[str, ...] = MEMORY_KINDS
    #: whether a posted write completes on the library's own thread, which then calls the
    #: `on_complete` given to post_write: its owner need not poll it (Mooncake). False: the
    #: owner's polling drives the write (NIXL: UCX progresses only when asked)
    signals_completion: bool = False

    @property
    @abc.abstractmethod
    def name(self) -> str:
        """This endpoint's name as peers see it (the `peer` of tags it sends)."""

    @abc.abstractmethod
    def identity(self) -> bytes:
        """What a peer needs to connect and write to this endpoint's registered memory.

        Call it after registering the memory peers will write to (NIXL includes registrations).
        """

    @abc.abstractmethod
    def register(self, regions: Sequence[MemRegion]) -> Registration:
        """Register memory for transfers. Raises BackendError; registers all or nothing."""

    @abc.abstractmethod
    def deregister(self, registration: Registration) -> None:
        """Deregister; idempotent (a second call does nothing)."""

    @contextlib.contextmanager
    def registered(self, regions: Sequence[MemRegion]) -> Iterator[Registration]:
        """Scoped registration: registered on entry, deregistered on exit, also on error."""
        reg = self.register(regions)
        try:
            yield reg
        finally:
            self.deregister(reg)

    @abc.abstractmethod
    def connect(self, peer_identity: bytes) -> str:
        """Load a peer's identity; return the peer name used in post_write and tags."""

    @abc.abstractmethod
    def disconnect(self, peer: str) -> None:
        """Forget a peer; idempotent."""

    @abc.abstractmethod
    def post_write(
        self, peer: str, src: np.ndarray, dst: np.ndarray, tag: bytes, *, dst_kind: str | None = None,
        on_complete: Callable[[], None] | None = None,
    ) -> WriteHandle:
        """Post ONE write request of many ranges to `peer`, carrying `tag` as its notification.

        The peer sees the tag only after every byte of the write is in place, exactly once.
        Raises BackendError for requests that cannot be posted (unregistered memory, bad remote
        range, unknown peer, length mismatch); failures after posting come back from poll_write.
        The source memory kind is taken from this endpoint's registrations; `dst_kind` ("DRAM" or
        "VRAM") names the kind of the peer's memory, None meaning the same kind as the source
        (NIXL needs it; Mooncake addresses are raw and ignore it). A backend that
        `signals_completion` calls `on_complete()` once, from its own thread, when the write's
        state is final (poll_write then returns it); the others ignore it.
        """

    @abc.abstractmethod
    def poll_write(self, handle: WriteHandle) -> WriteState:
        """Drive progress for the write and return its state (sets handle.reason on failure)."""

    @abc.abstractmethod
    def release_write(self, handle: WriteHandle) -> None:
        """Free the backend resources of a finished (DONE or FAILED) write; idempotent."""

    @abc.abstractmethod
    def drain_tags(self) -> list[ArrivedTag]:
        """Return the tags of writes that landed in this endpoint's memory since the last call."""

    def progress(self) -> None:  # noqa: B027 - optional hook: a backend that needs no driving keeps it
        """Drive backend progress without checking a particular write (target side)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release everything; idempotent. Registrations still active are deregistered."""


_LIVE: weakref.WeakSet[Backend] = weakref.WeakSet()


def close_at_exit(backend: Backend, live: bool = True) -> None:
    """Track a backend so it is closed at interpreter exit if its owner did not close it: no
    library thread may still be in C++ code while the interpreter tears down (UCX and Mooncake
    crash otherwise). `live=False` stops tracking it (after close())."""
    if live:
        _LIVE.add(backend)
    else:
        _LIVE.discard(backend)


@atexit.register
def _close_all_at_exit() -> None:
    for backend in list(_LIVE):
        try:
            backend.close()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass
