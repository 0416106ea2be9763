"""A reused room id on a prefill rank, the engine's prefill half driven message by message (no
sockets, no backend): the exact interleavings of issue 49 item 4.

The race: the decode side aborts a use of the id right after its metadata went out, and both
the metadata and the failure reach this rank before the caller created the sender, while the
id's previous use is remembered as finished here. The failure names a session newer than any
the finished use dealt with, so it belongs to the coming sender (like the metadata parked for
it), and the Quiesced it is answered with promises that nothing of that session will be written:
the sender must fail when it is created, before it posts a single write.
"""


import numpy as np
import pytest
import torch
from engine_parts import prefill_parts

from kvstage.transfer.engine.events import NewSender, SendChunk
from kvstage.transfer.engine.handles import RoomStatus
from kvstage.transfer.engine.peers import Peer
from kvstage.transfer.layout import KVLayout
from kvstage.transfer.poll import KVPoll
from kvstage.transfer.protocol.actions import PeerKey
from kvstage.transfer.protocol.leases import Lease
from kvstage.transfer.protocol.messages import Quiesced, RoomDone, RoomFailed, RoomMeta

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
    sock, writes = Sock(), Writes()
    peers, _, side = prefill_parts(me=ME, layout=LAYOUT, sock=sock, writes=writes)
    peers.peers[DEC.incarnation] = Peer(key=DEC, role="decode", tp_size=1, endpoint="tcp://decode:1",
                                        lease=Lease(5.0, 0.0), state="connected", backend_name="b")
    return side, writes, sock


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


@pytest.mark.parametrize("failure_first", [False, True], ids=["metadata-first", "failure-first"])
def test_a_failure_racing_the_sender_of_a_reused_id_fails_it_before_any_write(failure_first):
    """Use 1 (session 2): its metadata and its abort both come before the caller creates the
    sender, in either order (messages of one decode rank may be reordered or held back)."""
    side, writes, sock = prefill_rank()
    peer = side.peers.get(DEC.incarnation)
    first_use_ended(side, peer)
    arrivals = [lambda t: side.on_RoomMeta(peer, meta(2), t), lambda t: side.on_RoomFailed(peer, failed(2), t)]
    for arrive, t in zip(arrivals[::-1] if failure_first else arrivals, (1.0, 1.2)):
        arrive(t)
    assert any(isinstance(m, Quiesced) and m.session == 2 for m in sock.sent)   # the decode side frees its pages
    status = new_sender(side, 1.5)
    side.send_chunk(SendChunk(room=ROOM, pages=np.arange(N), last=True), 1.6)
    assert writes.posted == []   # nothing may land in pages the decode side freed on that Quiesced
    assert status.state is KVPoll.Failed and status.failure_kind == "remote_aborted", status.failure
    assert status.released and side.used_sessions[ROOM].covers(DEC.incarnation, 2)   # bound to this use


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


def completes(side, writes, now):
    """The backend reports every posted write landed."""
    for op in writes.posted:
        room = side.book.get(op.room)
        if room is not None:
            side.book.apply(room, room.on_write_done(op.op_id, True, None, now))
    writes.posted.clear()


def room_done(session):
    return RoomDone(src=DEC.incarnation, dst=ME, room=ROOM, session=session)


def test_four_uses_of_an_id_each_ended_on_both_sides_before_the_next():
    """The uses of test_lifecycle's reuse test, in one order its runs can take, at one prefill
    rank: use 0's decode room fails before its metadata went out and its failure comes before
    the sender (bound a lease after the sender's creation); use 1's abort races its last write;
    use 2 is prefill first; use 3 decode first; late copies of earlier uses' messages come
    between. Each use ends as its own decode room did.

    (The CI failure of issue 49 fits this order but for one thing, which only the older
    three-use test allowed: the decode side started a use before this rank's previous use
    ended. Metadata of the new session then reached the previous sender while it held a parked
    failure of the session before, and bound to it, as the reuse rules say it must when the
    previous use never had a sender here: docs/protocol.md, room-id reuse.)"""
    side, writes, sock = prefill_rank()
    peer = side.peers.get(DEC.incarnation)
    lease = side.t.lease
    ended = []

    # use 0 (session 1): failed before its metadata went out; the failure comes before the sender
    side.on_RoomFailed(peer, failed(1), 0.2)
    status = new_sender(side, 1.0)
    side.send_chunk(SendChunk(room=ROOM, pages=np.arange(N), last=True), 1.0)
    side.tick_rooms(1.0 + lease)
    assert status.state is KVPoll.Bootstrapping    # within the lease it may be an earlier use's failure
    side.tick_rooms(1.0 + lease + 0.01)
    assert status.state is KVPoll.Failed and "before its room metadata went out" in status.failure
    ended.append(status)
    t = 1.0 + lease + 1.0

    # use 1 (session 2): metadata before the sender; the decode side aborts while the last write is in flight
    side.on_RoomMeta(peer, meta(2), t)
    status = new_sender(side, t + 0.1)
    side.send_chunk(SendChunk(room=ROOM, pages=np.arange(N), last=True), t + 0.2)
    assert status.state is KVPoll.Transferring and len(writes.posted) == 1
    side.on_RoomFailed(peer, failed(2), t + 0.3)
    assert status.state is KVPoll.Failed and not status.released    # its write may still land
    completes(side, writes, t + 0.4)
    assert status.released and sock.sent[-1] == Quiesced(src=ME, dst=DEC.incarnation, room=ROOM, session=2)
    ended.append(status)
    t += 1.0

    # use 2 (session 3): prefill first; use 1's failure again (its Quiesced lost) is answered, not applied
    status = new_sender(side, t)
    side.send_chunk(SendChunk(room=ROOM, pages=np.arange(N), last=True), t)
    side.on_RoomFailed(peer, failed(2), t + 0.1)
    assert status.state is KVPoll.Bootstrapping and sock.sent[-1].session == 2
    side.on_RoomMeta(peer, meta(1), t + 0.2)   # use 0 never sent metadata; an older session is never bound
    side.on_RoomMeta(peer, meta(3), t + 0.3)
    assert status.state is KVPoll.Transferring and len(writes.posted) == 1
    completes(side, writes, t + 0.4)
    side.on_RoomDone(peer, room_done(3), t + 0.5)
    assert status.state is KVPoll.Success and status.released
    ended.append(status)
    t += 1.0

    # use 3 (session 4): decode first; use 2's metadata again (served) and its RoomDone again change nothing
    side.on_RoomMeta(peer, meta(3), t)
    side.on_RoomMeta(peer, meta(4), t + 0.1)
    status = new_sender(side, t + 1.5)
    assert status.state is KVPoll.WaitingForInput
    side.on_RoomDone(peer, room_done(3), t + 1.6)
    side.send_chunk(SendChunk(room=ROOM, pages=np.arange(N), last=True), t + 1.7)
    assert status.state is KVPoll.Transferring and len(writes.posted) == 1
    assert writes.posted[0].peer == DEC
    completes(side, writes, t + 1.8)
    side.on_RoomDone(peer, room_done(4), t + 1.9)
    assert status.state is KVPoll.Success and status.released
    ended.append(status)

    assert [s.state for s in ended] == [KVPoll.Failed, KVPoll.Failed, KVPoll.Success, KVPoll.Success]
    assert all("abort" in s.failure for s in ended[:2])
    assert not side.pending     # nothing of any use is left parked


def test_metadata_parked_for_a_sender_that_never_comes_fails_its_decode_room():
    """The finding of 2026-11-27 (docs/protocol.md, "Ring credits"), at one prefill rank: a
    failure of an earlier use, from a decode rank that use never heard from (it failed before
    its metadata went out), is held back past the creation of the next use's sender and fails
    it, as a failure before any metadata of this use must. That decode rank's metadata of the
    next use then comes: a newer session than the failure's, so it is parked for the next
    sender. None comes; at the metadata timeout the decode room is told it failed (with a
    reason, and Quiesced: nothing was written), rather than left to wait for its room deadline."""
    side, writes, sock = prefill_rank()
    peer = side.peers.get(DEC.incarnation)
    status = new_sender(side, 0.0)
    side.on_RoomFailed(peer, failed(1), 0.1)
    assert status.state is KVPoll.Failed and status.released
    side.on_RoomMeta(peer, meta(2), 0.2)
    assert side.pending[ROOM] and sock.sent[-1].session == 2   # parked for a next sender, acknowledged
    sent = len(sock.sent)
    side.tick(0.2 + side.t.metadata)   # not yet: it may still come
    assert len(sock.sent) == sent and side.pending[ROOM]
    side.tick(0.3 + side.t.metadata)
    told = [m for m in sock.sent[sent:] if m.session == 2]
    assert [type(m) for m in told] == [RoomFailed, Quiesced], told
    assert told[0].kind == "timeout" and "no prefill sender" in told[0].reason
    assert ROOM not in side.pending and writes.posted == []
