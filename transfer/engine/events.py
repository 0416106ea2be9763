"""Message passing into the control thread: a queue plus a wake-up pipe the zmq poller watches.

Any thread may `put`; only the control thread `drain`s. The pipe lets the control thread
sleep in one poll() on both its socket and this queue.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

import numpy as np

from ...hop_trace import TRACE, Hop
from ..protocol.kinds import FailureKind

if TYPE_CHECKING:   # annotations only: these modules import this one
    from ...bootstrap import RankRecord
    from .handles import RoomStatus
    from .loop import EngineLoop
    from .prefill_sources import PrefillSource

T = TypeVar("T")


class EventQueue:
    def __init__(self) -> None:
        self._q: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self._closing = threading.Lock()   # a put racing close() never writes into a reused fd number

    @property
    def fd(self) -> int:
        return self._r

    def put(self, event: object) -> None:
        if TRACE.on:
            TRACE.hop(Hop.EVENT_QUEUED, getattr(event, "room", None), f"ctrl {type(event).__name__}")
        self._q.put(event)
        with self._closing:
            if self._w < 0:
                return  # closed: nobody drains any more
            try:
                os.write(self._w, b"\x01")
            except (BlockingIOError, OSError):
                pass  # the pipe is full: a wake-up is already pending

    def drain(self) -> list[object]:
        try:
            while os.read(self._r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass
        out: list[object] = []
        while True:
            try:
                out.append(self._q.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        """Idempotent: each fd is closed once, and a later put() writes nothing."""
        with self._closing:
            fds, self._r, self._w = (self._r, self._w), -1, -1
        for fd in fds:
            if fd >= 0:
                os.close(fd)


# -- events ---------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class NewSender:
    room: int
    num_pages: int | None     # None: given later by InitSender
    status: RoomStatus
    pool_items: dict[str, np.ndarray] | None = None
    num_tokens: int | None = None         # the request's tokens (decode context parallel)


@dataclass(frozen=True)
class InitSender:
    room: int
    num_pages: int
    pool_items: dict[str, np.ndarray] | None = None
    num_tokens: int | None = None         # the request's tokens (decode context parallel)


@dataclass(frozen=True, kw_only=True)
class SendChunk:
    room: int
    pages: np.ndarray
    last: bool                # decided in the caller's thread (inferred there when not given)
    layers: range | None = None           # None: every layer of the rank
    ready: tuple[object, ...] = ()        # waited on by a kvstage thread before the layers are read
    pool_items: dict[str, np.ndarray] | None = None   # the last send: items of pools init() did not name


@dataclass(frozen=True, kw_only=True)
class NewReceiver:
    room: int
    session: int
    source: PrefillSource
    status: RoomStatus


@dataclass(frozen=True, kw_only=True)
class InitReceiver:
    room: int
    pages: np.ndarray
    prefix_pages: int = 0
    pool_items: dict[str, np.ndarray] | None = None
    num_tokens: int | None = None         # the request's tokens (decode context parallel)


@dataclass(frozen=True)
class Abort:
    role: str
    room: int


@dataclass(frozen=True, kw_only=True)
class WriteDone:
    op_id: int
    room: int
    ok: bool
    reason: str | None
    tags: tuple[bytes, ...] = ()    # the signed tags of its backend writes (WriterDone repeats them)


@dataclass(frozen=True, kw_only=True)
class LayersReady:
    """A direct write's readiness objects were waited on (error: why that failed)."""

    op_id: int
    room: int
    error: str | None


@dataclass(frozen=True, kw_only=True)
class UnitReady:
    """A batching room's held unit: its readiness objects were waited on (error: why that failed)."""

    room: int
    seq: int
    error: str | None


@dataclass(frozen=True)
class Wake:
    """Work is queued for the control thread's backend (a transfer worker posted a write)."""


@dataclass(frozen=True, kw_only=True)
class ScatterDone:
    room: int
    key: tuple[int, int]
    ok: bool
    reason: str | None
    kind: str = FailureKind.SCATTER  # the failure kind when not ok ("corrupt": the digest disagreed)


@dataclass(frozen=True)
class LookupDone:
    engine_id: str
    records: list[RankRecord] | None
    error: str | None


@dataclass(frozen=True)
class Call(Generic[T]):
    """Run fn() on the control thread and hand the result to `done` (used by close/stats)."""

    fn: Callable[[EngineLoop], T]
    done: Callable[[T], None]
