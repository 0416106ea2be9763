"""How the control thread counts notifications it cannot use (the handler alone, no sockets)."""

from kvstage.transfer.backends.base import ArrivedTag
from kvstage.transfer.engine.loop import EngineLoop, Peer
from kvstage.transfer.engine.stats import Stats
from kvstage.transfer.protocol.actions import PeerKey
from kvstage.transfer.protocol.leases import Lease
from kvstage.transfer.protocol.tags import TagCodec, TagKind, make_tag


def bare_loop(role: str, rooms: dict) -> EngineLoop:
    loop = EngineLoop.__new__(EngineLoop)
    key = PeerKey("other", 0, 77)
    loop.role, loop.stats, loop.tags, loop.rooms = role, Stats(), TagCodec(None), rooms
    loop.peers = {77: Peer(key, "decode", 1, "tcp://x:1", Lease(5.0, 0.0), state="connected", backend_name="b")}
    loop.by_backend = {"b": 77}
    return loop


def test_tag_at_a_prefill_rank_for_an_active_room_has_its_own_drop_reason():
    loop = bare_loop("prefill", {5: object()})  # room 5 is active here
    tag = make_tag(TagKind.DIRECT, room=5, session=1, epoch=1, src=77, writer=0, chunk=0, piece=0,
                   page_start=0, num_pages=1, nbytes=8)
    loop._on_tags([ArrivedTag("b", loop.tags.encode(tag))])
    assert loop.stats.snapshot()["dropped_tags"] == {"tag_at_prefill_rank": 1}
