"""The prefill half of a rank: decode ranks connecting, senders, and what decode ranks say
about rooms (metadata, ring grants, watermarks, outcomes).

Messages about a room can arrive before the caller created its sender; they are parked (up to
the metadata timeout) and handed to the sender when it appears, marked early so a failure
that belongs to an earlier use of the same room id cannot fail this one.
"""

from __future__ import annotations

import itertools
import logging
from collections import defaultdict
from dataclasses import dataclass

from ..config import Timeouts
from ..layout import KVLayout, LayoutSummary
from ..poll import KVPoll
from ..protocol.actions import PeerKey, PrefillAction, SettleCredits
from ..protocol.hello_admission import PrefillFacts, admit_hello
from ..protocol.kinds import FailureKind, Role
from ..protocol.leases import Lease
from ..protocol.messages import (
    AllocGrant,
    CreditAck,
    CreditGrant,
    Heartbeat,
    Hello,
    HelloAck,
    MetaAck,
    Quiesced,
    RoomDone,
    RoomFailed,
    RoomMeta,
    WatermarkUpdate,
)
from ..protocol.path_choice import WriterCosts
from ..protocol.prefill.chunk_writes import WriteLimits
from ..protocol.prefill.layer_sends import PER_CHUNK, LayerGrouping
from ..protocol.prefill.room import PrefillRoom, answers_meta
from ..protocol.ring import Watermark
from ..protocol.room_uses import NO_EARLIER_USES, EarlierUses, Parked, RoomUse, unserved_answer, use_without_sender
from ..protocol.routing import HelloVerdict, PeerState, hello_verdict
from ..protocol.stage_mapping import stage_memory
from ..protocol.token_mapping import DCPLayout
from .events import Abort, InitSender, NewSender, SendChunk, UnitReady
from .interfaces import (
    Counters,
    EventHandler,
    MessageHandler,
    PrefillBackend,
    PrefillStaging,
    PrefillWrites,
    Sockets,
)
from .peers import Peer, PeerTable
from .ring_credits import PrefillCredits
from .rooms import PrefillBook

log = logging.getLogger("kvstage")

_OP_IDS = itertools.count(1)  # write ids, unique in the process
MAX_PENDING_ROOMS = 65536


@dataclass(frozen=True, kw_only=True)
class PrefillRank:
    """What a prefill rank says of itself as decode ranks connect (admission, HelloAck): plain
    values of its configuration, taken once at start."""

    engine_id: str
    backend: str                  # the backend's kind (EngineConfig.backend: "nixl", "mooncake")
    backend_name: str             # its name in the backend, for the decode rank's notifications
    verify: bool                  # EngineConfig.verify: digests on
    staging: bool                 # EngineConfig.staging: staging asked for here
    costs: WriterCosts | None     # the measured write costs (calibration.py; None: not measured)
    credits: bool                 # EngineConfig.credits
    piece_cap: int                # the largest staged piece in bytes (0: no cap)


class PrefillSide:
    writes_to_peers = True   # a peer whose write lease ran out is lost

    def __init__(self, *, me: int, rank: PrefillRank, layout: KVLayout, summary: LayoutSummary, timeouts: Timeouts,
                 stats: Counters, sock: Sockets, backend: PrefillBackend, staging: PrefillStaging, peers: PeerTable,
                 book: PrefillBook, writes: PrefillWrites, grouping: LayerGrouping = PER_CHUNK):
        """Rank `me` (`rank`: what it says of itself) with `layout` (its `summary`, what a decode
        rank's must match), by `timeouts`; `sock` sends a HelloAck to a peer not connected yet,
        `backend` connects and fences decode ranks, `staging` follows their rings' watermarks;
        `writes` (the write queue) takes staged pieces whose ring space freed up. `grouping`: how
        layer-wise sends become writes (EngineConfig.layer_group and layerwise_min_tokens)."""
        self.me, self.rank, self.layout, self.summary, self.t = me, rank, layout, summary, timeouts
        self.stats, self.sock, self.backend, self.staging = stats, sock, backend, staging
        self.peers, self.book, self.writes = peers, book, writes
        self.grouping = grouping
        self.limits = WriteLimits(relayout_bytes=staging.buffer_bytes)   # shared by every room of the rank
        self.served: dict[int, frozenset[tuple[int, int]]] = {}          # room that succeeded -> its (decode incarnation, session)s
        self.used_sessions: dict[int, EarlierUses] = {}  # finished room -> its uses' sessions (stale for the next)
        self.pending: dict[int, list[Parked]] = defaultdict(list)  # room -> messages that came before its sender
        self.pending_since: dict[int, float] = {}
        self.credits = PrefillCredits(   # ring credits
            me=me, peers=peers, book=book, stats=stats, staging=staging, credits=rank.credits,
            piece_cap=rank.piece_cap, heartbeat=timeouts.heartbeat, dispatch=lambda inc, now: self.writes.dispatch(inc, now))
        self.handlers: dict[type, MessageHandler] = {
            RoomMeta: self.on_RoomMeta, AllocGrant: self.on_AllocGrant, WatermarkUpdate: self.on_WatermarkUpdate,
            RoomDone: self.on_RoomDone, RoomFailed: self.on_RoomFailed, CreditGrant: self.credits.on_grant,
            CreditAck: lambda peer, msg, now: self.credits.on_ack(peer, msg)}
        self.events: dict[type, EventHandler] = {
            NewSender: self.new_sender, InitSender: self.init_sender, SendChunk: self.send_chunk, Abort: self.abort,
            UnitReady: self.unit_ready}

    # -- the connection handshake ---------------------------------------------------------------
    def on_hello(self, msg: Hello, now: float) -> None:
        """A decode rank connects."""
        if msg.role != Role.DECODE or msg.dst not in (0, self.me):
            self.stats.count("dropped_messages", "unexpected")
            return
        key = PeerKey(msg.engine_id, msg.tp_rank, msg.src)
        old = self.peers.get(msg.src)
        verdict = hello_verdict(old.state if old is not None else None, old.conn if old is not None else 0, msg.conn)
        if verdict == HelloVerdict.ACK_AGAIN:
            assert old is not None
            return self._send_ack(old, True, "")  # a retried Hello
        if verdict == HelloVerdict.STALE:
            self.stats.count("dropped_messages", "stale_connection")
            return
        if verdict == HelloVerdict.REPLACE:  # its side of the old connection is over: so is ours
            assert old is not None
            self.peers.lost(old, "it connected again (it had declared the connection lost)", now, tell=False)
        if msg.src in self.peers.replaced:
            self.stats.count("dropped_messages", "stale_peer")
            return
        if self.peers.came_back(msg.src):
            log.info("decode rank %s reconnects after it was lost", key)
        layout, rank = self.layout, self.rank
        adm = admit_hello(msg, PrefillFacts(
            summary=self.summary, tp_size=layout.tp_size, total_kv_heads=layout.total_kv_heads,
            mla=layout.mla, num_layers=layout.num_layers,
            stage=range(layout.layers.start, min(layout.layers.stop, layout.num_layers)),
            draft_layers=layout.draft_layers, verify=rank.verify,
            backend=rank.backend, memory_kinds=tuple(self.backend.call(lambda b: b.memory_kinds))))
        peer = Peer(key=key, role=Role.DECODE, tp_size=msg.tp_size, endpoint=msg.ctrl_endpoint,
                    lease=Lease(self.t.lease, now), kv=stage_memory(msg.kv, adm.stage) if adm.ok else msg.kv,
                    ring=msg.ring, since=now, conn=msg.conn, stage=adm.stage,
                    dcp=DCPLayout(dcp_size=msg.dcp_size, page_size=msg.layout.page_size, mla=msg.layout.mla)
                    if msg.dcp_size > 1 else None)
        self.peers.add(peer, now)
        problems = list(adm.problems)
        if not problems:
            try:
                peer.backend_name = self.backend.call(lambda b: b.connect(msg.backend_identity))
            except Exception as exc:  # noqa: BLE001
                problems.append(f"backend connect failed: {exc}")
        if problems:
            peer.state, peer.reason = PeerState.REJECTED, "; ".join(problems)
            log.error("rejecting decode rank %s: %s", key, peer.reason)
            self.stats.count("failures_by_kind", FailureKind.LAYOUT if not peer.backend_name else FailureKind.CONNECT)
            return self._send_ack(peer, False, peer.reason)
        self.peers.connected_via(peer, peer.backend_name)
        self.backend.fence(peer.backend_name, peer.lease.fence_base + peer.lease.lease_s)
        peer.staging = bool(msg.staging and msg.ring is not None and self.staging.buffers)
        if peer.staging and msg.ring is not None:
            self.staging.subscribe(key.incarnation, msg.ring.epoch, msg.ring.size)
            peer.credits = self.credits.connected(peer, msg)
        elif rank.staging:
            log.info("staging off towards decode rank %s: %s", key,
                     "it has no staging ring" if msg.ring is None or not msg.staging else "no staging buffers here")
        self._send_ack(peer, True, "")

    def _send_ack(self, peer: Peer, ok: bool, reason: str) -> None:
        rank = self.rank
        self.sock.send(peer.endpoint, HelloAck(
            src=self.me, dst=peer.key.incarnation, ok=ok, reason=reason, engine_id=rank.engine_id,
            tp_size=self.layout.tp_size, tp_rank=self.layout.tp_rank, backend_name=rank.backend_name,
            staging=bool(ok and peer.staging), buffer_bytes=self.staging.buffer_bytes, lease_s=self.t.lease,
            conn=peer.conn, costs=rank.costs if ok and peer.staging else None,
            credits=bool(ok and peer.credits)))

    def on_heartbeat(self, peer: Peer, msg: Heartbeat, now: float) -> None:
        """A heartbeat renews the write fence and may carry the decode ring's watermark."""
        if not peer.backend_name:
            return
        self.backend.fence(peer.backend_name, peer.lease.fence_base + peer.lease.lease_s)
        if msg.wm_epoch and self.staging.on_watermark(peer.key.incarnation, msg.wm_epoch,
                                                          Watermark(msg.wm_round, msg.wm_tail)):
            self.writes.dispatch(peer.key.incarnation, now)

    # -- the caller's events --------------------------------------------------------------------
    def new_sender(self, ev: NewSender, now: float) -> None:
        room = PrefillRoom(room=ev.room, num_pages=ev.num_pages, layout=self.layout, me=self.me, now=now,
                           timeouts=self.t, op_ids=_OP_IDS, stale=self.used_sessions.pop(ev.room, NO_EARLIER_USES),
                           pools=tuple(self.summary.pools), pool_items=ev.pool_items,
                           grouping=self.grouping, credits=self.credits, num_tokens=ev.num_tokens,
                           limits=self.limits)
        self.book.add(room, ev.status)
        self.served.pop(ev.room, None)
        for item in self.pending.pop(ev.room, []):
            self._item(room, item, now, early=True)  # parked before this use: bound by session
        self.pending_since.pop(ev.room, None)

    def init_sender(self, ev: InitSender, now: float) -> None:
        room = self.book.get(ev.room)
        if room is not None:
            self.book.apply(room, room.init(ev.num_pages, now, ev.pool_items, num_tokens=ev.num_tokens))

    def send_chunk(self, ev: SendChunk, now: float) -> None:
        room = self.book.get(ev.room)
        if room is not None:
            self.book.apply(room, room.add_chunk(ev.pages, ev.last, now, layers=ev.layers, ready=ev.ready,
                                                 pool_items=ev.pool_items))

    def unit_ready(self, ev: UnitReady, now: float) -> None:
        room = self.book.get(ev.room)
        if room is not None:
            self.book.apply(room, room.on_unit_ready(ev.seq, ev.error, now))

    def abort(self, ev: Abort, now: float) -> None:
        room = self.book.get(ev.room)
        if room is not None:
            self.book.apply(room, room.abort(now))

    # -- messages about rooms -------------------------------------------------------------------
    def _input(self, room_id: int, item: Parked, now: float) -> bool:
        """Hand a room's input to its sender, or park it for the sender to come. True when the
        room's answer to metadata already tells its decode rank the metadata came
        (prefill/room.py answers_meta): no MetaAck needed."""
        room = self.book.get(room_id)
        if room is not None:
            return self._item(room, item, now)
        key, msg = item.peer, item.msg
        me = self.me
        if not item.is_meta:
            # nothing of ours for this room is in flight to that peer (finished, or never started):
            # say so, in case an earlier Quiesced was lost; a failure parked below fails the
            # coming sender before it writes anything, so this holds for it too
            self.peers.send(key, Quiesced(src=me, dst=key.incarnation, room=room_id, session=msg.session))
        use = use_without_sender(item, ended=room_id in self.book.finished,
                                 earlier=self.used_sessions.get(room_id, EarlierUses()),
                                 served=self.served.get(room_id, ()))
        if use is RoomUse.OVER and item.is_meta:  # the decode side must not wait for a room that is over here
            done = self.book.finished[room_id]
            kind_, why = done.kind, done.reason
            self.peers.send(key, RoomFailed(src=me, dst=key.incarnation, room=room_id, session=msg.session,
                                            kind=kind_, reason=f"the prefill sender of this room has finished: {why}"))
            self.peers.send(key, Quiesced(src=me, dst=key.incarnation, room=room_id, session=msg.session))
        if use is not RoomUse.NEXT:  # SERVED: metadata this room already served (and acked) again: no news
            self.stats.count("dropped_messages", "finished_room")
            return False
        if len(self.pending) >= MAX_PENDING_ROOMS and room_id not in self.pending:
            self.stats.count("dropped_messages", "too_many_pending_rooms")
            return False
        self.pending[room_id].append(item)
        self.pending_since.setdefault(room_id, now)
        return False

    def _item(self, room: PrefillRoom, item: Parked, now: float, early: bool = False) -> bool:
        key, msg = item.peer, item.msg
        if isinstance(msg, RoomMeta):
            use = room.meta_use(key, msg.session)
            if use is RoomUse.STALE:  # a retransmission from the id's earlier use, acked late
                self.stats.count("dropped_messages", "stale_room_meta")
                return False
            if use is RoomUse.NEXT:  # this use is over at that decode rank: keep it for the next sender
                self.pending[room.room].append(item)
                self.pending_since.setdefault(room.room, now)
                return False
            peer = self.peers.get(key.incarnation)
            if peer is None or peer.state != PeerState.CONNECTED:
                return False
            self.credits.took_meta(room.room, key)
            actions = room.add_meta(key, peer.tp_size, msg, now, stage=peer.stage, dcp=peer.dcp)
            self.book.apply(room, actions)
            return answers_meta(actions, key)
        self.book.apply(room, room.on_room_failed(key, msg.session, msg.kind, msg.reason, now, early=early))
        return False

    def on_RoomMeta(self, peer: Peer, msg: RoomMeta, now: float) -> None:
        if not self._input(msg.room, Parked(peer.key, msg), now):  # the write goes out first
            self.peers.send(peer.key, MetaAck(src=self.me, dst=peer.key.incarnation, room=msg.room,
                                              session=msg.session))

    def on_AllocGrant(self, peer: Peer, msg: AllocGrant, now: float) -> None:
        room = self.book.get(msg.room)
        if room is not None:
            self.book.apply(room, room.on_grant(peer.key, msg, now))

    def on_WatermarkUpdate(self, peer: Peer, msg: WatermarkUpdate, now: float) -> None:
        if self.staging.on_watermark(peer.key.incarnation, msg.epoch, Watermark(msg.round, msg.tail)):
            self.writes.dispatch(peer.key.incarnation, now)

    def on_RoomDone(self, peer: Peer, msg: RoomDone, now: float) -> None:
        room = self.book.get(msg.room)
        if room is not None:
            self.book.apply(room, room.on_room_done(peer.key, msg.session, now))

    def on_RoomFailed(self, peer: Peer, msg: RoomFailed, now: float) -> None:
        """Also for a peer whose connection was refused: its rooms fail here too."""
        self._input(msg.room, Parked(peer.key, msg), now)

    # -- hooks: rooms, peers, time, closing -----------------------------------------------------
    def released(self, room: PrefillRoom) -> None:
        self.writes.forget_room(room.room)
        for flow in room.flows.values():   # the last room towards a peer lets its credits go
            if flow.staged:
                self.credits.settle(flow.peer)
        if room.state is KVPoll.Success:
            self.served[room.room] = frozenset((f.peer.incarnation, f.session) for f in room.flows.values())
        self.used_sessions[room.room] = room.stale.plus(room.sessions())

    def forget_finished(self, room_id: int) -> None:
        self.served.pop(room_id, None)
        self.used_sessions.pop(room_id, None)

    def settle_credits(self, a: SettleCredits) -> None:
        self.credits.settle(a.peer)

    def peer_lost(self, peer: Peer, reason: str, now: float, clean: bool) -> None:
        self.credits.peer_lost(peer)
        for room in list(self.book.rooms.values()):
            self.book.apply(room, room.on_peer_lost(peer.key, reason, now))

    def connect_failed(self, peer: Peer, now: float) -> None:
        self.peers.lost(peer, "no answer to the connection", now)  # decode ranks connect to us: not reached

    def tick_rooms(self, now: float) -> None:
        for room in list(self.book.rooms.values()):
            self.book.apply(room, room.tick(now))

    def tick(self, now: float) -> None:
        self.credits.tick(now)
        for room_id, since in list(self.pending_since.items()):
            if now - since > self.t.metadata:
                for item in self.pending.pop(room_id, []):   # their decode rooms must not wait for it
                    answer = unserved_answer(item, now - since)
                    if answer is not None:
                        self._fail_unserved(item, *answer)
                del self.pending_since[room_id]
                self.stats.count("dropped_messages", "meta_without_sender")

    def _fail_unserved(self, item: Parked, kind: str, reason: str) -> None:
        key, msg, me = item.peer, item.msg, self.me
        self.peers.send(key, RoomFailed(src=me, dst=key.incarnation, room=msg.room, session=msg.session, kind=kind,
                                        reason=reason))
        self.peers.send(key, Quiesced(src=me, dst=key.incarnation, room=msg.room, session=msg.session))

    def closing(self, room: PrefillRoom, now: float) -> list[PrefillAction]:
        return room.fail(FailureKind.CLOSED, "the kvstage manager is closing", now)

    def room_state(self) -> dict[str, int]:
        return {"parked_rooms": len(self.pending)}

    def quarantined_bytes(self) -> int:
        """Source bytes of writes given up on that the backend may still read (Mooncake cannot
        cancel a write inside its engine): their staging buffers and pages are not reused yet."""
        return self.backend.draining_bytes()

    def stuck_rooms(self) -> list[int]:
        """Rooms an internal error may leave stuck: those with writes in flight."""
        return [r for r, room in self.book.rooms.items() if room.ops]

