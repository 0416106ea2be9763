"""Control-thread parts alone (no sockets): how unusable notifications are counted, and what an
exception inside the loop does to the rooms."""

from types import SimpleNamespace

from engine_parts import peer_table, prefill_parts

from kvstage.transfer.backends.base import ArrivedTag
from kvstage.transfer.engine.liveness import Liveness
from kvstage.transfer.engine.loop import EngineLoop
from kvstage.transfer.engine.peers import Peer
from kvstage.transfer.engine.routing import FrameRouter
from kvstage.transfer.engine.stats import Stats
from kvstage.transfer.protocol.actions import PeerKey
from kvstage.transfer.protocol.leases import Lease
from kvstage.transfer.protocol.messages import Goodbye, Hello, KVMemory
from kvstage.transfer.protocol.tags import TagCodec, TagKind, make_tag


class SettlingWrites:
    """The write queue as the loop's internal-error path uses it: the rooms it was told to settle."""

    def __init__(self):
        self.settled = []

    def settle_lost(self, room_id, reason, now):
        self.settled.append(room_id)


def prefill_rank_parts(rooms: dict, backend=None):
    """A prefill rank's parts, and the bits of its context the tests read (stats, tags, backend)."""
    ctx = SimpleNamespace(role="prefill", stats=Stats(), tags=TagCodec(None), backend=backend)
    peers, book, side = prefill_parts(stats=ctx.stats, backend=backend)
    key = PeerKey("other", 0, 77)
    peers.peers[77] = Peer(key=key, role="decode", tp_size=1, endpoint="tcp://x:1", lease=Lease(5.0, 0.0),
                           state="connected", backend_name="b")
    peers.by_backend["b"] = 77
    book.rooms.update(rooms)
    return ctx, peers, book, side


def router_of(ctx, peers, handlers, *, failures=None, hello=None, landed=None):
    return FrameRouter(me=getattr(ctx, "me", 1), role=ctx.role, peers=peers, tags=getattr(ctx, "tags", None),
                       stats=ctx.stats, handlers=handlers, failures=failures, hello=hello, landed=landed)


def test_tag_at_a_prefill_rank_for_an_active_room_has_its_own_drop_reason():
    ctx, peers, book, side = prefill_rank_parts({5: object()})  # room 5 is active here
    router = router_of(ctx, peers, {}, failures=side, hello=side)   # a prefill rank: no TagSink
    tag = make_tag(TagKind.DIRECT, room=5, session=1, epoch=1, src=77, writer=0, chunk=0, piece=0,
                   page_start=0, num_pages=1, nbytes=8, layers=range(1))
    router.on_tags([ArrivedTag("b", ctx.tags.encode(tag))])
    assert ctx.stats.snapshot()["dropped_tags"] == {"tag_at_prefill_rank": 1}


class FakeRoom:
    def __init__(self, room, ops):
        self.room, self.ops, self.failed = room, ops, []

    def fail(self, kind, reason, now):
        self.failed.append((kind, reason))
        return []


class Raising:
    def step(self):
        raise KeyError("returned")


def bare_loop(rooms: dict, backend=None) -> EngineLoop:
    loop = EngineLoop.__new__(EngineLoop)
    loop.ctx, loop.peers, loop.book, loop.side = prefill_rank_parts(rooms, backend)
    loop.writes = SettlingWrites()
    return loop


def test_backend_step_raising_fails_rooms_with_writes_in_flight_and_the_loop_goes_on():
    busy, idle = FakeRoom(1, {9: object()}), FakeRoom(2, {})
    loop = bare_loop({1: busy, 2: idle}, backend=Raising())
    tags, progressed = loop._step()  # before: step() was called bare and its KeyError ended the thread
    assert tags == []
    assert loop.ctx.stats.snapshot()["internal_errors"] == {"backend_step": 1}
    assert [k for k, _ in busy.failed] == ["internal"] and "KeyError" in busy.failed[0][1]
    assert idle.failed == [] and loop.writes.settled == [1]   # its writes the error lost end too


def test_a_raising_handler_fails_the_room_it_names():
    named, other = FakeRoom(1, {}), FakeRoom(2, {9: object()})
    loop = bare_loop({1: named, 2: other})

    def handler(ev):
        raise RuntimeError("bug")
    loop._safely(handler, SimpleNamespace(room=1))
    assert loop.ctx.stats.snapshot()["internal_errors"] == {"SimpleNamespace": 1}
    assert [k for k, _ in named.failed] == ["internal"]
    assert other.failed == [] and loop.writes.settled == [1]


# -- a late Goodbye of an earlier connection (seen under load in test_peer_frozen_past_its_lease) -------
class RecordingSocket:
    def __init__(self):
        self.sent, self.forgotten = [], []

    def send(self, endpoint, msg):
        self.sent.append((endpoint, msg))
        return True

    def forget(self, endpoint):
        self.forgotten.append(endpoint)


def decode_router(peer_conn: int):
    ctx = SimpleNamespace(role="decode", me=5, stats=Stats(), sock=RecordingSocket())
    peers = peer_table(me=5, sock=ctx.sock, stats=ctx.stats)
    peer = Peer(key=PeerKey("pf", 0, 77), role="prefill", tp_size=1, endpoint="tcp://p:1", lease=Lease(5.0, 0.0),
                state="connected", backend_name="b", conn=peer_conn)
    peers.add(peer, 0.0)
    liveness = Liveness(me=5, peers=peers, timeouts=None, stats=ctx.stats, ring=None, side=None, heartbeats=None)
    return ctx, peers, peer, router_of(ctx, peers, liveness.handlers)


def test_a_late_goodbye_of_an_earlier_connection_leaves_the_new_one_alone():
    ctx, peers, peer, router = decode_router(peer_conn=2)
    router.on_frame(Goodbye(src=77, dst=5, conn=1, reason="you were declared lost: silent"), 1.0)
    assert peers.get(77) is peer and peer.state == "connected"
    assert ctx.stats.snapshot()["dropped_messages"] == {"stale_connection": 1}


def test_a_goodbye_of_the_current_connection_ends_it():
    ctx, peers, peer, router = decode_router(peer_conn=2)
    router.on_frame(Goodbye(src=77, dst=5, conn=2, reason="closing"), 1.0)
    assert peers.get(77) is None and peer.state == "lost" and 77 in peers.gone


class ConnectingBackend:
    def call(self, fn):
        return fn(SimpleNamespace(connect=lambda identity: "decode-backend", memory_kinds=("DRAM", "VRAM")))

    def fence(self, peer, until):
        pass

    def disconnect(self, name):
        pass


def test_a_hello_with_a_newer_connection_replaces_the_old_one_and_an_older_one_is_dropped():
    ctx = SimpleNamespace(stats=Stats(), sock=RecordingSocket())
    backend = ConnectingBackend()
    peers, _, side = prefill_parts(
        me=5, stats=ctx.stats, sock=ctx.sock, backend=backend, links=backend, timeouts=SimpleNamespace(lease=5.0, heartbeat=1.0),
        summary=SimpleNamespace(mismatches=lambda other, shared=None: [], pools=[]),
        layout=SimpleNamespace(tp_size=1, tp_rank=0, num_layers=2, total_kv_heads=1, mla=False, pp_size=1,
                               layers=range(2), draft_layers=0))

    def hello(conn):
        return Hello(src=77, dst=5, engine_id="dec", role="decode", tp_size=1, tp_rank=0, ctrl_endpoint="tcp://d:1",
                     backend="nixl", backend_identity=b"x", layout=None, conn=conn,
                     kv=KVMemory(k_addrs=[1], v_addrs=[2], num_pages=1, page_stride=1, token_stride=1))
    side.on_hello(hello(1), 0.0)
    first = peers.get(77)
    assert first.state == "connected" and first.conn == 1
    side.on_hello(hello(1), 0.5)                       # retransmitted: the same connection, acked again
    assert peers.get(77) is first
    side.on_hello(hello(2), 1.0)                       # the decode rank declared connection 1 lost
    second = peers.get(77)
    assert first.state == "lost" and second is not first and (second.state, second.conn) == ("connected", 2)
    side.on_hello(hello(1), 2.0)                       # connection 1's Hello, delivered late
    assert peers.get(77) is second and second.state == "connected"
    assert ctx.stats.snapshot()["dropped_messages"] == {"stale_connection": 1}
    acks = [m for _, m in ctx.sock.sent if type(m).__name__ == "HelloAck"]
    assert [(a.ok, a.conn) for a in acks] == [(True, 1), (True, 1), (True, 2)]


# -- leases judged on what the control thread could have heard (issue 49) ------------------------
def test_a_held_up_control_thread_does_not_take_its_lateness_for_the_peers_silence():
    sent = []
    ctx = SimpleNamespace(stats=Stats(), sock=SimpleNamespace(send=lambda ep, msg: sent.append(msg) or True,
                                                              forget=lambda ep: None))
    peers = peer_table(me=1, sock=ctx.sock, stats=ctx.stats)
    peer = Peer(key=PeerKey("pf", 0, 77), role="prefill", tp_size=1, endpoint="tcp://p:1", lease=Lease(5.0, 0.0),
                state="connected")
    peers.peers[77] = peer
    liveness = Liveness(me=1, peers=peers, timeouts=SimpleNamespace(lease=5.0, heartbeat=1.0, connect=3.0),
                        stats=ctx.stats, ring=SimpleNamespace(allocator=None), side=SimpleNamespace(writes_to_peers=False),
                        heartbeats=None)
    liveness.tick(12.0, looked=0.5)       # held up from 0.5 to 12 s: the peer's heartbeats may be waiting
    assert peer.state == "connected"
    assert ctx.stats.snapshot()["heard_gap_max_s"] == 12.0 and ctx.stats.snapshot()["silence_max_s"] == 0.5
    liveness.tick(12.1, looked=12.05)     # the socket read to the end: nothing from the peer in 12 s
    assert peer.state == "lost" and "lease expired" in peer.reason
    assert any(isinstance(m, Goodbye) for m in sent)


def test_a_writer_whose_fence_ran_out_says_how_it_stood():
    # the reason tells a slow peer from a slow writer: the peer was heard 1 s ago and heartbeats
    # every 2 s, but acknowledged nothing sent in the last 12 s; this rank's loop was on time
    ctx = SimpleNamespace(stats=Stats(), sock=SimpleNamespace(send=lambda ep, msg: True, forget=lambda ep: None))
    peers = peer_table(me=1, sock=ctx.sock, stats=ctx.stats)
    lease = Lease(10.0, 0.0)
    for seq in range(1, 6):
        lease.on_heartbeat(seq=seq, ack=0, now=2.0 * seq + 1)
    peer = Peer(key=PeerKey("dc", 0, 77), role="decode", tp_size=1, endpoint="tcp://d:1", lease=lease,
                state="connected")
    peers.peers[77] = peer
    liveness = Liveness(me=1, peers=peers, timeouts=SimpleNamespace(lease=10.0, heartbeat=1.0, connect=3.0),
                        stats=ctx.stats, ring=SimpleNamespace(allocator=None), side=SimpleNamespace(writes_to_peers=True),
                        heartbeats=None)
    liveness.tick(12.0, looked=12.0)
    assert peer.state == "lost", peer.state
    assert peer.reason.startswith("its acknowledgements stopped (write lease expired: "), peer.reason
    for part in ("went out 12.0 s ago, lease 10 s", "last heard 1.0 s ago", "heartbeats every 2.0 s",
                 "0.0 s late"):
        assert part in peer.reason, (part, peer.reason)
