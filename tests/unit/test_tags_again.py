"""A lost write notification costs a heartbeat, not the request (issue 49): the prefill room
repeats the signed tags of its completed writes (TagsAgain) while its decode rank has not
confirmed and no write completed for a heartbeat; the decode room tells a tag it already holds
from one it still needs, so each tag counts once whichever path brought it. The engine's half
(decoding, applying as a notification) runs in tests/integration/test_lost_notifications.py."""

import itertools

import numpy as np
import torch

from kvstage.transfer.config import Timeouts
from kvstage.transfer.layout import KVLayout
from kvstage.transfer.protocol.actions import PeerKey, PostWrite, Send
from kvstage.transfer.protocol.decode.room import DecodeRoom, RoomPlan
from kvstage.transfer.protocol.head_mapping import compute_assignments
from kvstage.transfer.protocol.messages import RoomMeta, TagsAgain
from kvstage.transfer.protocol.prefill.room import PrefillRoom

LAYOUT = KVLayout(num_layers=2, total_kv_heads=2, head_dim=4, dtype=torch.uint8, page_size=2, tp_size=1, tp_rank=0)
PREF, DEC = PeerKey("prefill", 0, 1000), PeerKey("decode", 0, 2000)
SESSION, BEAT = 22, 1.0


def transferring(pages: int = 4) -> PrefillRoom:
    r = PrefillRoom(room=7, num_pages=pages, layout=LAYOUT, me=PREF.incarnation, now=0.0,
                    timeouts=Timeouts(heartbeat=BEAT), op_ids=itertools.count(1))
    r.add_meta(DEC, 1, RoomMeta(src=DEC.incarnation, dst=PREF.incarnation, room=7, session=SESSION, num_pages=pages,
                                staged=False, dst_pages=np.arange(pages, dtype="<i8").tobytes()), 0.0)
    return r


def again(actions) -> list[TagsAgain]:
    return [a.msg for a in actions if isinstance(a, Send) and isinstance(a.msg, TagsAgain)]


def test_a_stalled_unconfirmed_flow_repeats_its_tags_once_a_heartbeat():
    r = transferring(pages=2)
    ops = [a.op for a in r.add_chunk(np.arange(2), True, 0.1) if isinstance(a, PostWrite)]
    assert len(ops) == 1
    r.on_write_done(ops[0].op_id, True, None, 0.2, tags=(b"tag-0",))   # WriterDone goes out: unconfirmed
    assert again(r.tick(0.2 + BEAT / 2)) == []               # a write completed within the heartbeat
    sent = again(r.tick(0.2 + BEAT))
    assert [(m.room, m.session, m.tags) for m in sent] == [(7, SESSION, [b"tag-0"])]
    assert again(r.tick(0.2 + BEAT * 1.5)) == []             # at most once a heartbeat
    assert [m.tags for m in again(r.tick(0.2 + BEAT * 2))] == [[b"tag-0"]]


def test_every_completed_tag_is_repeated_and_none_of_a_failed_write():
    r = transferring()
    first = [a.op for a in r.add_chunk(np.arange(2), False, 0.1) if isinstance(a, PostWrite)]
    r.on_write_done(first[0].op_id, True, None, 0.2, tags=(b"a0", b"a1"))   # a write split in two groups
    second = [a.op for a in r.add_chunk(np.arange(2, 4), True, 0.3) if isinstance(a, PostWrite)]
    r.on_write_done(second[0].op_id, True, None, 0.4, tags=(b"b",))
    assert [m.tags for m in again(r.tick(0.5 + BEAT))] == [[b"a0", b"a1", b"b"]]


def test_a_flow_waiting_for_its_next_chunk_with_nothing_in_flight_sends_none():
    """Between two chunks of a chunked prefill the decode rank waits for nothing of this writer:
    no message wakes it every heartbeat (the quiet engine)."""
    r = transferring()
    ops = [a.op for a in r.add_chunk(np.arange(2), False, 0.1) if isinstance(a, PostWrite)]
    r.on_write_done(ops[0].op_id, True, None, 0.2, tags=(b"tag-0",))
    assert again(r.tick(0.2 + 5 * BEAT)) == []
    second = [a.op for a in r.add_chunk(np.arange(2, 4), True, 6.0) if isinstance(a, PostWrite)]
    assert again(r.tick(6.0 + BEAT / 2)) == [], "a write in flight that started a moment ago"
    assert [m.tags for m in again(r.tick(6.0 + 4 * BEAT))] == [[b"tag-0"]], "its write has not completed in 4 s"
    r.on_write_done(second[0].op_id, True, None, 11.0, tags=(b"tag-1",))
    assert [m.tags for m in again(r.tick(11.0 + 2 * BEAT))] == [[b"tag-0", b"tag-1"]]


def test_a_confirmed_flow_or_one_without_completed_writes_sends_none():
    """One prefill rank writing two decode ranks (TP 1 -> 2): the rank that confirmed hears no
    more tags; the other, still unconfirmed, does."""
    decs = [PeerKey("decode", d, 2000 + d) for d in range(2)]
    r = PrefillRoom(room=7, num_pages=4, layout=LAYOUT, me=PREF.incarnation, now=0.0,
                    timeouts=Timeouts(heartbeat=BEAT), op_ids=itertools.count(1))
    for d in decs:
        r.add_meta(d, 2, RoomMeta(src=d.incarnation, dst=PREF.incarnation, room=7, session=SESSION + d.tp_rank,
                                  num_pages=4, staged=False, dst_pages=np.arange(4, dtype="<i8").tobytes()), 0.0)
    assert again(r.tick(5.0)) == []                          # nothing completed yet
    ops = [a.op for a in r.add_chunk(np.arange(4), True, 5.0) if isinstance(a, PostWrite)]
    assert sorted(op.peer.tp_rank for op in ops) == [0, 1]
    for op in ops:
        r.on_write_done(op.op_id, True, None, 5.1, tags=(f"t{op.peer.tp_rank}".encode(),))
    r.on_room_done(decs[0], SESSION, 5.2)
    assert [(m.dst, m.tags) for m in again(r.tick(5.2 + BEAT))] == [(decs[1].incarnation, [b"t1"])]


def test_the_decode_room_holds_a_tag_once_it_landed():
    a = compute_assignments(1, 1, LAYOUT.total_kv_heads, False).find(0, 0)
    hpb = LAYOUT.num_kv * LAYOUT.num_layers * LAYOUT.page_size * LAYOUT.head_bytes
    d = DecodeRoom(room=7, session=SESSION, me=DEC.incarnation, layout=LAYOUT, now=0.0, timeouts=Timeouts())
    d.on_plan(RoomPlan(writers=((PREF, a),), notices=(), staged=False, head_page_bytes=hpb), 0.0)
    d.init(np.arange(4), 0.1)
    p = transferring()
    ops = [x.op for x in p.add_chunk(np.arange(2), False, 0.2) if isinstance(x, PostWrite)]
    tag = ops[0].tag
    assert not d.holds_tag(PREF, tag)
    assert d.on_tag(PREF, tag, 0.3).verdict == "ok"
    assert d.holds_tag(PREF, tag)
    assert not d.holds_tag(PeerKey("prefill", 0, 1001), tag)    # another incarnation's write is not this one
