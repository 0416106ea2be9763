"""The decode half of a rank: receivers, what prefill ranks say about rooms, the tagged
notifications of landed writes, scatters from the staging ring, and the ring's watermark.

The backend is polled only while writes were announced to this rank (`WritePosted`) and their
tags are not in (`backend.expecting`, see protocol/quiet.py): a room waiting for its prefill to
compute costs no wake-ups. Planning (which prefill ranks, which path) lives in
decode_planning.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ...bootstrap.rendezvous import RankGone
from ...staging.pool_copies import LandedBlock
from ...staging.workers import LandedPart, ScatterJob, ScatterWorker
from ...wire import WireError
from ..config import Timeouts
from ..layout import KVLayout, LayoutSummary
from ..poll import KVPoll
from ..protocol.actions import DecodeAction, PrepareScatter, ReleaseCredit, Scatter, Send, StatusChanged
from ..protocol.decode.room import DecodeRoom, TagVerdict
from ..protocol.decode.watermark_fanout import WatermarkFanout, pending_parts
from ..protocol.kinds import FailureKind
from ..protocol.messages import (
    AllocRequest,
    CreditReturn,
    HelloAck,
    MetaAck,
    Quiesced,
    RoomDone,
    RoomFailed,
    RoomMeta,
    TagsAgain,
    WatermarkUpdate,
    WritePosted,
    WriterDone,
)
from ..protocol.quiet import Arrival, ExpectedWrites
from ..protocol.ring import RingAllocator
from ..protocol.room_uses import EndedAnswer, RoomUse, ended_answer, writer_done_answer
from ..protocol.routing import PeerState
from ..protocol.tags import Tag, TagCodec, TagKind
from .decode_planning import EnginePlanner
from .events import Abort, InitReceiver, LookupDone, NewReceiver, ScatterDone
from .interfaces import (
    Counters,
    DecodeStaging,
    EventHandler,
    ExpectedTags,
    LandedChecks,
    MessageHandler,
    Post,
)
from .peers import Peer, PeerTable
from .ring_credits import DecodeCredits
from .rooms import DecodeBook


def scatter_report(stats: Counters, post: Post) -> Callable[..., None]:
    """How the scatter thread reports a piece, from its thread: its time counted, then a
    ScatterDone event to the control thread."""
    def report(room: int, key: tuple[int, int], ok: bool, reason: str | None, seconds: float,
               kind: str = FailureKind.SCATTER) -> None:
        stats.add("scatter_s", seconds)
        post(ScatterDone(room=room, key=key, ok=ok, reason=reason, kind=kind))
    return report


class DecodeSide:
    writes_to_peers = False   # only prefill ranks write; a decode rank's leases are liveness only

    def __init__(self, *, me: int, layout: KVLayout, summary: LayoutSummary, timeouts: Timeouts, quarantine: float,
                 stats: Counters, tags: TagCodec, staging: DecodeStaging, integrity: LandedChecks,
                 expected_tags: ExpectedTags, credits: bool, piece_cap: int, peers: PeerTable, book: DecodeBook,
                 planner: EnginePlanner, scatterer: ScatterWorker | None):
        """Rank `me` with `layout` (its `summary`: the pools), by `timeouts`; `quarantine`: how
        long a lost writer's memory stays out of use (Timeouts.quarantine_for the backend);
        `tags` decodes a repeated tag, `staging` is the ring, `integrity` checks landed writes,
        `expected_tags` is where the backend learns how many announced writes it polls for;
        `credits`, `piece_cap`: the ring credits' EngineConfig.credits and piece cap in bytes;
        `planner` plans the rooms. `scatterer`: the scatter thread of a rank with a staging
        ring, else None."""
        self.me, self.layout, self.summary, self.t, self.quarantine = me, layout, summary, timeouts, quarantine
        self.stats, self.tags, self.staging, self.integrity = stats, tags, staging, integrity
        self.expected_tags = expected_tags
        self.peers, self.book, self.scatterer = peers, book, scatterer
        self.planner = planner
        self.eager_rooms: set[int] = set()       # Transferring: writes towards them may come
        self.expected = ExpectedWrites()         # writes announced towards this rank, tags not in
        self.fanout = WatermarkFanout()          # who was told the ring's watermark (protocol/decode/watermark_fanout.py)
        self.credits = DecodeCredits(   # ring credits (ring_credits.py)
            me=me, peers=peers, book=book, stats=stats, ring=staging, credits=credits, piece_cap=piece_cap,
            heartbeat=timeouts.heartbeat, publish=self.publish_watermark)
        self.handlers: dict[type, MessageHandler] = {
            HelloAck: self.on_HelloAck, MetaAck: self.on_MetaAck, AllocRequest: self.on_AllocRequest,
            WriterDone: self.on_WriterDone, Quiesced: self.on_Quiesced, RoomFailed: self.on_RoomFailed,
            WritePosted: self.on_WritePosted, TagsAgain: self.on_TagsAgain,
            CreditReturn: self.credits.on_return}
        self.events: dict[type, EventHandler] = {
            NewReceiver: self.new_receiver, InitReceiver: self.init_receiver, Abort: self.abort,
            ScatterDone: self.on_scattered, LookupDone: self.planner.on_lookup, RankGone: self.planner.rank_gone}

    def on_HelloAck(self, peer: Peer, msg: HelloAck, now: float) -> None:
        if msg.ok and peer.state == PeerState.CONNECTING and (not msg.conn or msg.conn == peer.conn):
            self.credits.connected(peer, msg)   # before the planner sends the waiting rooms' metadata
        self.planner.on_HelloAck(peer, msg, now)

    # -- the caller's events --------------------------------------------------------------------
    def new_receiver(self, ev: NewReceiver, now: float) -> None:
        room = DecodeRoom(room=ev.room, session=ev.session, me=self.me, layout=self.layout, now=now,
                          timeouts=self.t, pools=tuple(self.summary.pools))
        self.book.add(room, ev.status)
        self.planner.add_room(room, ev.source, now)

    def init_receiver(self, ev: InitReceiver, now: float) -> None:
        room = self.book.get(ev.room)
        if room is not None:
            self.book.apply(room, room.init(ev.pages, now, ev.prefix_pages, ev.pool_items, ev.num_tokens))

    def abort(self, ev: Abort, now: float) -> None:
        room = self.book.get(ev.room)
        if room is not None:
            self.book.apply(room, room.abort(self.staging.allocator, now))

    def on_scattered(self, ev: ScatterDone, now: float) -> None:
        room = self.book.get(ev.room)
        if room is not None:
            if ev.ok:
                self._stamp(ev.room, "scattered", now)
            self.book.apply(room, room.on_scattered(ev.key, ev.ok, ev.reason, self._ring(), now, ev.kind))

    def _stamp(self, room_id: int, phase: str, now: float) -> None:
        status = self.book.status.get(room_id)
        if status is not None:
            status.timeline.stamp(phase, now)

    # -- messages about rooms -------------------------------------------------------------------
    def on_MetaAck(self, peer: Peer, msg: MetaAck, now: float) -> None:
        room = self.book.get(msg.room)
        if room is not None:
            room.on_meta_ack(peer.key, msg.session)

    def on_AllocRequest(self, peer: Peer, msg: AllocRequest, now: float) -> None:
        room = self.book.get(msg.room)
        a = self.staging.allocator
        if room is not None and a is not None:
            wm = a.watermark
            if self.fanout.before_grant(peer.key.incarnation, wm.linear(a.size)):   # its view may be old
                self.peers.send(peer.key, WatermarkUpdate(src=self.me, dst=peer.key.incarnation, epoch=self.me,
                                                          round=wm.round, tail=wm.tail))
            self.book.apply(room, room.on_alloc_request(peer.key, msg, a, now))
            self.stats.maximum("ring_high_water_bytes", min(a.high_water, a.size))
            self.stats.maximum("ring_backlog_high_water_bytes", a.high_water)
        elif room is None:
            self._answer_finished(peer, msg.room, msg.session, now)

    def on_WriterDone(self, peer: Peer, msg: WriterDone, now: float) -> None:
        room = self.book.get(msg.room)
        if room is not None:
            self.book.apply(room, room.on_writer_done(peer.key, msg, now))
        else:
            self._answer_finished(peer, msg.room, msg.session, now, writer_done=True)

    def on_TagsAgain(self, peer: Peer, msg: TagsAgain, now: float) -> None:
        """A writer repeats the tags of its completed writes (messages.TagsAgain)."""
        if self.book.get(msg.room) is None:
            return self._answer_finished(peer, msg.room, msg.session, now)
        for raw in msg.tags:
            self._tag_again(peer, msg, raw, now)

    def _tag_again(self, peer: Peer, msg: TagsAgain, raw: bytes, now: float) -> None:
        """One repeated tag: its write completed, so its bytes are in place. Applied as if its
        notification arrived, unless that notification already did (each tag counts once,
        whichever path brought it: `stats()["tags_again"]`)."""
        try:
            tag = self.tags.decode(raw)
        except WireError as exc:
            self.stats.count("dropped_tags", exc.kind)
            return
        room = self.book.get(msg.room)
        if room is None or tag.room != msg.room or tag.session != msg.session:
            self.stats.count("tags_again", "other_room")
            return
        if room.holds_tag(peer.key, tag):
            self.stats.count("tags_again", "already_in")
            return
        self.stats.count("tags_again", "recovered")
        self.on_tag(peer, tag, now)

    def on_WritePosted(self, peer: Peer, msg: WritePosted, now: float) -> None:
        """A writer's backend took a write towards this rank: poll until its tag is in. It also
        says the writer has this room's metadata (a writer that wrote sends no MetaAck)."""
        room = self.book.get(msg.room)
        if room is not None:
            room.on_meta_ack(peer.key, msg.session)
        if room is None or room.session != msg.session or msg.room not in self.eager_rooms:
            self.stats.count("write_announcements", "not_waiting")  # say, its tag ended the room
            return
        verdict = self.expected.announce(msg.room, (peer.key.incarnation, msg.chunk, msg.piece, msg.group))
        self.stats.count("write_announcements", verdict.value)
        self._expecting()

    def _expecting(self) -> None:
        self.expected_tags.expecting = self.expected.outstanding

    def on_Quiesced(self, peer: Peer, msg: Quiesced, now: float) -> None:
        room = self.book.get(msg.room)
        if room is not None:
            self.book.apply(room, room.on_quiesced(peer.key, msg.session, self.staging.allocator, now))

    def on_RoomFailed(self, peer: Peer, msg: RoomFailed, now: float) -> None:
        room = self.book.get(msg.room)
        if room is not None:
            self.book.apply(room, room.on_room_failed(peer.key, msg.session, msg.kind, msg.reason, now))

    def _answer_finished(self, peer: Peer, room_id: int, session: int, now: float, writer_done: bool = False) -> None:
        """A writer still asks about a room that is over here: repeat the outcome (to a
        WriterDone only when it is the writer asking again: room_uses.repeats_outcome)."""
        done = self.book.finished.get(room_id)
        if done is None:
            self.stats.count("dropped_messages", "unknown_room")
            return
        succeeded = done.state is KVPoll.Success
        answer: EndedAnswer | None
        if writer_done:
            answer = writer_done_answer(succeeded=succeeded, kind=done.kind, reason=done.reason,
                                        last_session=done.session, session=session, room=room_id,
                                        ended_at=done.ended_at, now=now, retry=self.t.heartbeat)
        else:
            answer = ended_answer(succeeded=succeeded, kind=done.kind, reason=done.reason, last_session=done.session,
                                  session=session, room=room_id)
        if writer_done:   # not a dropped message: the protocol's normal crossing (room_uses.repeats_outcome)
            self.stats.count("writer_done_answers", "repeated" if answer is not None else "crossed_the_outcome")
        if answer is None:
            return
        me, dst = self.me, peer.key.incarnation
        if answer.kind is None:
            self.peers.send(peer.key, RoomDone(src=me, dst=dst, room=room_id, session=session))
        else:
            if answer.use is RoomUse.OTHER:
                self.stats.count("dropped_messages", "other_use")
            self.peers.send(peer.key, RoomFailed(src=me, dst=dst, room=room_id, session=session, kind=answer.kind,
                                                 reason=answer.reason))

    # -- landed writes, scatters, the watermark ---------------------------------------------------
    def on_tag(self, peer: Peer, tag: Tag, now: float) -> None:
        room = self.book.get(tag.room)
        if room is None:
            self.stats.count("dropped_tags", "finished_room")
            return
        # a direct write split by memory kind is checked once, with its last group
        corrupt = self.integrity.on_landed(room, tag) if room.completes_write(tag) else None
        if corrupt is not None:  # never counted as landed: the room fails before it could succeed
            self.book.apply(room, room.fail(FailureKind.CORRUPT, corrupt, now))
            return
        arrival = self.expected.landed(tag.room, (peer.key.incarnation, tag.chunk, tag.piece, tag.group))
        if arrival is not Arrival.REPEATED:
            self.stats.count("tags_by_arrival", arrival.value)
        self._expecting()
        if tag.kind is TagKind.CREDIT:   # a piece its writer placed in one of its ring credits
            result = room.on_credit_tag(peer.key, tag, self.credits.claim(peer, tag), self._ring().size, now)
            self.stats.count("credit_tags", str(result.verdict))
        else:
            result = room.on_tag(peer.key, tag, now)
        verdict, actions = result.verdict, result.actions
        if verdict == TagVerdict.OK and tag.kind is TagKind.STAGED:
            self.credits.wrote(peer, tag)
        if verdict == TagVerdict.OK:
            self.stats.add("bytes_received", tag.nbytes)
            self.stats.count("bytes_received_by_path", "direct" if tag.kind is TagKind.DIRECT else "staged",
                                 tag.nbytes)
            self.stats.add("tags_received")
            self._stamp(tag.room, "first_write", now)
            self._stamp(tag.room, "last_write", now)
        elif verdict == TagVerdict.PARTIAL:
            self.stats.add("tags_received")
            self._stamp(tag.room, "first_write", now)
        else:
            self.stats.count("dropped_tags", verdict)
        self.book.apply(room, actions)

    def prepare_scatter(self, a: PrepareScatter) -> None:
        assert self.scatterer is not None, "a staged room on a rank without a staging ring"
        self.scatterer.prepare(a.room, a.dst_pages)

    def scatter(self, s: Scatter) -> None:
        view = self.staging.ring_view
        parts = tuple(LandedPart(view(p.region_offset, p.nbytes), p.dst_heads) for p in s.parts)
        pools = tuple(LandedBlock(view(p.ring_offset, p.copy.nbytes), p.copy) for p in s.pools)
        checks = self.integrity.scatter_checks(s)
        assert self.scatterer is not None, "a scatter on a rank without a staging ring"
        # the piece's model layers as indices into this rank's tensors (a decode PP stage's own)
        job = ScatterJob(room=s.room, key=s.key, pages=s.dst_pages, layers=self.layout.local(s.layers),
                         parts=parts, pools=pools,
                         checks=checks)
        del parts, pools, checks   # the job holds the ring views, and nothing else once it is done
        if self.scatterer.takes_here(job):   # a small piece: no hand-off to the scatter thread and back
            self.stats.count("scatters", "inline")
            self.scatterer.run_here(job)     # its ScatterDone comes back through the event queue
        else:
            self.stats.count("scatters", "thread")
            self.scatterer.submit(job)

    def release_credit(self, a: ReleaseCredit) -> None:
        self.credits.release(a.peer, a.span)

    def meta_out(self, room: DecodeRoom, a: Send) -> None:
        assert isinstance(a.msg, RoomMeta)
        self.credits.meta_out(room, a.msg, a.peer)

    def _ring(self) -> RingAllocator:
        """The staging ring's allocator: there is one wherever a piece was staged."""
        a = self.staging.allocator
        assert a is not None, "a staged piece on a rank without a staging ring"
        return a

    def publish_watermark(self) -> None:
        """The ring's watermark moved: tell the writers it may unblock (those with a granted region
        here their view does not allow yet; protocol/decode/watermark_fanout.py)."""
        a = self._ring()
        wm = a.watermark
        self.stats.set("ring_live_bytes", a.live_bytes)
        self.credits.issue()   # the space freed may hold a credit a rank waits for
        for inc in self.fanout.publish(pending_parts(self.book.rooms.values()), wm.linear(a.size), a.size):
            peer = self.peers.get(inc)
            if peer is not None and peer.state == PeerState.CONNECTED and peer.staging:
                self.peers.send(peer.key, WatermarkUpdate(src=self.me, dst=inc, epoch=self.me,
                                                          round=wm.round, tail=wm.tail))

    # -- hooks: rooms, peers, time, closing -----------------------------------------------------
    def status_changed(self, room: DecodeRoom, a: StatusChanged) -> None:
        eager = a.state is KVPoll.Transferring
        if eager and room.room not in self.eager_rooms:
            self.eager_rooms.add(room.room)
        elif not eager and room.room in self.eager_rooms:
            self._not_eager(room.room)
        if a.state is KVPoll.Failed and not room.meta_sent and a.failure_kind != FailureKind.LAYOUT:
            self.planner.tombstone(room, a.failure_kind or "failed", a.failure or "", time.monotonic())

    def released(self, room: DecodeRoom) -> None:
        self.credits.room_ended(room)
        self.planner.engine_of.pop(room.room, None)
        self._not_eager(room.room)
        if self.scatterer is not None:   # the page lists its scatters validated and indexed once
            self.scatterer.forget_room(room.room)

    def _not_eager(self, room_id: int) -> None:
        self.eager_rooms.discard(room_id)
        self.expected.forget(room_id)
        self._expecting()

    def peer_lost(self, peer: Peer, reason: str, now: float, clean: bool) -> None:
        self.fanout.forget(peer.key.incarnation)
        quarantine = 0.0 if clean else self.quarantine
        for room in list(self.book.rooms.values()):
            self.book.apply(room, room.on_peer_lost(peer.key, reason, self.staging.allocator, now, quarantine))
        self.credits.peer_lost(peer, quarantine, now)
        self.planner.peer_lost(peer, now)

    def connect_failed(self, peer: Peer, now: float) -> None:
        self.planner.connect_failed(peer, now)

    def tick_rooms(self, now: float) -> None:
        for room in list(self.book.rooms.values()):
            self.book.apply(room, room.tick(self.staging.allocator, now))

    def tick(self, now: float) -> None:
        self.planner.plan_deadlines(now)
        self.credits.tick(now)

    def closing(self, room: DecodeRoom, now: float) -> list[DecodeAction]:
        return (room.fail(FailureKind.CLOSED, "the kvstage manager is closing", now)
                + room.abort(self.staging.allocator, now))

    def room_state(self) -> dict[str, int]:
        views = self.planner.engines.values()
        return {"eager_rooms": len(self.eager_rooms), "expected_rooms": self.expected.rooms(),
                "room_engines": len(self.planner.engine_of),
                "rooms_awaiting_plan": sum(len(v.rooms) for v in views),
                "tombstones": sum(len(v.tombstones) for v in views)}

    def credit_bytes(self) -> int:
        """Ring bytes the connected prefill ranks hold as credits (ring_credits.py)."""
        return self.credits.held_bytes()

    def quarantined_bytes(self) -> int:
        """Memory that failed rooms keep until no write can land in it any more (their writers
        quiesced, or a lost writer's quarantine passed): ring regions, and on the direct path the
        destination cache pages."""
        layout = self.layout
        page = layout.page_bytes * layout.num_kv * layout.num_entries
        held = 0
        for room in self.book.rooms.values():
            if room.state is not KVPoll.Failed or room.released or not room.meta_sent:
                continue
            held += sum(r.nbytes for a in room.allocs.values() for r in a.regions.values())
            if room.plan is not None and not room.plan.staged and room.dst_pages is not None:  # both, once meta_sent
                held += int(room.dst_pages.size) * page
        return held

    def stuck_rooms(self) -> list[int]:
        """Rooms an internal error may leave stuck: those waiting for the backend's notifications."""
        return [r for r in self.book.rooms if r in self.eager_rooms]
