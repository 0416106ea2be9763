"""The scheduler side's bookkeeping and the per-step orders it gives the workers. Pure: it
reads request fields (request_id, num_prompt_tokens, kv_transfer_params, status flags given by
the caller) and returns decisions; vLLM's classes stay in connector.py.

Prefill: a request with `do_remote_decode` gets a room at its first scheduled step, and every
step tells the workers which of its prompt pages that step's forward completes (`StreamOrder`);
they send them layer by layer from `save_kv_layer`. Its blocks stay held (`request_finished` ->
delay free) until every worker says its sender ended. A preempted request's room is dropped
(`DropOrder`; it was never published) and a new one opens when it runs again. Chunk-wise
fallback (`layerwise` off, or a request no step showed): the room is picked when the request
finished and its prompt pages go in one `SendOrder`.

Decode: a request naming a kvstage room loads every prompt token asynchronously; once vLLM
allocated its blocks, a `RecvOrder` tells the workers where the pages go (its locally cached
prefix pages are skipped). An abort on either side becomes an
`AbortOrder`, which kvstage carries to the other side.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from .params import (
    DP_RANK,
    ENGINE,
    RENDEZVOUS,
    ROOM,
    TP_SIZE,
    RemotePrefill,
    prompt_pages,
    remote_prefill,
    wants_remote_decode,
)


@dataclass(frozen=True, kw_only=True)
class SendOrder:
    req_id: str
    room: int
    pages: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class StreamOrder:
    """Prefill, layer-wise: one step's part of a request's prompt pages. `open`: the request's
    first step here (a sender for `room` with `num_pages`); `before`: pages computed in earlier
    steps and not sent yet (prefill prefix-cache hits), every layer at once; `pages`: the pages
    this step's forward completes, sent layer by layer as the forward writes them."""

    req_id: str
    room: int
    num_pages: int
    open: bool
    before: tuple[int, ...]
    pages: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class DropOrder:
    """Prefill: vLLM preempted (and freed) a streaming request; abort its unpublished room."""

    req_id: str
    room: int


@dataclass(frozen=True, kw_only=True)
class Scheduled:
    """One request of a step as vLLM's SchedulerOutput gives it: tokens computed before the
    step and tokens this step computes."""

    computed: int
    count: int


@dataclass
class _Stream:
    room: int
    num_tokens: int
    sent: int = 0        # pages given to the workers so far


@dataclass(frozen=True, kw_only=True)
class RecvOrder:
    req_id: str
    source: RemotePrefill
    pages: tuple[int, ...]       # blocks past the local prefix, in request order
    prefix_pages: int            # blocks the decode side already holds (prefix cache)


@dataclass(frozen=True, kw_only=True)
class AbortOrder:
    req_id: str
    source: RemotePrefill | None = None   # decode: open a receiver only to abort it (never allocated)


@dataclass
class StepOrders:
    """One step's orders to every worker (vLLM pickles it into the workers)."""

    sends: list[SendOrder] = field(default_factory=list)
    recvs: list[RecvOrder] = field(default_factory=list)
    aborts: list[AbortOrder] = field(default_factory=list)
    streams: list[StreamOrder] = field(default_factory=list)
    drops: list[DropOrder] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.sends or self.recvs or self.aborts or self.streams or self.drops)


@dataclass(frozen=True, kw_only=True)
class PrefillIdentity:
    rendezvous: str
    dp_rank: int
    engine: str
    tp_size: int


class SchedulerPlan:
    """Requests in flight on this instance, and the orders not yet handed to the workers."""

    def __init__(self, *, is_prefill: bool, block_size: int, identity: PrefillIdentity | None = None,
                 new_room=lambda: secrets.randbits(63), layerwise: bool = True):
        self.is_prefill = is_prefill
        self.block_size = block_size
        self.identity = identity
        self.layerwise = layerwise and is_prefill
        self._new_room = new_room
        self._candidates: dict[str, int] = {}        # prefill: do_remote_decode requests -> prompt tokens
        self._streams: dict[str, _Stream] = {}       # prefill: layer-wise requests with a room
        self._pending = StepOrders()
        self._local_tokens: dict[str, int] = {}     # decode: locally cached tokens per request
        self._receiving: dict[str, RemotePrefill] = {}
        self._sending: dict[str, int] = {}           # prefill: req -> room, until its blocks are freed

    # -- decode -------------------------------------------------------------------------------
    def matched_tokens(self, req_id: str, num_prompt_tokens: int, params: dict | None,
                       num_computed_tokens: int) -> tuple[int, bool]:
        """get_num_new_matched_tokens: every prompt token past the local prefix, asynchronously."""
        if self.is_prefill or remote_prefill(params) is None:
            return 0, False
        count = num_prompt_tokens - num_computed_tokens
        if count <= 0:
            return 0, False
        self._local_tokens[req_id] = num_computed_tokens
        return count, True

    def allocated(self, req_id: str, num_prompt_tokens: int, params: dict | None, block_ids: list[int],
                  num_external_tokens: int) -> None:
        """update_state_after_alloc: the request's blocks are known; order the receive once
        (decode), or note a request to stream layer-wise (prefill)."""
        if self.layerwise and wants_remote_decode(params):
            self._candidates[req_id] = num_prompt_tokens
        source = None if self.is_prefill else remote_prefill(params)
        if source is None or num_external_tokens <= 0:
            return
        prefix = self._local_tokens.pop(req_id, 0) // self.block_size
        pages = tuple(block_ids[prefix:prompt_pages(num_prompt_tokens, self.block_size)])
        self._pending.recvs.append(RecvOrder(req_id=req_id, source=source, pages=pages, prefix_pages=prefix))
        self._receiving[req_id] = source
        params["do_remote_prefill"] = False      # vLLM may call this twice; load once

    def received(self, req_ids) -> None:
        """update_connector_output: these requests' receives ended (all workers)."""
        for r in req_ids or ():
            self._receiving.pop(r, None)

    # -- both ---------------------------------------------------------------------------------
    def finished(self, req_id: str, num_prompt_tokens: int, params: dict | None, block_ids: list[int],
                 completed: bool) -> tuple[bool, dict | None]:
        """request_finished: (delay freeing the blocks, kv_transfer_params for the client).
        `completed`: the request ended normally (not aborted or failed)."""
        if self.is_prefill:
            return self._prefill_finished(req_id, num_prompt_tokens, params, block_ids, completed)
        self._local_tokens.pop(req_id, None)
        if req_id in self._receiving:
            # ended while its KV was still coming: abort the receiver, hold the blocks until released
            self._pending.aborts.append(AbortOrder(req_id=req_id))
            return True, None
        try:
            source = remote_prefill(params)
        except ValueError:
            source = None
        if source is not None:
            # never allocated: tell the prefill side, which holds the request's blocks for us
            self._pending.aborts.append(AbortOrder(req_id=req_id, source=source))
        return False, None

    # -- prefill, layer-wise ---------------------------------------------------------------------
    def streams(self, req_id: str) -> bool:
        """Whether build_connector_meta should describe this scheduled request (`step`)."""
        return req_id in self._candidates

    def step(self, scheduled: dict[str, Scheduled], block_ids: Callable[[str], Sequence[int]],
             preempted: Iterable[str] = ()) -> None:
        """build_connector_meta: this step's streaming requests (`scheduled`, those `streams`
        named) and the requests vLLM preempted since the last step; `block_ids(req_id)`: the
        request's blocks now. A page is given once, when the step that completes it runs (the
        request's last page when its prompt is done)."""
        for r in preempted:
            old = self._streams.pop(r, None)
            if old is not None:
                self._pending.drops.append(DropOrder(req_id=r, room=old.room))
        bs = self.block_size
        for r, sch in scheduled.items():
            tokens = self._candidates.get(r)
            if tokens is None:
                continue
            stream = self._streams.get(r)
            n = prompt_pages(tokens, bs)
            if stream is not None and stream.sent >= n:
                continue
            opened = stream is None
            if stream is None:
                stream = self._streams[r] = _Stream(room=self._new_room(), num_tokens=tokens)
            done_before = min(sch.computed, tokens) // bs
            end = min(sch.computed + sch.count, tokens)
            done_after = n if end >= tokens else end // bs
            ids = tuple(block_ids(r))
            before = ids[stream.sent:done_before]
            pages = ids[max(stream.sent, done_before):done_after]
            if opened or before or pages:
                self._pending.streams.append(StreamOrder(req_id=r, room=stream.room, num_pages=n, open=opened,
                                                         before=before, pages=pages))
            stream.sent = max(stream.sent, done_after)

    def _prefill_finished(self, req_id, num_prompt_tokens, params, block_ids, completed):
        self._candidates.pop(req_id, None)
        stream = self._streams.pop(req_id, None)
        if stream is not None:
            self._sending[req_id] = stream.room
            if completed and wants_remote_decode(params) and stream.sent >= prompt_pages(stream.num_tokens,
                                                                                          self.block_size):
                return True, self._published(stream.room)
            # aborted mid-prefill: abort the sender; the blocks stay held until kvstage released them
            self._pending.aborts.append(AbortOrder(req_id=req_id))
            return True, None
        if not wants_remote_decode(params) or not completed:
            return False, None
        pages = tuple(block_ids[:prompt_pages(num_prompt_tokens, self.block_size)])
        if not pages:
            return False, None
        room = self._new_room()
        self._pending.sends.append(SendOrder(req_id=req_id, room=room, pages=pages))
        self._sending[req_id] = room
        return True, self._published(room)

    def _published(self, room: int) -> dict:
        """kv_transfer_params for the client: where the decode finds the KV."""
        ident = self.identity
        return {"do_remote_prefill": True, "do_remote_decode": False, ROOM: room, RENDEZVOUS: ident.rendezvous,
                DP_RANK: ident.dp_rank, ENGINE: ident.engine, TP_SIZE: ident.tp_size}

    def sent(self, req_ids) -> None:
        """update_connector_output: these requests' senders ended (all workers); blocks freed."""
        for r in req_ids or ():
            self._sending.pop(r, None)

    def take_orders(self) -> StepOrders:
        """build_connector_meta: this step's orders (each order is given once)."""
        orders, self._pending = self._pending, StepOrders()
        return orders

    def has_orders(self) -> bool:
        return bool(self._pending)

    @property
    def in_flight(self) -> int:
        return len(self._sending) + len(self._receiving) + len(self._streams)
