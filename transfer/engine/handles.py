"""The public per-request handles, `KVSender` and `KVReceiver`.

They validate input in the caller's thread (a bad call raises and changes nothing), then hand
it to the control thread; `poll()` reads a status the control thread publishes under a lock.
A handle is meant for one caller thread at a time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ...hop_trace import TRACE, Hop
from ...staging.page_lists import check_pages
from ..outcome import KVTransferError, TransferMetrics
from ..poll import KVPoll
from ..pool_spec import check_pool_items
from ..protocol.prefill.layer_sends import SendLedger, check_late_items, check_page_count
from ..timeline import TimelineRecorder
from .events import Abort, InitReceiver, InitSender, SendChunk

if TYPE_CHECKING:
    from ..protocol.actions import RoomTotals
    from ..state_pools import StatePool

Post = Callable[[object], None]   # hands an event to the control thread; raises once the manager closed
# a request's items of the state pools, as the caller gives them ({pool name: [item, ...]}, any
# int sequence or array: check_pool_items validates them)
PoolItemsArg = dict[str, Any]


@dataclass(frozen=True)
class Snapshot:
    """A room's status at one moment, as the caller reads it."""

    state: KVPoll
    failure: str | None
    failure_kind: str | None
    released: bool


@dataclass(frozen=True)
class Ended:
    """A room's state with its totals and when it ended (None: it has not)."""

    state: KVPoll
    totals: RoomTotals | None
    ended_at: float | None


def release_gil() -> None:
    """Let another Python thread take the interpreter now: `time.sleep(0)` drops the GIL."""
    time.sleep(0)


class RoomStatus:
    """Written by the control thread, read by the caller.

    A caller blocked in `wait()` is woken when the room ends or is released. Waking it only
    makes its thread runnable: it still needs the interpreter (the GIL), which CPython hands
    over only when the thread holding it blocks or after its switch interval, so a caller would
    wait for the rest of the control thread's round. `update` therefore gives the interpreter
    away (`hand_over`, by default `release_gil`) right after it woke a waiting caller, and only
    then; it never does when nobody waits (a caller that polls) or on a change nobody waits for.
    """

    def __init__(self, hand_over: Callable[[], None] = release_gil) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._hand_over = hand_over
        self._waiting = 0                   # callers blocked in wait() (the lock guards it)
        self.state = KVPoll.Bootstrapping
        self.failure: str | None = None
        self.failure_kind: str | None = None
        self.released = False
        self.totals: RoomTotals | None = None   # once the request ended
        self.ended_at: float | None = None
        self.cleared = False                # the caller dropped the handle (the manager's lock guards it)
        self.decode_prefix_pages: int | None = None   # prefill: pages the decode side holds (one int: atomic)
        self.timeline = TimelineRecorder(time.monotonic())   # its own lock: caller and control thread stamp it
        self.descriptors = 0                # prefill: backend descriptors posted (control thread only)

    def update(self, state: KVPoll, failure: str | None, kind: str | None, released: bool,
               totals: RoomTotals | None = None) -> None:
        with self._lock:
            self.state = state
            self.failure, self.failure_kind = failure, kind
            self.released = self.released or released
            if totals is not None and self.ended_at is None:
                self.totals, self.ended_at = totals, time.monotonic()
                self.timeline.stamp("ended", self.ended_at)
            woke = self._waiting > 0 and (released or state in (KVPoll.Success, KVPoll.Failed))
            if woke:   # all that waiters wait for
                self._changed.notify_all()
        if woke:
            self._hand_over()

    def ended(self) -> Ended:
        with self._lock:
            return Ended(self.state, self.totals, self.ended_at)

    def snapshot(self) -> Snapshot:
        with self._lock:
            return Snapshot(self.state, self.failure, self.failure_kind, self.released)

    def wait(self, predicate: Callable[[RoomStatus], bool], timeout: float | None) -> bool:
        with self._lock:
            self._waiting += 1
            try:
                return self._changed.wait_for(lambda: predicate(self), timeout)
            finally:
                self._waiting -= 1


class _Handle:
    """`post`, `cache_pages` and `forget` come from the manager; a handle needs nothing else of it."""

    def __init__(self, post: Post, cache_pages: int, room: int, role: str, status: RoomStatus,
                 forget: Callable[[int, RoomStatus], None] | None = None):
        self._post, self._cache_pages, self._forget = post, cache_pages, forget
        self.room, self._role, self._status = room, role, status
        self._started: float | None = None   # init() (or a sender created with its page count)

    def _mark_init(self) -> float:
        """Stamped before the event goes to the control thread, so every later phase comes after."""
        now = time.monotonic()
        self._status.timeline.stamp("init", now)
        return now

    def poll(self) -> KVPoll:
        return self._status.snapshot().state

    @property
    def failure(self) -> str | None:
        """Why the request failed (None unless poll() is Failed)."""
        return self._status.snapshot().failure

    @property
    def failure_kind(self) -> str | None:
        return self._status.snapshot().failure_kind

    @property
    def released(self) -> bool:
        """True once no write of this request can still land: its memory may be reused."""
        return self._status.snapshot().released

    def wait(self, timeout: float | None = None) -> KVPoll:
        """Block until Success or Failed (or the timeout); return the state."""
        self._status.wait(lambda s: s.state in (KVPoll.Success, KVPoll.Failed), timeout)
        if TRACE.on:
            TRACE.hop(Hop.WAITER_WOKEN, self.room, "wait() returned")
        return self.poll()

    def metrics(self) -> TransferMetrics | None:
        """What the request moved, how long it took and when each phase happened (its timeline);
        None until it ended (Success or Failed)."""
        end = self._status.ended()
        totals = end.totals
        if totals is None or end.ended_at is None:
            return None
        seconds = end.ended_at - self._started if self._started is not None else None
        return TransferMetrics(
            state=end.state,
            nbytes=totals.nbytes,
            backend_writes=totals.writes,
            path=totals.path,
            seconds=seconds,
            timeline=self._status.timeline.timeline(),
            merged_sends=totals.merged,
            predicted_s=totals.predicted_s,
            path_reason=totals.path_reason,
        )

    def failure_exception(self) -> KVTransferError | None:
        """The failure as an exception object (kind and reason), None unless poll() is Failed."""
        now = self._status.snapshot()
        if now.state is not KVPoll.Failed:
            return None
        return KVTransferError(self.room, now.failure_kind or "failed", now.failure or "")

    def abort(self) -> None:
        """Fail the request here and at its peers; resources are released once nothing can land."""
        self._post(Abort(self._role, self.room))

    def clear(self) -> None:
        """Done with this request: the manager forgets it once it is released. Before it ended,
        this aborts it first. Idempotent; harmless after the manager closed."""
        if self._status.snapshot().state not in (KVPoll.Success, KVPoll.Failed):
            try:
                self.abort()
            except RuntimeError:  # the manager closed: it failed and releases every room itself
                pass
        if self._forget is not None:
            self._forget(self.room, self._status)

    close = clear

    def __repr__(self) -> str:
        now = self._status.snapshot()
        failure = now.failure
        return f"<{type(self).__name__} room={self.room} {now.state.name}{': ' + failure if failure else ''}>"


def check_num_tokens(room: int, num_tokens: object) -> None:
    """A request's token count: None (not given) or a positive int."""
    if num_tokens is not None and (isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens <= 0):
        raise ValueError(f"room {room}: num_tokens must be a positive int, got {num_tokens!r}")


class KVSender(_Handle):
    """Prefill side of one request: give it the page count (at creation or with init()), then
    feed it chunk by chunk with send()."""

    def __init__(
        self,
        post: Post,
        cache_pages: int,
        room: int,
        num_pages: int | None,
        status: RoomStatus,
        forget: Callable[[int, RoomStatus], None] | None = None,
        pools: dict[str, StatePool] | None = None,
        layers: range | None = None,
        pool_items: dict[str, np.ndarray] | None = None,
    ):
        """`layers`: the layers this rank holds (None: one layer; the manager passes the
        layout's); `pool_items`: the items given with the page count at creation."""
        super().__init__(post, cache_pages, room, "prefill", status, forget)
        self.num_pages = num_pages
        self._pools = pools or {}
        self._ledger = SendLedger(room=room, stage=layers if layers is not None else range(1))
        self._init_items: dict[str, np.ndarray] = pool_items or {}   # pools named at creation or init()
        if num_pages is not None:
            self._started = self._mark_init()
            self._ledger.set_page_count(num_pages)

    @property
    def decode_prefix_pages(self) -> int | None:
        """How many of the request's first pages the decode side already holds (its prefix
        cache); they are not sent. None until the decode side's metadata arrived."""
        return self._status.decode_prefix_pages

    def init(self, num_pages: int, pool_items: PoolItemsArg | None = None, *, num_tokens: int | None = None) -> None:
        """The request's page count on this rank, for a sender created without one, and its
        items of the state pools ({pool name: [item, ...]}, moved with the last page). Allowed in
        any state: before the decode side's metadata arrived, the request waits for it.
        `num_tokens`: the request's token count, needed when the decode engine has decode
        context parallel (each decode rank receives exactly its tokens; docs/api.md)."""
        if TRACE.on:
            TRACE.hop(Hop.HANDLE_CALL, self.room, "sender init()")
        check_page_count(self.room, self.num_pages, num_pages)
        check_num_tokens(self.room, num_tokens)
        items = check_pool_items(pool_items, self._pools, f"room {self.room} init()")
        started = self._mark_init()
        self._post(InitSender(self.room, num_pages, items, num_tokens))
        self._init_items = items
        self.num_pages = num_pages
        self._ledger.set_page_count(num_pages)
        self._started = started

    def send(self, pages: object, last: bool | None = None, *, layers: range | None = None,
             ready: object = None, pool_items: PoolItemsArg | None = None) -> None:
        """The next pages of the request (indices into this rank's cache, in request order).

        `layers` (a range): send only these layers of the pages, as soon as the forward pass
        produced them (layer-wise sending); left out, every layer. Each layer advances through
        the request's pages on its own, so send each (page, layer) once; a send covers the
        positions its layers reached, and its pages must be those any other layer's send gave
        there. `ready`: an object with `synchronize()` (a CUDA event recorded after the layers
        were written) that kvstage's own thread waits on before reading them, never the
        caller's. `last` left out: the request ends when every (page, layer) was sent; given, it
        must agree with that. `pool_items`: the request's items of pools init() did not name
        ({pool name: [item, ...]}), on its last send only (serving engines that name a request's
        state only once its prefill is done keep streaming the KV chunk by chunk)."""
        if TRACE.on:
            TRACE.hop(Hop.HANDLE_CALL, self.room, "send()")
        self._ledger.check(np.empty(0, dtype=np.int64), layers, None)  # before the pages are read
        if ready is not None and not callable(getattr(ready, "synchronize", None)):
            raise ValueError(f"room {self.room}: ready must have a synchronize() method (a CUDA event), got "
                             f"{type(ready).__name__}")
        arr = check_pages(pages, self._cache_pages, f"room {self.room} send()", unique=False, host_only=True,
                          copy=True)
        step = self._ledger.check(arr, layers, last)
        items = check_pool_items(pool_items, self._pools, f"room {self.room} send()")
        check_late_items(self.room, self._init_items, items, step.last)
        self._post(SendChunk(room=self.room, pages=arr, last=step.last, layers=layers,
                             ready=(ready,) if ready is not None else (), pool_items=items or None))
        self._ledger.record(step, arr)


class KVReceiver(_Handle):
    """Decode side of one request: give it the destination pages with init()."""

    def __init__(
        self,
        post: Post,
        cache_pages: int,
        room: int,
        prefill_engine: str,
        status: RoomStatus,
        forget: Callable[[int, RoomStatus], None] | None = None,
        pools: dict[str, StatePool] | None = None,
    ):
        super().__init__(post, cache_pages, room, "decode", status, forget)
        self.prefill_engine = prefill_engine
        self._pools = pools or {}
        self._inited = False

    def init(self, dst_pages: object, prefix_pages: int = 0, pool_items: PoolItemsArg | None = None, *,
             num_tokens: int | None = None) -> None:
        """Page indices in this rank's cache for the request, in request order. With
        `prefix_pages` k, this rank already holds the request's first k pages (its prefix
        cache) and `dst_pages` are the pages for the rest: the prefill side skips the first k,
        and nothing is written to the pages holding them. `pool_items`: this rank's items of
        the state pools for the request ({pool name: [item, ...]}, as many per pool as the
        prefill side names); they are in place, bit-exact, when the request succeeds.
        With decode context parallel (KVLayout.dcp_size > 1): `dst_pages` and `prefix_pages` are
        this rank's local pages (its share of the request's virtual pages of page_size x
        dcp_size tokens) and `num_tokens`, the request's token count, is needed."""
        if TRACE.on:
            TRACE.hop(Hop.HANDLE_CALL, self.room, "receiver init()")
        if self._inited:
            raise ValueError(f"room {self.room}: init() called twice")
        if isinstance(prefix_pages, bool) or not isinstance(prefix_pages, int) or prefix_pages < 0:
            raise ValueError(f"room {self.room}: prefix_pages must be an int >= 0, got {prefix_pages!r}")
        arr = check_pages(dst_pages, self._cache_pages, f"room {self.room} init()", unique=True, host_only=True,
                          copy=True)
        if arr.size == 0:
            raise ValueError(f"room {self.room}: init() needs at least one page past the prefix")
        check_num_tokens(self.room, num_tokens)
        items = check_pool_items(pool_items, self._pools, f"room {self.room} init()")
        started = self._mark_init()
        self._post(InitReceiver(room=self.room, pages=arr, prefix_pages=prefix_pages, pool_items=items,
                                num_tokens=num_tokens))
        self._inited = True
        self._started = started
