"""The scheduler side's bookkeeping and the per-step orders it gives the workers. Pure: it
reads request fields (request_id, num_prompt_tokens, kv_transfer_params, status flags given by
the caller) and returns decisions; vLLM's classes stay in connector.py.

Prefill: a request with `do_remote_decode` that finished normally gets a room, its prompt pages
are pushed (one `SendOrder`), and its blocks stay held (`request_finished` -> delay free) until
every worker says its sender ended. Decode: a request naming a kvstage room loads every prompt
token asynchronously; once vLLM allocated its blocks, a `RecvOrder` tells the workers where the
pages go (its locally cached prefix pages are skipped). An abort on either side becomes an
`AbortOrder`, which kvstage carries to the other side.
"""

from __future__ import annotations

import secrets
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

    def __bool__(self) -> bool:
        return bool(self.sends or self.recvs or self.aborts)


@dataclass(frozen=True, kw_only=True)
class PrefillIdentity:
    rendezvous: str
    dp_rank: int
    engine: str
    tp_size: int


class SchedulerPlan:
    """Requests in flight on this instance, and the orders not yet handed to the workers."""

    def __init__(self, *, is_prefill: bool, block_size: int, identity: PrefillIdentity | None = None,
                 new_room=lambda: secrets.randbits(63)):
        self.is_prefill = is_prefill
        self.block_size = block_size
        self.identity = identity
        self._new_room = new_room
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
        """update_state_after_alloc: the request's blocks are known; order the receive once."""
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

    def _prefill_finished(self, req_id, num_prompt_tokens, params, block_ids, completed):
        if not wants_remote_decode(params) or not completed:
            return False, None
        pages = tuple(block_ids[:prompt_pages(num_prompt_tokens, self.block_size)])
        if not pages:
            return False, None
        room = self._new_room()
        self._pending.sends.append(SendOrder(req_id=req_id, room=room, pages=pages))
        self._sending[req_id] = room
        ident = self.identity
        return True, {"do_remote_prefill": True, "do_remote_decode": False, ROOM: room,
                      RENDEZVOUS: ident.rendezvous, DP_RANK: ident.dp_rank, ENGINE: ident.engine,
                      TP_SIZE: ident.tp_size}

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
        return len(self._sending) + len(self._receiving)
