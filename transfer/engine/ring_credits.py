"""The engine shells of ring credits (transfer/protocol/credits.py): the decode rank's CreditLedger of its
ring and the prefill rank's CreditPurse per decode peer, the three credit messages, and the
hooks where rooms start and end and peers come and go. All rules are in the pure parts; these
classes only carry their answers to sockets, rooms and the ring's watermark, on the control
thread.

Decode (`DecodeCredits`): a prefill rank whose HelloAck says `credits` is connected to the
ledger. When a staged room's metadata goes to such a rank (RoomMeta), the room's bytes of that
writer are added to its demand and the credits due are sent first (CreditGrant goes out before
the RoomMeta, on the same ordered channel: the credit is there when the data is). A CREDIT tag
is claimed before its room sees it; a piece the room is done with is released. A room's end
ends its demand; a lost rank's credits close once its quarantine is over. Grants no write used
are re-sent once a heartbeat.

Prefill (`PrefillCredits`, the rooms' CreditPurses): a purse per decode peer whose Hello
advertises a staging ring, when credits are on here; grants go into it (their watermark with
them), a grant that does not fit the ring fails the rooms towards that peer. After a room took
from a purse or a write into a credit completed, every open credit is retired when no room
still has staged chunks to write to that peer, and the credits due go back (CreditReturn,
re-sent once a heartbeat until CreditAck).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import cast

from ..protocol.actions import PeerKey
from ..protocol.credits import ClaimVerdict, CreditSpan, GrantVerdict, WriteRef
from ..protocol.decode.credits import Claim, CreditLedger, Issued
from ..protocol.decode.room import DecodeRoom
from ..protocol.kinds import FailureKind
from ..protocol.messages import CreditAck, CreditGrant, CreditReturn, CreditWrite, Hello, HelloAck, RoomMeta
from ..protocol.prefill.credits import CreditPurse
from ..protocol.ring import Watermark
from ..protocol.tags import Tag
from .interfaces import Counters, Outbox, RingOwner, Watermarks
from .peers import Peer
from .rooms import DecodeBook, PrefillBook

log = logging.getLogger("kvstage")

MIB = 1 << 20


def piece_cap_bytes(piece_mb: float) -> int:
    """ResolvedConfig.staging_piece_mb in bytes (0: no cap)."""
    return int(piece_mb * MIB)


def credit_floor(ring_size: int, piece_cap: int, align: int) -> int:
    """The smallest credit: one piece (the piece cap), at most a quarter of the ring so that four
    busy prefill ranks can hold one each; a multiple of the ring's alignment."""
    n = min(piece_cap, ring_size // 4) // align * align
    return max(n, align)


class DecodeCredits:
    """The ring credits of decode rank `me` (`ledger` None: credits off here, or no ring)."""

    def __init__(self, *, me: int, peers: Outbox, book: DecodeBook, stats: Counters, ring: RingOwner,
                 credits: bool, piece_cap: int, heartbeat: float, publish: Callable[[], None]):
        """`ring`: the staging handler's ring; `credits`: EngineConfig.credits; `piece_cap`: the
        largest staged piece in bytes (0: no cap); `heartbeat`: how often grants no write used are
        sent again; `publish`: tell the writers the ring's watermark moved
        (DecodeSide.publish_watermark)."""
        self.me, self.peers, self.book, self.stats, self.ring = me, peers, book, stats, ring
        self.credits_on, self.piece_cap, self.heartbeat, self.publish = credits, piece_cap, heartbeat, publish
        self.ledger: CreditLedger | None = None   # made at the first connection (credits on, a ring here)
        self._ledger_made = False
        self.takers: dict[int, PeerKey] = {}            # incarnation -> a rank connected to the ledger
        self.demanded: set[tuple[int, int, int]] = set()   # (room, session, incarnation) whose demand is in
        self.lost_at: dict[PeerKey, float] = {}          # lost ranks: when their quarantine is over
        self.resent_at = 0.0

    def _make_ledger(self) -> None:
        self._ledger_made = True
        ring = self.ring.allocator
        if self.credits_on and ring is not None:
            cap = self.piece_cap or ring.size
            self.ledger = CreditLedger(ring, floor=credit_floor(ring.size, cap, ring.align))

    def connected(self, peer: Peer, msg: HelloAck) -> None:
        if not (msg.credits and msg.staging):
            return
        if not self._ledger_made:
            self._make_ledger()
        if self.ledger is None:
            return
        try:
            self.ledger.connect(peer.key)
        except ValueError as exc:   # the ring cannot hold one more piece: this rank goes the grant path
            log.warning("no ring credits for prefill rank %s: %s", peer.key, exc)
            self.stats.count("credits", "refused_connection")
            return
        self.takers[peer.key.incarnation] = peer.key

    def meta_out(self, room: DecodeRoom, meta: RoomMeta, to: PeerKey) -> None:
        """Before `meta` goes to `to`: the room's bytes of that writer join its demand, and the
        credits due go out first."""
        if self.ledger is None or not meta.staged or self.takers.get(to.incarnation) != to:
            return
        key = (room.room, room.session, to.incarnation)
        t = room.tracker
        if key in self.demanded or t is None or to.tp_rank not in t.writer_page_bytes:
            return
        stage = t.writer_layers[to.tp_rank]
        if [r for r, held in t.writer_layers.items() if held == stage] != [to.tp_rank]:
            return   # its pieces have several writers: they keep the grant path (credits.py)
        self.demanded.add(key)
        self.ledger.add_demand(to, room.room, room.session,
                               t.bytes_of(to.tp_rank, t.num_pages) + t.final_extra.get(to.tp_rank, 0))
        self.issue()

    def issue(self) -> None:
        if self.ledger is None:
            return
        self._send_grants(self.ledger.issue())

    def _send_grants(self, issued: Iterable[Issued]) -> None:
        a = self.ring.allocator
        assert a is not None, "credits are given only from a ring"
        wm = a.watermark
        for c in issued:
            key = cast(PeerKey, c.peer)   # the ledger is given PeerKeys (claim(), below)
            self.stats.count("credits", "granted")
            self.peers.send(key, CreditGrant(src=self.me, dst=key.incarnation, epoch=self.me,
                                                credit=c.credit, start=c.start, nbytes=c.nbytes, wm_round=wm.round,
                                                wm_tail=wm.tail))

    def claim(self, peer: Peer, tag: Tag) -> Claim:
        """The ledger's verdict on a CREDIT tag of `peer`."""
        if self.ledger is None or self.takers.get(peer.key.incarnation) != peer.key:
            return Claim(verdict=ClaimVerdict.OUTSIDE, reason=f"{peer.key} holds no ring credits of this rank")
        return self.ledger.claim(peer.key, tag.ring_start, tag.nbytes, tag.room, tag.session)

    def wrote(self, peer: Peer, tag: Tag) -> None:
        """A granted staged write of `peer` landed: its room's demand shrinks."""
        if self.ledger is not None and peer.key.incarnation in self.takers:
            self.ledger.wrote(peer.key, tag.room, tag.session, tag.nbytes)

    def release(self, peer: PeerKey, span: CreditSpan) -> None:
        assert self.ledger is not None, "a credit piece without a ledger"
        if self.ledger.release(peer, span):
            self.publish()
        self.issue()

    def on_return(self, peer: Peer, msg: CreditReturn, now: float) -> None:
        if self.ledger is None or msg.epoch != self.me:
            self.stats.count("dropped_messages", "stale_credit_return")
            return
        res = self.ledger.on_return(peer.key, msg.credit, [WriteRef(room=w.room, session=w.session, start=w.start,
                                                                    nbytes=w.nbytes) for w in msg.writes])
        self.peers.send(peer.key, CreditAck(src=self.me, dst=peer.key.incarnation, epoch=msg.epoch,
                                            credit=msg.credit))
        if not res.ok:   # the rooms that wrote into it fail; the region stays out of use until it is lost
            log.error("bad credit return from %s: %s", peer.key, res.reason)
            self.stats.count("credits", "bad_return")
            for room_id, session in res.rooms:
                room = self.book.get(room_id)
                if room is not None and room.session == session:
                    self.book.apply(room, room.fail(FailureKind.PROTOCOL, f"ring credit: {res.reason}", now))
            return
        self.stats.count("credits", "returned")
        if res.freed:
            self.publish()
        self.issue()

    def room_ended(self, room: DecodeRoom) -> None:
        if self.ledger is None:
            return
        self.demanded = {k for k in self.demanded if k[:2] != (room.room, room.session)}
        if self.ledger.end_room(room.room, room.session):
            self.publish()
        self.issue()

    def held_bytes(self) -> int:
        """Ring bytes the connected ranks hold as credits (given, not closed yet)."""
        return 0 if self.ledger is None else sum(self.ledger.held_bytes(k) for k in self.takers.values())

    def peer_lost(self, peer: Peer, quarantine: float, now: float) -> None:
        """`peer` is lost; its credits close when none of its posted writes can land any more."""
        if self.ledger is None or self.takers.pop(peer.key.incarnation, None) is None:
            return
        self.lost_at[peer.key] = now + quarantine
        self._close_lost(now)

    def _close_lost(self, now: float) -> None:
        assert self.ledger is not None
        moved = False
        for key, at in list(self.lost_at.items()):
            if now >= at:
                del self.lost_at[key]
                moved |= self.ledger.peer_lost(key)
        if moved:
            self.publish()
            self.issue()

    def tick(self, now: float) -> None:
        if self.ledger is None:
            return
        if self.lost_at:
            self._close_lost(now)
        if now - self.resent_at >= self.heartbeat:   # a grant may have been lost
            self.resent_at = now
            for key in self.takers.values():
                self._send_grants(self.ledger.unacknowledged(key))


class PrefillCredits:
    """The ring credits decode peers gave prefill rank `me`: the rooms' CreditPurses."""

    def __init__(self, *, me: int, peers: Outbox, book: PrefillBook, stats: Counters, staging: Watermarks,
                 credits: bool, piece_cap: int, heartbeat: float, dispatch: Callable[[int, float], None]):
        """`staging`: the staging handler (a decode peer's watermark, a staging buffer's size);
        `credits`: EngineConfig.credits; `piece_cap`: the largest staged piece in bytes (0: no
        cap); `heartbeat`: how often returns not acknowledged are sent again; `dispatch(peer
        incarnation, now)`: staged writes towards that peer may go (its watermark moved)."""
        self.me, self.peers, self.book, self.stats, self.staging = me, peers, book, stats, staging
        self.credits_on, self.piece_cap, self.heartbeat, self.dispatch = credits, piece_cap, heartbeat, dispatch
        self._piece_bytes = 0   # set at the first connection: a worker's buffer, and the piece cap
        self.purses: dict[int, tuple[PeerKey, CreditPurse]] = {}
        # per decode peer (incarnation): the rooms that took its metadata and may still write
        # staged chunks there, the only ones `settle` asks (not every room; `_wanted` drops the rest)
        self.takers: dict[int, set[int]] = {}
        self.resent_at = 0.0

    @property
    def piece_bytes(self) -> int:
        return self._piece_bytes

    def purse(self, peer: PeerKey) -> CreditPurse | None:
        held = self.purses.get(peer.incarnation)
        return held[1] if held is not None and held[0] == peer else None

    def connected(self, peer: Peer, msg: Hello) -> bool:
        """Whether this rank takes credits from the decode rank that sent `msg` (its HelloAck says so)."""
        if not (self.credits_on and peer.staging and msg.ring is not None):
            return False
        cap = self.piece_cap
        buffers = self.staging.buffer_bytes
        self._piece_bytes = min(buffers, cap) if cap else buffers
        if self._piece_bytes <= 0:
            return False
        self.purses[peer.key.incarnation] = (peer.key, CreditPurse(epoch=msg.ring.epoch, ring_size=msg.ring.size))
        return True

    def on_grant(self, peer: Peer, msg: CreditGrant, now: float) -> None:
        purse = self.purse(peer.key)
        if purse is None:
            self.stats.count("dropped_messages", "credit_without_purse")
            return
        verdict = purse.on_grant(credit=msg.credit, epoch=msg.epoch, start=msg.start, nbytes=msg.nbytes)
        self.stats.count("credits", f"grant_{verdict}")
        if verdict is GrantVerdict.MISMATCH:
            reason = (f"ring credit {msg.credit} [{msg.start}, +{msg.nbytes}) from decode rank {peer.key} does not fit "
                      "its ring or overlaps a credit held")
            log.error("%s", reason)
            for room in list(self.book.rooms.values()):
                flow = room.flows.get(peer.key.tp_rank)
                if flow is not None and flow.peer == peer.key:
                    self.book.apply(room, room.fail(FailureKind.PROTOCOL, reason, now))
            return
        if verdict is GrantVerdict.OK and self.staging.on_watermark(peer.key.incarnation, msg.epoch,
                                                                        Watermark(msg.wm_round, msg.wm_tail)):
            self.dispatch(peer.key.incarnation, now)

    def on_ack(self, peer: Peer, msg: CreditAck) -> None:
        purse = self.purse(peer.key)
        if purse is not None and msg.epoch == purse.epoch:
            purse.on_ack(msg.credit)

    def settle(self, peer: PeerKey) -> None:
        """Retire every open credit of `peer` when no room still writes staged chunks to it, and
        give back those due."""
        purse = self.purse(peer)
        if purse is None:
            return
        if not self._wanted(peer):
            purse.idle()
        self._send_returns(peer, purse)

    def took_meta(self, room_id: int, peer: PeerKey) -> None:
        """`room_id` took the metadata of decode rank `peer`: it may write staged chunks there."""
        if peer.incarnation in self.purses:
            self.takers.setdefault(peer.incarnation, set()).add(room_id)

    def _wanted(self, peer: PeerKey) -> bool:
        """Whether a room still writes staged chunks to `peer`; forgets the rooms that never will
        again (`PrefillRoom.credits_done`: ended, or every chunk issued there). Only rooms that
        took `peer`'s metadata can (`PrefillRoom.wants_credits` needs its flow), and only those
        still sending are kept, so this costs the rooms still sending towards `peer`: not every
        room of the rank, nor the rooms in flight that wait for their writes to land (it was
        called for each write, so scanning those made it quadratic in the rooms in flight)."""
        rooms = self.takers.get(peer.incarnation)
        if not rooms:
            return False
        for room_id in list(rooms):
            room = self.book.get(room_id)
            if room is None or room.credits_done(peer):
                rooms.discard(room_id)
            elif room.wants_credits(peer):
                return True
        return False

    def _send_returns(self, peer: PeerKey, purse: CreditPurse) -> None:
        for back in purse.returns():
            self.stats.count("credits", "returned")
            self.peers.send(peer, CreditReturn(src=self.me, dst=peer.incarnation, epoch=purse.epoch,
                                               credit=back.credit,
                                               writes=[CreditWrite(w.room, w.session, w.start, w.nbytes)
                                                       for w in back.writes]))

    def peer_lost(self, peer: Peer) -> None:
        held = self.purses.pop(peer.key.incarnation, None)
        self.takers.pop(peer.key.incarnation, None)
        if held is not None:
            held[1].lost()

    def tick(self, now: float) -> None:
        if self.purses and now - self.resent_at >= self.heartbeat:   # a return may have been lost
            self.resent_at = now
            for key, _ in list(self.purses.values()):
                self.settle(key)
