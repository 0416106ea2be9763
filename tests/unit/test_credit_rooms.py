"""Ring credits in the room state machines (issue 47, item 2's wiring): a prefill room cuts a
single-writer chunk into pieces and takes from its decode peer's purse the first that fit (at
once, no ring-space round trip), asking the grant path only for the rest (the remainder, under
a number of its own) or, when none fits, for the whole chunk; a decode room takes a piece it did not
plan from a credit tag the ring's ledger claimed, scatters it and hands its place back to the
ledger; a claim the ledger refuses fails that room only. Real ledger, purse, ring and rooms:
only the engine shell between them is left out (docs/protocol.md, "Ring credits")."""

from __future__ import annotations

import dataclasses
import itertools

import msgspec
import numpy as np
import pytest
import torch

from kvstage.transfer.config import Timeouts
from kvstage.transfer.layout import KVLayout
from kvstage.transfer.poll import KVPoll
from kvstage.transfer.pool_spec import PoolSpec
from kvstage.transfer.protocol.actions import (
    PeerKey,
    PostWrite,
    PrepareScatter,
    ReleaseCredit,
    Scatter,
    Send,
    SettleCredits,
)
from kvstage.transfer.protocol.credits import ClaimVerdict, WriteRef
from kvstage.transfer.protocol.decode.credits import CreditLedger
from kvstage.transfer.protocol.decode.room import DecodeRoom, RoomPlan, TagVerdict
from kvstage.transfer.protocol.head_mapping import compute_assignments
from kvstage.transfer.protocol.messages import AllocGrant, AllocRequest, HelloAck, Quiesced, RoomMeta, peer_codec
from kvstage.transfer.protocol.prefill.credits import REMAINDER, CreditPurse, chunk_number, cut_pieces, remainder_number
from kvstage.transfer.protocol.prefill.room import PrefillRoom, answers_meta
from kvstage.transfer.protocol.ring import RingAllocator
from kvstage.transfer.protocol.tags import TagKind
from kvstage.wire import sign

LAYOUT = KVLayout(num_layers=2, total_kv_heads=2, head_dim=4, dtype=torch.uint8, page_size=2, tp_size=1, tp_rank=0,
                  mla=False)
PREF = PeerKey("prefill", 0, 1000)
DEC = PeerKey("decode", 0, 2000)
N = 4                       # pages of a request
PAGE = 64                   # bytes one page of the writer holds: K/V x 2 layers x 2 tokens x 2 heads x 4 bytes
RING = 4096
SESSION = 22


class Purses:
    """The engine shell's side of the rooms' CreditPurses: one purse, towards DEC."""

    def __init__(self, purse: CreditPurse | None, piece_bytes: int = 2 * PAGE):
        self._purse, self.piece_bytes = purse, piece_bytes

    def purse(self, peer: PeerKey) -> CreditPurse | None:
        return self._purse if peer == DEC else None


def world(credit_bytes: int = 4 * PAGE * 2, piece_bytes: int = 2 * PAGE):
    """A ring with its ledger, a credit of `credit_bytes` given to PREF and held by its purse."""
    ring = RingAllocator(RING, 64)
    ledger = CreditLedger(ring, floor=64)
    ledger.connect(PREF)
    purse = CreditPurse(epoch=DEC.incarnation, ring_size=RING)
    ledger.add_demand(PREF, 0, 0, credit_bytes)   # a demand of this size makes a credit of this size
    (c,) = ledger.issue()
    assert c.nbytes == credit_bytes
    ledger.end_room(0, 0)
    assert purse.on_grant(credit=c.credit, epoch=DEC.incarnation, start=c.start, nbytes=c.nbytes) == "ok"
    return ring, ledger, purse, Purses(purse, piece_bytes)


def plan() -> RoomPlan:
    a = compute_assignments(1, 1, LAYOUT.total_kv_heads, False).find(0, 0)
    hpb = LAYOUT.num_kv * LAYOUT.num_layers * LAYOUT.page_size * LAYOUT.head_bytes
    return RoomPlan(writers=((PREF, a),), staged=True, head_page_bytes=hpb, max_piece_pages=N, ring_align=64,
                    ring_epoch=DEC.incarnation, prefill_tp=1, decode_tp=1, ring_size=RING, buffer_bytes=1024,
                    can_stage=True)


def decode(room: int = 7, session: int = SESSION) -> DecodeRoom:
    d = DecodeRoom(room=room, session=session, me=DEC.incarnation, layout=LAYOUT, now=0.0, timeouts=Timeouts())
    d.on_plan(plan(), 0.0)
    acts = d.init(np.arange(10, 10 + N), 1.0)
    assert any(isinstance(a, Send) and isinstance(a.msg, RoomMeta) and a.msg.staged for a in acts)
    return d


def prefill(purses, room: int = 7, session: int = SESSION, layout: KVLayout = LAYOUT, decode_tp: int = 1):
    p = PrefillRoom(room=room, num_pages=N, layout=layout, me=PREF.incarnation, now=0.0, timeouts=Timeouts(),
                    op_ids=itertools.count(room * 100), credits=purses)
    p.add_meta(DEC, decode_tp, RoomMeta(src=DEC.incarnation, dst=PREF.incarnation, room=room, session=session,
                                        num_pages=N, staged=True), 1.0)
    return p


def writes(actions):
    return [a.op for a in actions if isinstance(a, PostWrite)]


def asks(actions):
    return [a.msg for a in actions if isinstance(a, Send) and isinstance(a.msg, AllocRequest)]


def land(d: DecodeRoom, ledger: CreditLedger, ring: RingAllocator, op, now: float = 3.0):
    """The tag of `op` arrives at the decode rank: claimed, applied; scatters done and released."""
    claim = ledger.claim(PREF, op.tag.ring_start, op.tag.nbytes, op.tag.room, op.tag.session)
    res = d.on_credit_tag(PREF, op.tag, claim, RING, now)
    for a in list(res.actions):
        if isinstance(a, Scatter):
            res.actions.extend(d.on_scattered(a.key, True, None, ring, now))
    for a in res.actions:
        if isinstance(a, ReleaseCredit):
            ledger.release(a.peer, a.span)
    return res


def test_a_staged_decode_room_asks_once_for_its_pages_to_be_made_ready_a_direct_one_never():
    """PrepareScatter: with its metadata, a staged room hands the scatter its destination pages
    (the array its pieces are slices of), once; a direct room scatters nothing and asks nothing."""
    d = DecodeRoom(room=7, session=SESSION, me=DEC.incarnation, layout=LAYOUT, now=0.0, timeouts=Timeouts())
    d.on_plan(plan(), 0.0)
    dst = np.arange(10, 10 + N)
    (ask,) = [a for a in d.init(dst, 1.0) if isinstance(a, PrepareScatter)]
    assert ask.room == 7 and ask.dst_pages is d.dst_pages and ask.dst_pages is dst
    assert not [a for a in d.tick(None, 2.0) if isinstance(a, PrepareScatter)]
    direct = DecodeRoom(room=8, session=SESSION, me=DEC.incarnation, layout=LAYOUT, now=0.0, timeouts=Timeouts())
    direct.on_plan(dataclasses.replace(plan(), staged=False), 0.0)
    acts = direct.init(np.arange(10, 10 + N), 1.0)
    assert [a.msg.staged for a in acts if isinstance(a, Send) and isinstance(a.msg, RoomMeta)] == [False]
    assert not [a for a in acts if isinstance(a, PrepareScatter)]


def test_a_single_writer_request_writes_into_its_credit_without_asking_and_gives_it_back():
    ring, ledger, purse, purses = world()
    d, p = decode(), prefill(purses)
    acts = p.add_chunk(np.arange(N), True, 2.0)
    ops = writes(acts)
    assert not asks(acts) and len(ops) == 2   # 2 pieces of 2 pages, both posted at once
    assert all(op.tag.kind is TagKind.CREDIT and op.credit is not None for op in ops)
    assert [op.ring_start for op in ops] == [op.credit.start for op in ops] == [ops[0].ring_start, ops[0].ring_start
                                                                                + 2 * PAGE]
    results = [land(d, ledger, ring, op) for op in ops]   # both in flight before either completed
    assert [r.verdict for r in results] == [TagVerdict.OK, TagVerdict.OK]
    assert d.state is KVPoll.Success and not d.credit_pieces
    for op in ops:
        acts = p.on_write_done(op.op_id, True, None, 4.0, (b"t",))
        assert any(isinstance(a, SettleCredits) and a.peer == DEC for a in acts)
    p.on_room_done(DEC, SESSION, 5.0)
    assert p.state is KVPoll.Success and not p.wants_credits(DEC)
    purse.idle()
    (back,) = purse.returns()
    assert [(w.room, w.start) for w in back.writes] == [(7, op.ring_start) for op in ops]
    assert ledger.on_return(PREF, back.credit, list(back.writes)).freed
    assert ring.live_bytes == 0


@pytest.mark.parametrize("bad", ["outside", "overlap", "too_late"])
def test_a_claim_the_ledger_refuses_fails_only_that_room(bad):
    ring, ledger, purse, purses = world()
    d7, d8 = decode(7, 22), decode(8, 33)
    p7, p8 = prefill(purses, 7, 22), prefill(purses, 8, 33)
    ops7 = writes(p7.add_chunk(np.arange(N), True, 2.0))
    ops8 = writes(p8.add_chunk(np.arange(N), True, 2.0))
    tag = ops8[0].tag
    if bad == "outside":
        tag = msgspec.structs.replace(tag, ring_start=RING * 5)
    elif bad == "overlap":
        land(d7, ledger, ring, ops7[0])
        tag = msgspec.structs.replace(tag, ring_start=ops7[0].ring_start)
    else:   # its credit came back naming room 7's writes only, before they landed
        ledger.add_demand(PREF, 7, 22, N * PAGE)
        ledger.add_demand(PREF, 8, 33, N * PAGE)
        for op in ops7:
            purse.done(op.credit, True)
        assert ledger.on_return(PREF, ops7[0].credit.credit, [WriteRef(room=7, session=22, start=op.ring_start,
                                                                       nbytes=op.nbytes) for op in ops7]).ok
    claim = ledger.claim(PREF, tag.ring_start, tag.nbytes, tag.room, tag.session)
    assert claim.verdict == bad
    res = d8.on_credit_tag(PREF, tag, claim, RING, 3.0)
    assert res.verdict is TagVerdict.REJECTED and d8.state is KVPoll.Failed
    assert d8.failure_kind == "protocol" and bad in (d8.failure or "")
    assert not any(isinstance(a, (Scatter, ReleaseCredit)) for a in res.actions)   # its bytes are never scattered
    for op in ops7:   # the other room is untouched and completes
        if bad != "overlap" or op is not ops7[0]:
            assert land(d7, ledger, ring, op).verdict is TagVerdict.OK
    assert d7.state is KVPoll.Success


@pytest.mark.parametrize("bad", ["pages", "bytes", "epoch"])
def test_a_credit_piece_that_does_not_match_the_plan_fails_its_room_and_its_place_goes_back(bad):
    ring, ledger, purse, purses = world()
    d, p = decode(), prefill(purses)
    op = writes(p.add_chunk(np.arange(N), True, 2.0))[0]
    tag = {"pages": msgspec.structs.replace(op.tag, page_start=N - 1),
           "bytes": msgspec.structs.replace(op.tag, nbytes=op.tag.nbytes - 1),
           "epoch": msgspec.structs.replace(op.tag, epoch=DEC.incarnation + 1)}[bad]
    claim = ledger.claim(PREF, tag.ring_start, tag.nbytes, tag.room, tag.session)
    assert claim.verdict is ClaimVerdict.OK
    res = d.on_credit_tag(PREF, tag, claim, RING, 3.0)
    assert res.verdict is TagVerdict.REJECTED and d.state is KVPoll.Failed
    assert [a for a in res.actions if isinstance(a, ReleaseCredit)] == [ReleaseCredit(PREF, claim.span)]
    assert not any(isinstance(a, Scatter) for a in res.actions)


def test_a_repeated_credit_tag_is_a_duplicate_and_claims_nothing_more():
    ring, ledger, purse, purses = world()
    d, p = decode(), prefill(purses)
    ops = writes(p.add_chunk(np.arange(N), True, 2.0))
    claim = ledger.claim(PREF, ops[0].tag.ring_start, ops[0].tag.nbytes, 7, SESSION)
    first = d.on_credit_tag(PREF, ops[0].tag, claim, RING, 3.0)
    again = ledger.claim(PREF, ops[0].tag.ring_start, ops[0].tag.nbytes, 7, SESSION)
    assert first.verdict is TagVerdict.OK and again.verdict is ClaimVerdict.DUPLICATE
    assert d.on_credit_tag(PREF, ops[0].tag, again, RING, 3.1) == type(first)(TagVerdict.DUPLICATE, [])


def test_a_chunk_none_of_whose_pieces_fits_goes_whole_through_the_grant_path_and_the_credit_back_unused():
    ring, ledger, purse, purses = world(credit_bytes=PAGE)   # 1 page: not even the first piece (2 pages) fits
    p = prefill(purses)
    acts = p.add_chunk(np.arange(N), True, 2.0)
    assert not writes(acts) and len(asks(acts)) == 1 and any(isinstance(a, SettleCredits) for a in acts)
    (back,) = purse.returns()   # nothing was taken from it
    assert back.writes == ()
    req = asks(acts)[0]
    assert (req.chunk, req.page_start, req.num_pages) == (0, 0, N)   # under the chunk's own number
    d = decode()
    out = d.on_alloc_request(PREF, req, ring, 3.0)
    (grant,) = [a.msg for a in out if isinstance(a, Send) and isinstance(a.msg, AllocGrant)]
    staged = writes(p.on_grant(DEC, grant, 3.5))
    assert staged and all(op.tag.kind is TagKind.STAGED and op.credit is None for op in staged)


def granted(d: DecodeRoom, p: PrefillRoom, ring: RingAllocator, req: AllocRequest, now: float = 3.0):
    """`req` reaches the decode room; its grant reaches the prefill room: the granted writes."""
    out = d.on_alloc_request(PREF, req, ring, now)
    (grant,) = [a.msg for a in out if isinstance(a, Send) and isinstance(a.msg, AllocGrant)]
    return writes(p.on_grant(DEC, grant, now + 0.1))


def land_granted(d: DecodeRoom, ring: RingAllocator, op, now: float = 4.0):
    res = d.on_tag(PREF, op.tag, now)
    for a in list(res.actions):
        if isinstance(a, Scatter):
            res.actions.extend(d.on_scattered(a.key, True, None, ring, now))
    return res


def pages_written(ops) -> list[int]:
    return sorted(pg for op in ops for pg in range(op.tag.page_start, op.tag.page_start + op.tag.num_pages))


@pytest.mark.parametrize("grant_first", [False, True], ids=["credit_tag_first", "grant_first"])
@pytest.mark.parametrize(("piece_pages", "fit"), [(2, 1), (1, 1), (1, 2), (1, 3), (1, 4)])
def test_a_chunk_larger_than_its_credit_writes_what_fits_and_asks_only_for_the_rest(piece_pages, fit, grant_first):
    """A chunk of N pieces with credit for `fit` of them: those go by credit, the others by
    grant under the remainder's number; every page written exactly once, the room succeeds on
    both sides, and the credit and the granted region come back (the ring is empty)."""
    pieces = N // piece_pages
    ring, ledger, purse, purses = world(credit_bytes=PAGE * (piece_pages * fit + (piece_pages > 1)),
                                        piece_bytes=PAGE * piece_pages)   # (2, 1): 3 pages, one piece fits
    d, p = decode(), prefill(purses)
    acts = p.add_chunk(np.arange(N), True, 2.0)
    credit_ops, reqs = writes(acts), asks(acts)
    assert [(op.tag.kind, op.tag.chunk, op.tag.piece) for op in credit_ops] == [(TagKind.CREDIT, 0, i)
                                                                               for i in range(fit)]
    if fit < pieces:   # only the rest, numbered apart; no open credit while it asks
        assert [(r.chunk, r.page_start, r.num_pages) for r in reqs] == [(REMAINDER, fit * piece_pages,
                                                                         N - fit * piece_pages)]
        assert purse.free_bytes == 0 and any(isinstance(a, SettleCredits) for a in acts)
    else:
        assert not reqs
    staged = []
    for req in reqs if grant_first else ():
        staged += granted(d, p, ring, req)
    for op in credit_ops:
        assert land(d, ledger, ring, op).verdict is TagVerdict.OK
    for req in () if grant_first else reqs:
        staged += granted(d, p, ring, req)
    assert all(op.tag.kind is TagKind.STAGED and op.credit is None and op.tag.chunk == REMAINDER for op in staged)
    assert pages_written(credit_ops + staged) == list(range(N))   # each page once, by one path or the other
    assert [land_granted(d, ring, op).verdict for op in staged] == [TagVerdict.OK] * len(staged)
    assert d.state is KVPoll.Success and not d.credit_pieces
    for op in credit_ops + staged:
        p.on_write_done(op.op_id, True, None, 5.0, (b"t",))
    p.on_room_done(DEC, SESSION, 5.5)
    assert p.state is KVPoll.Success
    assert p.on_grant(DEC, AllocGrant(src=DEC.incarnation, dst=PREF.incarnation, room=7, session=SESSION,
                                      chunk=REMAINDER, epoch=DEC.incarnation, pieces=[]), 6.0) == []   # a repeat
    purse.idle()
    (back,) = purse.returns()
    assert [(w.start, w.nbytes) for w in back.writes] == [(op.ring_start, op.nbytes) for op in credit_ops]
    assert ledger.on_return(PREF, back.credit, list(back.writes)).freed
    assert ring.live_bytes == 0


def test_remainders_are_numbered_apart_from_every_chunk_and_piece():
    """Two chunks of 2 one-page pieces each, credit for 3 pages: chunk 0 wholly by credit, chunk
    1's first piece by credit and its remainder by grant; no (chunk, piece) is named twice."""
    ring, ledger, purse, purses = world(credit_bytes=PAGE * 3, piece_bytes=PAGE)
    d, p = decode(), prefill(purses)
    first = p.add_chunk(np.arange(2), False, 2.0)
    second = p.add_chunk(np.arange(2, N), True, 2.1)
    assert not asks(first) and len(writes(first)) == 2
    (req,) = asks(second)
    assert (req.chunk, req.page_start, req.num_pages) == (REMAINDER + 1, 3, 1)
    ops = writes(first) + writes(second)
    for op in ops:
        assert land(d, ledger, ring, op).verdict is TagVerdict.OK
    staged = granted(d, p, ring, req)
    assert [land_granted(d, ring, op).verdict for op in staged] == [TagVerdict.OK]
    keys = [(op.tag.chunk, op.tag.piece) for op in ops + staged]
    assert keys == [(0, 0), (0, 1), (1, 0), (REMAINDER + 1, 0)] and len(set(keys)) == len(keys)
    assert pages_written(ops + staged) == list(range(N)) and d.state is KVPoll.Success


def test_remainder_numbers_collide_with_no_chunk_number_and_are_refused_where_they_could():
    most = 1000
    own = set(range(most))
    rest = {remainder_number(w, most_chunks=most) for w in own}
    assert None not in rest and not rest & own and len(rest) == most
    assert all(chunk_number(r, splits=True) == (r - REMAINDER, True) for r in rest if r is not None)
    assert all(chunk_number(w, splits=True) == (w, False) for w in own)
    # a room that could number REMAINDER chunks of its own splits none: its numbers are all its chunks'
    assert remainder_number(0, most_chunks=REMAINDER + 1) is None
    assert chunk_number(REMAINDER + 5, splits=False) == (REMAINDER + 5, False)


def test_a_room_that_cannot_number_a_remainder_keeps_a_chunk_whole():
    _, _, purse, purses = world(credit_bytes=PAGE * 3)
    p = prefill(purses)
    p.layout = KVLayout(num_layers=REMAINDER, total_kv_heads=2, head_dim=4, dtype=torch.uint8, page_size=2, tp_size=1,
                        tp_rank=0, mla=False)   # a bound on its chunk numbers past REMAINDER (the geometry is not used)
    acts = p.add_chunk(np.arange(N), True, 2.0)
    assert not writes(acts) and [r.chunk for r in asks(acts)] == [0]   # all or nothing, as before remainders


@pytest.mark.parametrize("end", ["abort", "peer_lost"])
@pytest.mark.parametrize("tag_landed", [True, False])
def test_an_ended_room_returns_both_its_credit_and_its_granted_remainder(end, tag_landed):
    """The room ends with its credit piece written (landed or not) and its remainder granted,
    its writes in flight: the decode side frees the granted region and the credit's place
    comes back; the ring is empty at the end."""
    ring, ledger, purse, purses = world(credit_bytes=PAGE * 3)
    d, p = decode(), prefill(purses)
    acts = p.add_chunk(np.arange(N), True, 2.0)
    (cw,), (req,) = writes(acts), asks(acts)
    if tag_landed:
        assert land(d, ledger, ring, cw).verdict is TagVerdict.OK
    staged = granted(d, p, ring, req)
    assert ring.live_bytes > 0
    released: list = []
    if end == "abort":
        d.abort(ring, 4.0)
        p.on_room_failed(DEC, SESSION, "aborted", "aborted by the decode caller", 4.1)
        done = [a for op in [cw, *staged] for a in p.on_write_done(op.op_id, True, None, 4.2)]
        (q,) = [a.msg for a in done if isinstance(a, Send) and isinstance(a.msg, Quiesced)]
        released = d.on_quiesced(PREF, q.session, ring, 4.3)
    else:
        released = d.on_peer_lost(PREF, "gone", ring, 4.0)
        p.on_peer_lost(DEC, "gone", 4.0)
        for op in [cw, *staged]:
            p.on_write_done(op.op_id, False, "peer lost", 4.2)
        purse.lost()
        ledger.peer_lost(PREF)
    assert d.state is KVPoll.Failed and p.state is KVPoll.Failed and d.released
    for a in released:
        if isinstance(a, ReleaseCredit):
            ledger.release(a.peer, a.span)
    if end == "abort":
        purse.idle()
        (back,) = purse.returns()
        assert ledger.on_return(PREF, back.credit, list(back.writes)).ok
    assert ring.live_bytes == 0


def test_without_a_purse_or_with_several_writers_a_chunk_asks_for_ring_space():
    assert asks(prefill(Purses(None)).add_chunk(np.arange(N), True, 2.0))
    _, _, purse, purses = world()
    two = KVLayout(num_layers=2, total_kv_heads=2, head_dim=4, dtype=torch.uint8, page_size=2, tp_size=2, tp_rank=0,
                   mla=False)   # P2 -> D1: both prefill ranks write parts of each piece
    acts = prefill(purses, layout=two).add_chunk(np.arange(N), True, 2.0)
    assert asks(acts) and not writes(acts) and purse.free_bytes == 4 * PAGE * 2


def test_cut_pieces_leaves_room_for_the_pool_block_in_the_last_piece():
    assert cut_pieces(0, 5, page_bytes=10, piece_bytes=20) == [(0, 2), (2, 2), (4, 1)]
    assert cut_pieces(0, 4, page_bytes=10, piece_bytes=20, last_extra=5) == [(0, 2), (2, 1), (3, 1)]
    assert cut_pieces(0, 1, page_bytes=10, piece_bytes=20, last_extra=15) is None
    assert cut_pieces(0, 1, page_bytes=30, piece_bytes=20) is None


def test_a_peer_whose_hello_ack_has_no_credits_flag_is_read_as_one_that_takes_none():
    """A HelloAck as a peer without credits encodes it (no `credits` field) decodes with
    credits off, so such a peer gets the grant path."""
    codec = peer_codec(None)
    ack = HelloAck(src=1, dst=2, ok=True, staging=True, credits=True)
    fields = msgspec.msgpack.decode(codec.encode(ack)[0])
    del fields["credits"]
    payload = msgspec.msgpack.encode(fields)
    old = codec.decode([payload, sign(None, payload)])
    assert isinstance(old, HelloAck) and old.staging and old.credits is False


def test_a_grant_re_sent_after_a_later_one_is_taken_and_a_given_back_one_is_stale():
    """CreditGrant 1 is lost, 2 arrives, then 1 again (the ledger re-sends unused grants): 1 is
    new, not stale, else the ledger would wait for its return for ever."""
    purse = CreditPurse(epoch=5, ring_size=RING)
    assert purse.on_grant(credit=2, epoch=5, start=512, nbytes=256) == "ok"
    assert purse.on_grant(credit=1, epoch=5, start=0, nbytes=256) == "ok"
    purse.idle()
    for back in purse.returns():
        purse.on_ack(back.credit)
    assert purse.on_grant(credit=1, epoch=5, start=0, nbytes=256) == "stale"
    assert purse.on_grant(credit=2, epoch=5, start=512, nbytes=256) == "stale"
    assert purse.on_grant(credit=3, epoch=5, start=0, nbytes=256) == "ok"


def test_a_remainder_that_holds_the_last_page_carries_the_pool_block():
    """The request's state pool block rides with its last page: here that page falls in the
    remainder, so the decode room plans it in the granted piece and the prefill room writes it
    there; the credit pieces carry none."""
    aux = PoolSpec(name="aux", sharding="replicated", heads=0, dtypes=["uint8"], rows=[[16]])
    ring, ledger, purse, purses = world(credit_bytes=PAGE * 3)   # two 2-page pieces would be 4 pages
    d = DecodeRoom(room=7, session=SESSION, me=DEC.incarnation, layout=LAYOUT, now=0.0, timeouts=Timeouts(),
                   pools=(aux,))
    d.on_plan(plan(), 0.0)
    (meta,) = [a.msg for a in d.init(np.arange(10, 10 + N), 1.0, pool_items={"aux": np.array([5])})
               if isinstance(a, Send) and isinstance(a.msg, RoomMeta)]
    p = PrefillRoom(room=7, num_pages=N, layout=LAYOUT, me=PREF.incarnation, now=0.0, timeouts=Timeouts(),
                    op_ids=itertools.count(700), credits=purses, pools=(aux,), pool_items={"aux": np.array([3])})
    p.add_meta(DEC, 1, meta, 1.0)
    acts = p.add_chunk(np.arange(N), True, 2.0)
    credit_ops, (req,) = writes(acts), asks(acts)
    # cut: [0, 2) and [2, 3) into the credit (3 pages), [3, 4) with the pool block does not fit
    assert [(op.tag.page_start, op.tag.num_pages, op.pools) for op in credit_ops] == [(0, 2, ()), (2, 1, ())]
    assert (req.chunk, req.page_start, req.num_pages) == (REMAINDER, 3, 1)
    for op in credit_ops:
        assert land(d, ledger, ring, op).verdict is TagVerdict.OK
    (last,) = granted(d, p, ring, req)
    assert last.pools and last.nbytes == PAGE + sum(c.nbytes for c in last.pools)
    assert land_granted(d, ring, last).verdict is TagVerdict.OK and d.state is KVPoll.Success


def test_a_room_is_done_with_credits_once_its_last_send_was_issued_and_not_before():
    """`credits_done` lets the engine forget a room that will never again write staged chunks
    to a decode rank (its purse is asked after every write, and scanning the rooms in flight
    that only wait for their writes made that quadratic): never while a chunk may still come,
    and never while the prefix is unknown, when `wants_credits` is False only for a while."""
    _, _, _, purses = world()
    p = prefill(purses)
    assert not p.credits_done(DEC) and p.wants_credits(DEC)           # no last send yet
    acts = p.add_chunk(np.arange(2), False, 2.0)
    assert writes(acts) and not p.credits_done(DEC)                   # more pages may come
    acts = p.add_chunk(np.arange(2, N), True, 2.5)
    assert writes(acts) and p.credits_done(DEC) and not p.wants_credits(DEC)
    other = PeerKey("decode", 0, 2001)                                # a restarted decode rank
    assert not p.credits_done(other)


def test_a_room_waiting_for_a_decode_ranks_metadata_is_not_done_with_credits():
    """Two decode ranks, the last send in before the second one's metadata: nothing is issued
    yet and `wants_credits` reads False, but the chunks will go out once the metadata agrees."""
    dec1 = PeerKey("decode", 1, 2002)
    lay = KVLayout(num_layers=2, total_kv_heads=2, head_dim=4, dtype=torch.uint8, page_size=2, tp_size=1, tp_rank=0,
                   mla=False)
    _, _, _, purses = world()
    p = prefill(purses, layout=lay, decode_tp=2)
    acts = p.add_chunk(np.arange(N), True, 2.0)
    assert not writes(acts)
    assert not p.credits_done(DEC) and not p.wants_credits(DEC)
    p.add_meta(dec1, 2, RoomMeta(src=dec1.incarnation, dst=PREF.incarnation, room=7, session=SESSION, num_pages=N,
                                 staged=True), 3.0)
    assert p.credits_done(DEC)


def test_metadata_a_write_answers_needs_no_meta_ack_and_metadata_before_the_send_does():
    """prefill/room.py answers_meta: the shell sends a MetaAck only when the room's actions on the
    metadata tell the decode rank nothing (its write's WritePosted or tag is the acknowledgement)."""
    _, _, _, purses = world()
    p = PrefillRoom(room=7, num_pages=N, layout=LAYOUT, me=PREF.incarnation, now=0.0, timeouts=Timeouts(),
                    op_ids=itertools.count(700), credits=purses)
    p.add_chunk(np.arange(N), True, 0.5)     # the sender is ready before the decode rank's metadata
    meta = RoomMeta(src=DEC.incarnation, dst=PREF.incarnation, room=7, session=SESSION, num_pages=N, staged=True)
    acts = p.add_meta(DEC, 1, meta, 1.0)
    assert writes(acts) and answers_meta(acts, DEC)
    assert not answers_meta(acts, PeerKey("decode", 1, 2001))          # another decode rank heard nothing
    waiting = PrefillRoom(room=8, num_pages=N, layout=LAYOUT, me=PREF.incarnation, now=0.0, timeouts=Timeouts(),
                          op_ids=itertools.count(800), credits=purses)
    early = waiting.add_meta(DEC, 1, msgspec.structs.replace(meta, room=8), 1.0)   # nothing sent yet: no write
    assert not writes(early) and not answers_meta(early, DEC)
