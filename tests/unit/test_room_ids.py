"""Room ids are unsigned 64-bit integers (SGLang draws them at random in [0, 2**63)): every
message and tag carries the whole range, and anything outside it is refused in the caller's thread."""

from types import SimpleNamespace

import pytest

from kvstage.transfer.engine.manager import KVManager
from kvstage.transfer.protocol.messages import RoomFailed, RoomMeta, peer_codec
from kvstage.transfer.protocol.tags import TagCodec, TagKind, make_tag

EDGES = [0, 1, 2**63 - 1, 2**63, 2**64 - 1]


def check(role: str, room):
    KVManager._check(SimpleNamespace(_closed=False, config=SimpleNamespace(role=role)), role, room)


@pytest.mark.parametrize("room", EDGES)
def test_every_unsigned_64_bit_room_is_accepted(room):
    check("prefill", room)
    check("decode", room)


@pytest.mark.parametrize("room", [-1, 2**64, 2**70, True, 1.0, "7", None])
def test_a_room_outside_64_bits_is_a_value_error(room):
    with pytest.raises(ValueError, match="unsigned 64-bit"):
        check("prefill", room)


@pytest.mark.parametrize("room", EDGES)
def test_messages_and_tags_carry_the_whole_range(room):
    codec = peer_codec(b"k")
    for msg in (RoomMeta(src=1, dst=2, room=room, session=3, num_pages=4, staged=True),
                RoomFailed(src=1, dst=2, room=room, session=3, kind="aborted", reason="x")):
        assert codec.decode(codec.encode(msg)) == msg
    tags = TagCodec(b"k")
    tag = make_tag(TagKind.DIRECT, room=room, session=3, epoch=1, src=2, writer=0, chunk=0, piece=0,
                   page_start=0, num_pages=1, nbytes=8, layers=range(1))
    assert tags.decode(tags.encode(tag)).room == room
