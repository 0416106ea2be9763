"""A reused room id on a prefill rank, the engine's prefill half driven message by message (no
sockets, no backend): the exact interleavings of issue 49 item 4.

The race: the decode side aborts a use of the id right after its metadata went out, and both
the metadata and the failure reach this rank before the caller created the sender, while the
id's previous use is remembered as finished here. The failure names a session newer than any
the finished use dealt with, so it belongs to the coming sender (like the metadata parked for
it), and the Quiesced it is answered with promises that nothing of that session will be written:
the sender must fail when it is created, before it posts a single write.
"""

from types import SimpleNamespace

import numpy as np
import torch

from kvstage.transfer.config import Timeouts
from kvstage.transfer.engine.events import NewSender, SendChunk
from kvstage.transfer.engine.handles import RoomStatus
from kvstage.transfer.engine.peers import Peer, PeerTable
from kvstage.transfer.engine.prefill_side import PrefillSide
from kvstage.transfer.engine.rooms import RoomBook
from kvstage.transfer.engine.stats import Stats
from kvstage.transfer.layout import KVLayout
from kvstage.transfer.poll import KVPoll
from kvstage.transfer.protocol.actions import PeerKey
from kvstage.transfer.protocol.leases import Lease
from kvstage.transfer.protocol.messages import Quiesced, RoomFailed, RoomMeta

LAYOUT = KVLayout(num_layers=2, total_kv_heads=2, head_dim=4, dtype=torch.uint8, page_size=2, tp_size=1, tp_rank=0,
                  mla=False)   # one prefill rank, one decode rank
ME = 1000
DEC = PeerKey("decode", 0, 2000)
ROOM, N = 42, 4


class Sock:
    def __init__(self):
        self.sent = []

    def send(self, endpoint, msg) -> bool:
        self.sent.append(msg)
        return True


class Writes:
    """The write queue: only what was posted."""

    def __init__(self):
        self.posted = []

    def post(self, op, now):
        self.posted.append(op)

    def cancel_room(self, room, now):
        pass

    def forget_room(self, room):
        pass

    def await_unit(self, a):
        pass


def prefill_rank():
    ctx = SimpleNamespace(role="prefill", stats=Stats(), me=ME, layout=LAYOUT, t=Timeouts(), sock=Sock(),
                          summary=SimpleNamespace(pools=[]), observer=None)
    writes = Writes()
    peers = PeerTable(ctx, listeners=lambda: [side])
    peers.peers[DEC.incarnation] = Peer(key=DEC, role="decode", tp_size=1, endpoint="tcp://decode:1",
                                        lease=Lease(5.0, 0.0), state="connected", backend_name="b")
    book = RoomBook(ctx, peers, side=lambda: side, writes=lambda: writes)
    side = PrefillSide(ctx, peers, book, writes=writes)
    return side, writes, ctx.sock


def meta(session):
    return RoomMeta(src=DEC.incarnation, dst=ME, room=ROOM, session=session, num_pages=N, staged=False,
                    dst_pages=np.arange(N, dtype="<i8").tobytes())


def failed(session):
    return RoomFailed(src=DEC.incarnation, dst=ME, room=ROOM, session=session, kind="aborted",
                      reason="aborted by the decode caller")


def new_sender(side, now):
    status = RoomStatus()
    side.new_sender(NewSender(room=ROOM, num_pages=N, status=status), now)
    return status


def first_use_ended(side, peer):
    """Use 0 of the id: its decode room failed before its metadata went out (session 1); the
    sender fails on that failure and is released."""
    status = new_sender(side, 0.0)
    side.on_RoomFailed(peer, failed(1), 0.5)
    assert status.state is KVPoll.Failed and status.released and ROOM in side.book.finished


def test_a_failure_racing_the_sender_of_a_reused_id_fails_it_before_any_write():
    side, writes, sock = prefill_rank()
    peer = side.peers.get(DEC.incarnation)
    first_use_ended(side, peer)
    # use 1 (session 2): its metadata and its abort both come before the caller creates the sender
    side.on_RoomMeta(peer, meta(2), 1.0)
    side.on_RoomFailed(peer, failed(2), 1.2)
    assert any(isinstance(m, Quiesced) and m.session == 2 for m in sock.sent)   # the decode side frees its pages
    status = new_sender(side, 1.5)
    side.send_chunk(SendChunk(room=ROOM, pages=np.arange(N), last=True), 1.6)
    assert writes.posted == []   # nothing may land in pages the decode side freed on that Quiesced
    assert status.state is KVPoll.Failed and status.failure_kind == "remote_aborted", status.failure
    assert status.released and side.used_sessions[ROOM].covers(DEC.incarnation, 2)   # bound to this use


def test_a_failure_racing_the_sender_before_its_metadata_still_fails_it():
    # the same, the failure first (messages of one decode rank may be reordered or held back)
    side, writes, sock = prefill_rank()
    peer = side.peers.get(DEC.incarnation)
    first_use_ended(side, peer)
    side.on_RoomFailed(peer, failed(2), 1.0)
    side.on_RoomMeta(peer, meta(2), 1.2)
    status = new_sender(side, 1.5)
    side.send_chunk(SendChunk(room=ROOM, pages=np.arange(N), last=True), 1.6)
    assert writes.posted == [] and status.state is KVPoll.Failed, status.failure


def test_the_finished_uses_own_failure_again_is_answered_and_dropped():
    side, writes, sock = prefill_rank()
    peer = side.peers.get(DEC.incarnation)
    first_use_ended(side, peer)
    side.on_RoomFailed(peer, failed(1), 1.0)   # retransmitted: that use's Quiesced was lost
    assert sock.sent[-1] == Quiesced(src=ME, dst=DEC.incarnation, room=ROOM, session=1)
    assert ROOM not in side.pending
    side.on_RoomMeta(peer, meta(2), 2.0)       # the next use is untouched by it
    status = new_sender(side, 2.5)
    side.send_chunk(SendChunk(room=ROOM, pages=np.arange(N), last=True), 2.6)
    assert status.state is KVPoll.Transferring and len(writes.posted) == 1, status.failure
