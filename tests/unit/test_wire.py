"""Control messages and tags: round trips, and only WireError for anything malformed."""

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstage.transfer.layout import LayoutSummary
from kvstage.transfer.protocol.messages import (
    PEER_MESSAGES,
    AllocGrant,
    AllocRequest,
    Hello,
    KVMemory,
    Piece,
    RingInfo,
    RoomMeta,
    WatermarkUpdate,
    encode_pages,
    peer_codec,
)
from kvstage.transfer.protocol.tags import TagCodec, TagKind, make_tag
from kvstage.wire import WIRE_VERSION, WireError, sign

SUMMARY = LayoutSummary(dtype="bfloat16", head_dim=128, page_size=16, num_layers=32, total_kv_heads=8, mla=False)


def samples():
    kv = KVMemory(k_addrs=[1, 2], v_addrs=[3, 4], num_pages=10, page_stride=4096, token_stride=256)
    return [
        Hello(src=1, engine_id="d", role="decode", tp_size=2, tp_rank=0, ctrl_endpoint="tcp://h:1",
              backend="nixl", backend_identity=b"\x00md", layout=SUMMARY, kv=kv,
              ring=RingInfo(addr=99, size=1 << 20, epoch=5), staging=True),
        RoomMeta(src=1, dst=2, room=42, session=7, num_pages=3, staged=False, dst_pages=encode_pages(np.array([5, 1, 9]))),
        AllocRequest(src=1, dst=2, room=42, session=7, chunk=0, page_start=0, num_pages=3, layer_start=0, num_layers=1),
        AllocGrant(src=2, dst=1, room=42, session=7, chunk=0, epoch=5, pieces=[Piece(0, 0, 3, 4096, 1024)]),
        WatermarkUpdate(src=2, dst=1, epoch=5, round=3, tail=256),
    ]


@pytest.mark.parametrize("token", [None, b"secret"])
def test_round_trip(token):
    codec = peer_codec(token)
    for msg in samples():
        assert codec.decode(codec.encode(msg)) == msg
    meta = samples()[1]
    assert list(codec.decode(codec.encode(meta)).pages()) == [5, 1, 9]


def test_auth_wrong_and_missing():
    signed, other, plain = peer_codec(b"a"), peer_codec(b"b"), peer_codec(None)
    frame = signed.encode(samples()[2])
    with pytest.raises(WireError) as e:
        other.decode(frame)
    assert e.value.kind == "auth"
    with pytest.raises(WireError):
        signed.decode(plain.encode(samples()[2]))


def test_wrong_version_and_oversized():
    codec = peer_codec(None)
    payload = msgspec.msgpack.encode({"t": "Heartbeat", "v": WIRE_VERSION + 1, "src": 1})
    with pytest.raises(WireError) as e:
        codec.decode([payload, sign(None, payload)])
    assert e.value.kind == "version"
    small = peer_codec(None, max_frame=64)
    with pytest.raises(WireError) as e:
        small.decode([b"x" * 65, b""])
    assert e.value.kind == "oversized"
    with pytest.raises(WireError):
        small.encode(samples()[0])


def test_corrupted_frames_are_refused_without_a_token_too():
    codec = peer_codec(None)
    for msg in samples():
        payload, mac = codec.encode(msg)
        for i in range(0, len(payload), 7):
            bad = bytearray(payload)
            bad[i] ^= 0x10
            with pytest.raises(WireError) as e:
                codec.decode([bytes(bad), mac])
            assert e.value.kind == "integrity"


def test_truncated_frames():
    codec = peer_codec(b"k")
    for msg in samples():
        payload, mac = codec.encode(msg)
        for cut in range(0, len(payload), max(1, len(payload) // 20)):
            with pytest.raises(WireError):
                codec.decode([payload[:cut], mac])
    unsigned = peer_codec(None)
    for msg in samples():
        payload, _ = unsigned.encode(msg)
        for cut in range(len(payload)):
            with pytest.raises(WireError):
                unsigned.decode([payload[:cut], sign(None, payload[:cut])])


@given(st.lists(st.binary(max_size=300), max_size=4))
@settings(max_examples=2000, deadline=None)
def test_garbage_frames_raise_only_wire_error(parts):
    for codec in (peer_codec(None), peer_codec(b"t")):
        try:
            codec.decode(parts)
        except WireError:
            pass


json_like = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=20) | st.binary(max_size=20),
    lambda c: st.lists(c, max_size=5) | st.dictionaries(st.text(max_size=8), c, max_size=5), max_leaves=20)


@given(json_like, st.sampled_from([m.__name__ for m in PEER_MESSAGES]))
@settings(max_examples=1000, deadline=None)
def test_wrong_shapes_raise_only_wire_error(obj, name):
    codec = peer_codec(None)
    payloads = [msgspec.msgpack.encode(obj)]
    if isinstance(obj, dict):
        payloads.append(msgspec.msgpack.encode({**obj, "t": name, "v": WIRE_VERSION}))
    for p in payloads:
        try:  # correctly checksummed, so the decoder itself is exercised
            codec.decode([p, sign(None, p)])
        except WireError:
            pass


def test_tag_round_trip_and_auth():
    tag = make_tag(TagKind.STAGED, room=2**64 - 1, session=3, epoch=2**64 - 1, src=9, writer=1, chunk=4,
                   piece=2, page_start=100, num_pages=8, nbytes=1 << 30, ring_start=12345, layers=range(1))
    for token in (None, b"s"):
        c = TagCodec(token)
        assert c.decode(c.encode(tag)) == tag
    with pytest.raises(WireError) as e:
        TagCodec(b"s").decode(TagCodec(b"t").encode(tag))
    assert e.value.kind == "auth"
    with pytest.raises(WireError):
        TagCodec(None).decode(TagCodec(b"t").encode(tag))  # trailing mac is not a tag
    assert len(TagCodec(b"s").encode(tag)) < 128


@given(st.binary(max_size=600))
@settings(max_examples=3000, deadline=None)
def test_tag_garbage_raises_only_wire_error(data):
    for c in (TagCodec(None), TagCodec(b"k")):
        try:
            c.decode(data)
        except WireError:
            pass
    for body in (b"KS" + data, b"KS" + data[:40]):
        try:
            TagCodec(None).decode(body + sign(None, body))
        except WireError:
            pass


def test_tag_truncations():
    c = TagCodec(None)
    data = c.encode(make_tag(TagKind.DIRECT, room=1, session=1, epoch=1, src=1, writer=0, chunk=0, piece=0,
                             page_start=0, num_pages=1, nbytes=1, layers=range(1)))
    for cut in range(len(data)):
        with pytest.raises(WireError):
            c.decode(data[:cut])
