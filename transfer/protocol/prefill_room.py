"""The prefill side of one room: chunks in, writes out, success only when the decode confirms.

Pure state machine. The room learns which decode ranks it serves from the first room
metadata it receives (which names the decode TP size, hence the head mapping), writes each
chunk to each of them (direct: one write per chunk; staged: one write per granted piece),
reports its writes done, and succeeds when every decode rank it writes confirmed the room.
A rank that holds only replicas nobody needs hears from one decode rank and succeeds once
its input is complete, without writing.

On failure it tells its decode peers, stops issuing writes, and once nothing of its is in
flight any more says so (Quiesced), so the decode side can reuse the memory.

Control messages may be lost: it re-sends an AllocRequest until the grant arrives and its
WriterDone until the decode side confirms; duplicates it receives are ignored.

Room ids are reused: a failure or metadata is bound to engine + session + use (see
docs/protocol.md and room_uses.py); one of an earlier use of the id, or of another engine or
session than the flow it would hit, is dropped.
"""

from __future__ import annotations

import itertools

import numpy as np

from ..config import Timeouts
from ..layout import KVLayout
from ..poll import KVPoll
from .actions import (Action, DecodePrefix, Dropped, PeerKey, PostWrite, Released, RoomTotals, Send, StatusChanged,
                      WriteOp)
from .direct_ranges import direct_nbytes
from .flows import Chunk, Flow, past_prefix
from .head_mapping import Assignment, HeadMapping, compute_assignments
from .messages import AllocGrant, AllocRequest, Quiesced, RoomFailed, RoomMeta, WriterDone
from .pool_parts import block_bytes, counts_mismatch, final_part, request_copies, writer_segments
from .room_uses import EarlierUses
from .tags import TagKind, make_tag

TERMINAL = (KVPoll.Success, KVPoll.Failed)


class PrefillRoom:
    def __init__(self, room: int, num_pages: int | None, layout: KVLayout, me: int, now: float,
                 timeouts: Timeouts, op_ids: itertools.count | None = None, max_ranges: int = 65536,
                 stale: EarlierUses = EarlierUses(), pools: tuple = (), pool_items: dict | None = None):
        """`num_pages` None: the page count comes later, with init() (serving engines create the
        sender when the request arrives, before they know it). `pools`: the state pools' specs;
        `pool_items`: this request's items of them (validated by the caller's handle)."""
        if num_pages is not None and num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.room = room
        self.num_pages = num_pages
        self.layout = layout
        self.me = me
        self.timeouts = timeouts
        self.created = now
        self._op_ids = op_ids or itertools.count(1)
        self.max_ranges = max_ranges  # direct path: descriptors per write at most
        self.state = KVPoll.Bootstrapping
        self.failure: str | None = None
        self.failure_kind: str | None = None
        self.chunks: list[Chunk] = []       # as given: request page numbers
        self.prefix: int | None = None      # pages the decode side already holds (from its metadata)
        self.sendable: list[Chunk] = []     # the chunks' pages past the prefix, numbered from the prefix
        self._synced = 0                    # chunks already turned into sendable ones
        self.pages_given = 0
        self.last = False
        self.mapping: HeadMapping | None = None
        self.decode_engine: str | None = None
        self.expected: set[int] = set()
        self.flows: dict[int, Flow] = {}
        self.ops: dict[int, WriteOp] = {}
        self.released = False
        self.stale = stale                  # sessions of earlier uses of this id
        self.early: dict[tuple[PeerKey, int], tuple[str, str]] = {}  # failures parked before this sender
        self.failed_by: tuple[int, int] | None = None
        self.pools = pools
        self.pool_items: dict = pool_items or {}

    # -- inputs -----------------------------------------------------------------------------
    def init(self, num_pages: int, now: float, pool_items: dict | None = None) -> list[Action]:
        """The page count, for a sender created without one. Raises ValueError on bad input,
        unchanged. Metadata that came first is checked against it now."""
        if self.num_pages is not None:
            raise ValueError(f"room {self.room}: init() called twice, or on a sender created with num_pages")
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages <= 0:
            raise ValueError(f"room {self.room}: num_pages must be a positive int, got {num_pages!r}")
        self.num_pages = num_pages
        self.pool_items = pool_items or {}
        if self.state in TERMINAL:
            return []
        for flow in list(self.flows.values()):
            if flow.meta is not None:
                out = self._check_meta(flow, flow.meta, now)
                if out:
                    return out
        return self._pump(now)

    def add_chunk(self, pages: np.ndarray, last: bool | None, now: float) -> list[Action]:
        """The next pages of the request, in order; `last` None: this chunk is the last when it
        reaches the page count. Raises ValueError on bad input, unchanged."""
        if self.num_pages is None:
            raise ValueError(f"room {self.room}: send() before init(): the page count is not known yet")
        if self.last:
            raise ValueError(f"room {self.room}: send() after the last chunk")
        if self.pages_given + pages.size > self.num_pages:
            raise ValueError(f"room {self.room}: {self.pages_given + pages.size} pages sent, "
                             f"the sender was created for {self.num_pages}")
        if last and self.pages_given + pages.size != self.num_pages:
            raise ValueError(f"room {self.room}: last chunk ends at page {self.pages_given + pages.size} "
                             f"of {self.num_pages}")
        if last is None:
            last = self.pages_given + pages.size == self.num_pages
        start = self.pages_given
        self.pages_given += pages.size
        self.last = bool(last)
        if self.state in TERMINAL:
            return []  # input still accounted for, nothing more is written
        if pages.size:
            self.chunks.append(Chunk(len(self.chunks), start, pages))
        out = self._set_state(KVPoll.Transferring) if self._all_metas() else []
        return out + self._pump(now)

    def meta_use(self, peer: PeerKey, session: int) -> str:
        """Which use of the room id metadata from `peer` with `session` belongs to: "stale" (a
        retransmission from the id's earlier use), "next" (a decode incarnation this use already
        dealt with under another session has moved on: its room of this use is over there, and
        this is the next use's, to be kept for its sender) or "this"."""
        if self.stale.covers(peer.incarnation, session):
            return "stale"
        flow = self.flows.get(peer.tp_rank)
        if flow is not None and flow.peer == peer and flow.session != session:
            return "next"
        if self.failed_by is not None and self.failed_by[0] == peer.incarnation and self.failed_by[1] != session:
            return "next"
        return "this"

    def add_meta(self, peer: PeerKey, decode_tp: int, meta: RoomMeta, now: float) -> list[Action]:
        if self.state in TERMINAL:
            if self.state is KVPoll.Failed:
                # never wrote to a peer it had not heard from: it may reuse its memory at once
                return [Send(peer, self._failed_msg(peer, meta.session)),
                        Send(peer, Quiesced(src=self.me, dst=peer.incarnation, room=self.room, session=meta.session))]
            return []
        if self.decode_engine is not None and peer.engine_id != self.decode_engine:
            return [Send(peer, RoomFailed(src=self.me, dst=peer.incarnation, room=self.room, session=meta.session,
                                          kind="protocol", reason=f"room {self.room} is already bound to "
                                                                  f"decode engine {self.decode_engine}"))]
        if self.mapping is None:
            self.mapping = compute_assignments(self.layout.tp_size, decode_tp, self.layout.total_kv_heads,
                                               self.layout.mla)
            self.decode_engine = peer.engine_id
            self.expected = set(self.mapping.decode_peers_of(self.layout.tp_rank))
        if peer.tp_rank not in self.expected:
            return [Send(peer, RoomFailed(src=self.me, dst=peer.incarnation, room=self.room, session=meta.session,
                                          kind="protocol", reason=f"prefill rank {self.layout.tp_rank} does not "
                                                                  f"serve decode rank {peer.tp_rank}"))]
        old = self.flows.get(peer.tp_rank)
        if old is not None:
            if old.peer == peer and old.session == meta.session:
                return []  # duplicate
            return self.fail("protocol", f"decode rank {peer.tp_rank} sent metadata for room {self.room} twice "
                                         f"({old.peer} then {peer})", now)
        flow = Flow(peer, meta.session, self.mapping.find(self.layout.tp_rank, peer.tp_rank),
                    meta.staged, None)
        self.flows[peer.tp_rank] = flow
        prefix_news: list[Action] = []
        if self.prefix is None:
            self.prefix = meta.prefix_pages
            prefix_news = [DecodePrefix(self.prefix)]
        elif meta.prefix_pages != self.prefix:  # every decode rank is told (this one has its flow now)
            return self.fail("protocol", f"decode ranks of room {self.room} disagree on the prefix they hold: "
                                         f"{self.prefix} pages, then {meta.prefix_pages} from decode rank "
                                         f"{peer.tp_rank}", now)
        early = self.early.pop((peer, meta.session), None)
        if early is not None:  # its decode room failed before this metadata reached us
            return self.on_room_failed(peer, meta.session, *early, now)
        for key in [k for k in self.early if k[0] == peer]:
            del self.early[key]  # that decode rank's earlier session: an earlier use of the id
        if self.num_pages is None:
            flow.meta = meta  # checked at init()
        else:
            bad = self._check_meta(flow, meta, now)
            if bad:
                return prefix_news + bad
        out: list[Action] = prefix_news
        if self._all_metas():
            out += self._set_state(KVPoll.Transferring if self.chunks or self.last else KVPoll.WaitingForInput)
        return out + self._pump(now)

    def _check_meta(self, flow: Flow, meta: RoomMeta, now: float) -> list[Action]:
        """The decode rank's page count (and direct destination pages) against ours: [] when
        they agree, else the room fails."""
        flow.meta = None
        rank = flow.peer.tp_rank
        if meta.num_pages != self.num_pages:
            return self.fail("protocol", f"decode rank {rank} expects {meta.num_pages} pages, this "
                                         f"prefill rank was given {self.num_pages}", now)
        mismatch = counts_mismatch(self.pool_items, {k: v.size for k, v in meta.items().items()})
        if mismatch and flow.assignment is not None:
            return self.fail("pool", f"decode rank {rank}: {mismatch}", now)
        flow.pool_dst = meta.items()
        if not 0 <= meta.prefix_pages < self.num_pages:
            return self.fail("protocol", f"decode rank {rank} holds a prefix of {meta.prefix_pages} pages of a "
                                         f"{self.num_pages}-page request: at least one page must be sent", now)
        if flow.assignment is not None and not meta.staged:
            pages = meta.pages()
            if pages.size != self.num_pages - meta.prefix_pages:
                return self.fail("protocol", f"decode rank {rank} sent {pages.size} destination pages "
                                             f"for {self.num_pages} pages past a prefix of {meta.prefix_pages}", now)
            flow.dst_pages = pages
        return []

    def on_grant(self, peer: PeerKey, grant: AllocGrant, now: float) -> list[Action]:
        flow = self._flow_of(peer, grant.session)
        if flow is None or self.state in TERMINAL or grant.chunk in flow.granted:
            return []  # a repeated grant (we asked twice): already acted upon
        if not flow.staged or grant.chunk not in flow.requested_at:
            return self.fail("protocol", f"unexpected ring allocation for chunk {grant.chunk} from {peer}", now)
        chunk = self.sendable[grant.chunk]
        a = flow.assignment
        per_head = self._bytes_per_page(1)
        pos = chunk.page_start
        out: list[Action] = []
        for piece in grant.pieces:
            lo = piece.page_start - chunk.page_start
            nbytes = piece.num_pages * per_head * a.num_heads
            offset = piece.num_pages * per_head * a.dst_heads[0]  # parts follow in head order
            pools = ()
            if piece.page_start + piece.num_pages == self.num_pages - self.prefix and self.pool_items:
                # the last piece: each writer's part ends with its pool block
                offset, pools = final_part(self.pools, self.mapping, a, piece.num_pages * per_head, self.pool_items,
                                           flow.pool_dst)
                nbytes += block_bytes(pools)
            if (piece.page_start != pos or piece.num_pages <= 0 or lo + piece.num_pages > chunk.pages.size
                    or offset + nbytes > piece.region_nbytes):
                return self.fail("protocol", f"ring allocation for chunk {grant.chunk} from {peer} does not "
                                             f"match the chunk: {piece}", now)
            pos += piece.num_pages
            tag = make_tag(TagKind.STAGED, room=self.room, session=flow.session, epoch=grant.epoch, src=self.me,
                           writer=self.layout.tp_rank, chunk=grant.chunk, piece=piece.index,
                           page_start=piece.page_start, num_pages=piece.num_pages,
                           nbytes=nbytes, ring_start=piece.start)
            op = WriteOp(op_id=next(self._op_ids), room=self.room, peer=peer, staged=True, chunk=grant.chunk,
                         piece=piece.index, src_pages=chunk.pages[lo:lo + piece.num_pages], dst_pages=None,
                         src_heads=a.src_heads, dst_heads=a.dst_heads, nbytes=nbytes, tag=tag,
                         ring_start=piece.start, writer_offset=offset, pools=pools)
            out.append(self._post(flow, op))
        if pos != chunk.page_start + chunk.pages.size:
            return self.fail("protocol", f"ring allocation for chunk {grant.chunk} from {peer} does not cover it",
                             now)
        flow.granted.add(grant.chunk)
        return out

    def on_write_done(self, op_id: int, ok: bool, reason: str | None, now: float) -> list[Action]:
        op = self.ops.pop(op_id, None)
        if op is None:
            return []
        flow = self.flows[op.peer.tp_rank]
        flow.inflight.discard(op_id)
        if not ok and flow.confirmed:
            # the decode rank already has every byte (it confirmed the room): a write reported
            # failed now was released after it landed (e.g. the peer left and was disconnected)
            return self._check_done(now) + self._maybe_release()
        if not ok:
            out = self.fail("write", f"write of chunk {op.chunk} piece {op.piece} to {op.peer} failed: {reason}",
                            now)
            return out + self._maybe_release()
        flow.writes += 1
        flow.nbytes += op.nbytes
        return self._check_done(now) + self._maybe_release()

    def on_room_done(self, peer: PeerKey, session: int, now: float) -> list[Action]:
        flow = self._flow_of(peer, session)
        if flow is None or self.state in TERMINAL:
            return []
        flow.confirmed = True
        return self._check_done(now)

    def on_room_failed(self, peer: PeerKey, session: int, kind: str, reason: str, now: float,
                       early: bool = False) -> list[Action]:
        """`early`: it arrived before this sender existed (parked by the shell)."""
        flow = self._flow_of(peer, session)
        if flow is None:
            bound = self.flows.get(peer.tp_rank)
            if (self.stale.covers(peer.incarnation, session) or bound is not None
                    or (self.decode_engine is not None and peer.engine_id != self.decode_engine)):
                # an earlier use's, or another engine's: nothing of this use went to that session
                return [Send(peer, Quiesced(src=self.me, dst=peer.incarnation, room=self.room, session=session)),
                        Dropped("stale_room_failed")]
            if self.mapping is not None and peer.tp_rank not in self.expected:
                return []
            if early:
                self.early[(peer, session)] = (kind, reason)
                return []
        self.failed_by = (peer.incarnation, session)
        return self.fail(kind if kind.startswith("remote_") else f"remote_{kind}", f"decode rank {peer.tp_rank} ({peer.engine_id}): {reason}", now,
                         origin=peer)

    def on_peer_lost(self, peer: PeerKey, reason: str, now: float) -> list[Action]:
        flow = self.flows.get(peer.tp_rank)
        if flow is None or flow.peer != peer:
            return []
        if flow.confirmed:
            # it confirmed the room (has every byte) before it went, e.g. it closed right after:
            # only our own completions are outstanding, and the room succeeds once they are in
            return self._check_done(now)
        # writes to a lost peer will never be confirmed; the shell fails those in flight
        return self.fail("peer_lost", f"decode rank {peer.tp_rank} ({peer}) lost: {reason}", now)

    def abort(self, now: float) -> list[Action]:
        return self.fail("aborted", "aborted by the prefill caller", now)

    def tick(self, now: float) -> list[Action]:
        if self.state in TERMINAL:
            return []
        return self._retransmit(now) + self._bind_early(now) + self._deadlines(now)

    def _bind_early(self, now: float) -> list[Action]:
        """A parked failure whose decode rank sent no metadata of another session within a lease
        of this sender's creation is this use's: its decode room failed before its metadata went
        out (an earlier use whose prefill sender was never created here would be followed by new
        metadata from that rank well within a lease)."""
        if not self.early or now - self.created <= self.timeouts.lease:
            return []
        (peer, session), (kind, reason) = next(iter(self.early.items()))
        self.early.clear()
        return self.on_room_failed(peer, session, kind, f"{reason} (before its room metadata went out)", now)

    def _retransmit(self, now: float) -> list[Action]:
        out: list[Action] = []
        retry = self.timeouts.heartbeat
        for flow in self.flows.values():
            for chunk, first in flow.requested_at.items():
                if chunk not in flow.granted and now - flow.asked_again.get(chunk, first) >= retry:
                    flow.asked_again[chunk] = now
                    out.append(self._alloc_request(flow, self.sendable[chunk]))
            if flow.done_sent_at is not None and not flow.confirmed and now - flow.asked_again.get(-1, flow.done_sent_at) >= retry:
                flow.asked_again[-1] = now
                out.append(self._writer_done(flow))
        return out

    def _alloc_request(self, flow: Flow, chunk: Chunk) -> Send:
        return Send(flow.peer, AllocRequest(src=self.me, dst=flow.peer.incarnation, room=self.room,
                                            session=flow.session, chunk=chunk.index, page_start=chunk.page_start,
                                            num_pages=int(chunk.pages.size)))

    def _writer_done(self, flow: Flow) -> Send:
        return Send(flow.peer, WriterDone(src=self.me, dst=flow.peer.incarnation, room=self.room,
                                          session=flow.session, writes=flow.writes, nbytes=flow.nbytes))

    def _deadlines(self, now: float) -> list[Action]:
        t = self.timeouts
        if not self._all_metas() and now - self.created > t.metadata:
            who = f"decode rank(s) {sorted(self.expected - set(self.flows))}" if self.mapping else "any decode rank"
            return self.fail("timeout", f"no room metadata from {who} within {t.metadata:g} s", now)
        for flow in self.flows.values():
            for chunk, asked in flow.requested_at.items():
                if chunk not in flow.granted and now - asked > t.watermark:
                    return self.fail("timeout", f"no ring allocation for chunk {chunk} from {flow.peer} within "
                                                f"{t.watermark:g} s", now)
            if flow.done_sent_at is not None and not flow.confirmed and now - flow.done_sent_at > t.arrival + t.scatter:
                return self.fail("timeout", f"decode rank {flow.peer.tp_rank} did not confirm the room within "
                                            f"{t.arrival + t.scatter:g} s of the last write", now)
        return []

    def fail(self, kind: str, reason: str, now: float, origin: PeerKey | None = None) -> list[Action]:
        """Fail the room and tell every decode peer but the one the failure came from."""
        if self.state in TERMINAL:
            return []
        self.failure, self.failure_kind = reason, kind
        out: list[Action] = self._set_state(KVPoll.Failed)
        for flow in self.flows.values():
            if flow.peer != origin:
                out.append(Send(flow.peer, self._failed_msg(flow.peer, flow.session)))
        return out + self._maybe_release()

    def totals(self) -> RoomTotals:
        """Bytes and writes completed, summed over the decode ranks written."""
        writing = [f for f in self.flows.values() if f.assignment is not None]
        path = "none" if not writing else "staged" if any(f.staged for f in writing) else "direct"
        return RoomTotals(sum(f.nbytes for f in writing), sum(f.writes for f in writing), path)

    def sessions(self) -> frozenset:
        """(decode incarnation, session) pairs this use dealt with: stale for the next use of the id."""
        out = {(f.peer.incarnation, f.session) for f in self.flows.values()}
        if self.failed_by is not None:
            out.add(self.failed_by)
        return frozenset(out)

    # -- internals --------------------------------------------------------------------------
    @property
    def inflight(self) -> int:
        return len(self.ops)

    def _failed_msg(self, peer: PeerKey, session: int) -> RoomFailed:
        return RoomFailed(src=self.me, dst=peer.incarnation, room=self.room, session=session,
                          kind=self.failure_kind or "failed", reason=self.failure or "")

    def _flow_of(self, peer: PeerKey, session: int) -> Flow | None:
        flow = self.flows.get(peer.tp_rank)
        if flow is None or flow.peer != peer or flow.session != session:
            return None
        return flow

    def _all_metas(self) -> bool:
        return self.mapping is not None and self.expected <= set(self.flows)

    def _bytes_per_page(self, num_heads: int) -> int:
        return direct_nbytes(self.layout.num_kv * self.layout.num_layers, 1, self.layout.page_size,
                             num_heads, self.layout.head_bytes)

    def _post(self, flow: Flow, op: WriteOp) -> PostWrite:
        self.ops[op.op_id] = op
        flow.inflight.add(op.op_id)
        return PostWrite(op)

    def _sync_sendable(self) -> None:
        if self.prefix is not None:
            self.sendable += past_prefix(self.chunks[self._synced:], self.prefix, len(self.sendable))
            self._synced = len(self.chunks)

    def _pump(self, now: float) -> list[Action]:
        if self.state in TERMINAL or not self._all_metas():
            return []  # nothing is written before every decode rank's metadata agreed (pages, prefix)
        self._sync_sendable()
        out: list[Action] = []
        for flow in self.flows.values():
            a = flow.assignment
            if a is None:
                continue
            while flow.issued < len(self.sendable):
                chunk = self.sendable[flow.issued]
                if flow.staged:
                    flow.requested_at[chunk.index] = now
                    out.append(self._alloc_request(flow, chunk))
                else:
                    out += self._direct_writes(flow, a, chunk)
                flow.issued += 1
        return out + self._check_done(now)

    def _direct_writes(self, flow: Flow, a: Assignment, chunk: Chunk) -> list[Action]:
        """One write per chunk, split by page range when it would exceed max_ranges descriptors
        (each part with its own tag): a write of millions of ranges would hold the backend for
        seconds at a time."""
        whole = self.mapping.prefill_tp == self.mapping.decode_tp or self.layout.mla
        per_page = self.layout.num_kv * self.layout.num_layers * (1 if whole else self.layout.page_size)
        step = max(1, self.max_ranges // per_page)
        out: list[Action] = []
        for part, lo in enumerate(range(0, chunk.pages.size, step)):
            pages = chunk.pages[lo:lo + step]
            start = chunk.page_start + lo
            nbytes = pages.size * self._bytes_per_page(a.num_heads)
            pools = ()
            if start + pages.size == self.num_pages - self.prefix:  # the write carrying the last page
                pools = request_copies(writer_segments(self.pools, self.mapping.prefill_tp, self.mapping.decode_tp, a),
                                       self.pool_items, flow.pool_dst)
                nbytes += block_bytes(pools)
            tag = make_tag(TagKind.DIRECT, room=self.room, session=flow.session, epoch=flow.peer.incarnation,
                           src=self.me, writer=self.layout.tp_rank, chunk=chunk.index, piece=part,
                           page_start=start, num_pages=int(pages.size), nbytes=nbytes)
            dst = flow.dst_pages[start:start + pages.size]
            out.append(self._post(flow, WriteOp(op_id=next(self._op_ids), room=self.room, peer=flow.peer, staged=False,
                                                chunk=chunk.index, piece=part, src_pages=pages, dst_pages=dst,
                                                src_heads=a.src_heads, dst_heads=a.dst_heads, nbytes=nbytes, tag=tag,
                                                pools=pools)))
        return out

    def _flow_finished_writing(self, flow: Flow) -> bool:
        return (self.last and flow.issued == len(self.sendable) and not flow.inflight
                and (not flow.staged or len(flow.granted) == len(self.sendable)))

    def _check_done(self, now: float) -> list[Action]:
        if self.state in TERMINAL or not self._all_metas():
            return []
        out: list[Action] = []
        for flow in self.flows.values():
            if flow.assignment is None or flow.done_sent_at is not None:
                continue
            if self._flow_finished_writing(flow):
                flow.done_sent_at = now
                if not flow.confirmed:  # a decode rank that confirmed needs no WriterDone (and may be gone)
                    out.append(self._writer_done(flow))
        if self.last and all(f.assignment is None or (f.confirmed and f.done_sent_at is not None)
                             for f in self.flows.values()):
            out += self._set_state(KVPoll.Success) + self._maybe_release()
        return out

    def _set_state(self, state: KVPoll) -> list[Action]:
        if state == self.state or self.state in TERMINAL:
            return []
        self.state = state
        return [StatusChanged(state, self.failure, self.failure_kind)]

    def _maybe_release(self) -> list[Action]:
        if self.released or self.state not in TERMINAL or self.ops:
            return []
        self.released = True
        out: list[Action] = []
        if self.state is KVPoll.Failed:
            for flow in self.flows.values():
                if flow.assignment is not None:
                    out.append(Send(flow.peer, Quiesced(src=self.me, dst=flow.peer.incarnation, room=self.room,
                                                        session=flow.session)))
        return out + [StatusChanged(self.state, self.failure, self.failure_kind, released=True), Released()]
