"""Control-thread parts alone (no sockets): how unusable notifications are counted, and what an
exception inside the loop does to the rooms."""

from types import SimpleNamespace

from kvstage.transfer.backends.base import ArrivedTag
from kvstage.transfer.engine.loop import EngineLoop
from kvstage.transfer.engine.peers import Peer, PeerTable
from kvstage.transfer.engine.prefill_side import PrefillSide
from kvstage.transfer.engine.rooms import RoomBook
from kvstage.transfer.engine.routing import FrameRouter
from kvstage.transfer.engine.stats import Stats
from kvstage.transfer.protocol.actions import PeerKey
from kvstage.transfer.protocol.leases import Lease
from kvstage.transfer.protocol.tags import TagCodec, TagKind, make_tag


def prefill_parts(rooms: dict, backend=None):
    ctx = SimpleNamespace(role="prefill", stats=Stats(), tags=TagCodec(None), backend=backend)
    peers = PeerTable(ctx)
    key = PeerKey("other", 0, 77)
    peers.peers[77] = Peer(key, "decode", 1, "tcp://x:1", Lease(5.0, 0.0), state="connected", backend_name="b")
    peers.by_backend["b"] = 77
    book = RoomBook(ctx, peers)
    book.rooms.update(rooms)
    side = PrefillSide(ctx, peers, book, writes=None)
    return ctx, peers, book, side


def test_tag_at_a_prefill_rank_for_an_active_room_has_its_own_drop_reason():
    ctx, peers, book, side = prefill_parts({5: object()})  # room 5 is active here
    router = FrameRouter(ctx, peers, side, {})
    tag = make_tag(TagKind.DIRECT, room=5, session=1, epoch=1, src=77, writer=0, chunk=0, piece=0,
                   page_start=0, num_pages=1, nbytes=8)
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
    loop.ctx, loop.peers, loop.book, loop.side = prefill_parts(rooms, backend)
    return loop


def test_backend_step_raising_fails_rooms_with_writes_in_flight_and_the_loop_goes_on():
    busy, idle = FakeRoom(1, {9: object()}), FakeRoom(2, {})
    loop = bare_loop({1: busy, 2: idle}, backend=Raising())
    tags, progressed = loop._step()  # before: step() was called bare and its KeyError ended the thread
    assert tags == []
    assert loop.ctx.stats.snapshot()["internal_errors"] == {"backend_step": 1}
    assert [k for k, _ in busy.failed] == ["internal"] and "KeyError" in busy.failed[0][1]
    assert idle.failed == []


def test_a_raising_handler_fails_the_room_it_names():
    named, other = FakeRoom(1, {}), FakeRoom(2, {9: object()})
    loop = bare_loop({1: named, 2: other})

    def handler(ev):
        raise RuntimeError("bug")
    loop._safely(handler, SimpleNamespace(room=1))
    assert loop.ctx.stats.snapshot()["internal_errors"] == {"SimpleNamespace": 1}
    assert [k for k, _ in named.failed] == ["internal"]
    assert other.failed == []
