"""The pure rules of ring credits (transfer/protocol/credits.py, decode/credits.py, prefill/credits.py), one
at a time; tests/unit/test_credit_sim.py runs them together over random interleavings."""

import pytest

from kvstage.transfer.protocol.credits import (
    ClaimVerdict,
    CreditState,
    GrantVerdict,
    WriteRef,
    check_credit_config,
    check_move,
    credit_target,
)
from kvstage.transfer.protocol.decode.credits import CreditLedger
from kvstage.transfer.protocol.messages import CreditAck, CreditGrant, CreditReturn, CreditWrite, peer_codec
from kvstage.transfer.protocol.prefill.credits import CreditPurse
from kvstage.transfer.protocol.ring import RingAllocator

KIB = 1024


def ledger(ring=64 * KIB, floor=KIB, ranks=2):
    led = CreditLedger(RingAllocator(ring, align=256), floor=floor)
    for p in range(ranks):
        led.connect(p)
    return led


def test_credits_go_where_requests_are():
    """64 connected ranks, 2 with requests: only those 2 hold credits, each at least a piece and
    at most its fair share of the ring; idle ranks hold nothing, and give back what they had."""
    led = ledger(ring=256 * KIB, ranks=64)
    led.add_demand(5, room=1, session=1, nbytes=1 << 20)
    led.add_demand(9, room=2, session=1, nbytes=300)   # a small request: one piece
    got = {i.peer: i for i in led.issue()}
    assert set(got) == {5, 9}
    assert got[5].nbytes == 256 * KIB // 4   # two busy ranks, two credits each at most
    assert got[9].nbytes == KIB              # its demand, raised to the floor (one piece)
    assert all(led.held_bytes(p) == 0 for p in range(64) if p not in (5, 9))
    led.end_room(2, 1)
    assert led.on_return(9, got[9].credit, []).ok
    assert led.held_bytes(9) == 0


def test_credit_sizes():
    assert credit_target(0, floor=KIB, cap=8 * KIB, align=256) == 0
    assert credit_target(10, floor=KIB, cap=8 * KIB, align=256) == KIB
    assert credit_target(5000, floor=KIB, cap=8 * KIB, align=256) == 5120
    assert credit_target(1 << 20, floor=KIB, cap=8 * KIB, align=256) == 8 * KIB
    assert credit_target(1 << 20, floor=KIB, cap=100, align=256) == KIB   # never below one piece


def test_a_ring_that_cannot_hold_one_piece_per_rank_is_refused_naming_the_options():
    with pytest.raises(ValueError, match="ring_mb.*staging_piece_mb"):
        check_credit_config(ring_bytes=4 * KIB, piece_bytes=KIB, prefill_ranks=5)
    led = ledger(ring=4 * KIB, ranks=4)
    with pytest.raises(ValueError, match="4 connected prefill ranks|5 connected prefill ranks"):
        led.connect(4)
    led.connect(3)   # a rank already connected: nothing changes


def test_a_waiting_rank_is_served_before_a_busy_rank_gets_more():
    """No rank starves another: ranks waiting for a credit are served in the order they began
    to wait, and before a busy rank's next credit; the first that does not fit holds the rest."""
    led = ledger(ring=4 * KIB, ranks=3)
    led.add_demand(0, room=1, session=1, nbytes=1 << 20)
    (a,) = led.issue()
    assert (a.peer, a.nbytes) == (0, 2 * KIB)          # alone: half the ring (two credits at most)
    used = led.claim(0, a.start, 2 * KIB, 1, 1).span
    (b,) = led.issue()                                 # used up: its next one, the rest of the ring
    assert (b.peer, b.nbytes) == (0, 2 * KIB)
    led.add_demand(2, room=3, session=1, nbytes=1 << 20)
    led.add_demand(1, room=2, session=1, nbytes=1 << 20)
    assert led.issue() == []                           # the ring is full: ranks 2 and 1 wait
    led.release(0, used)
    assert led.on_return(0, a.credit, [WriteRef(room=1, session=1, start=a.start, nbytes=2 * KIB)]).freed
    assert led.claim(0, b.start, 2 * KIB, 1, 1).verdict is ClaimVerdict.OK   # rank 0 would want its next
    got = led.issue()
    assert [(i.peer, i.nbytes) for i in got] == [(2, KIB), (1, KIB)]   # first come, first served; one piece each


def test_claims_check_every_write_against_the_credit_of_its_writer():
    led = ledger()
    led.add_demand(0, room=1, session=1, nbytes=4 * KIB)
    led.add_demand(1, room=2, session=1, nbytes=4 * KIB)
    c0, c1 = sorted(led.issue(), key=lambda i: i.peer)
    ok = led.claim(0, c0.start, 512, 1, 1)
    assert ok.verdict is ClaimVerdict.OK
    assert led.claim(0, c0.start, 512, 1, 1).verdict is ClaimVerdict.DUPLICATE
    assert led.claim(0, c0.start + 256, 512, 1, 1).verdict is ClaimVerdict.OVERLAP
    out = led.claim(0, c1.start, 512, 1, 1)   # inside rank 1's credit, not rank 0's
    assert out.verdict is ClaimVerdict.OUTSIDE and "not inside a credit" in out.reason
    assert led.claim(0, c0.start + c0.nbytes - 256, 512, 1, 1).verdict is ClaimVerdict.OUTSIDE   # runs past it
    assert led.claim(1, c1.start, 512, 2, 1).verdict is ClaimVerdict.OK   # the other rank is untouched
    # returned without naming a write: a tag of it arriving later is too late
    assert led.on_return(0, c0.credit, [WriteRef(room=1, session=1, start=c0.start, nbytes=512)]).ok
    assert led.claim(0, c0.start + 512, 256, 1, 1).verdict is ClaimVerdict.TOO_LATE


def test_a_returned_credit_waits_for_the_scatters_and_the_tags_it_named():
    led = ledger()
    led.add_demand(0, room=1, session=1, nbytes=4 * KIB)
    (c,) = led.issue()
    first = led.claim(0, c.start, 512, 1, 1).span
    named = [WriteRef(room=1, session=1, start=c.start, nbytes=512),
             WriteRef(room=1, session=1, start=c.start + 512, nbytes=256)]
    assert led.on_return(0, c.credit, named).ok
    assert led.ring.live_regions == 1
    led.release(0, first)
    assert led.ring.live_regions == 1            # the second write's tag has not come
    late = led.claim(0, c.start + 512, 256, 1, 1)
    assert late.verdict is ClaimVerdict.OK
    assert led.release(0, late.span) and led.ring.live_regions == 0
    assert led.on_return(0, c.credit, named).ok  # a repeated return: acknowledged again


def test_a_returned_credit_stops_waiting_for_a_tag_once_its_room_ended():
    """An aborted request (or a reused room id: another session) never sends that tag."""
    led = ledger()
    led.add_demand(0, room=1, session=1, nbytes=4 * KIB)
    (c,) = led.issue()
    assert led.on_return(0, c.credit, [WriteRef(room=1, session=1, start=c.start, nbytes=512)]).ok
    assert led.ring.live_regions == 1
    led.add_demand(0, room=1, session=2, nbytes=512)   # the id's next use
    assert led.end_room(1, 1) and led.ring.live_regions == 0


def test_a_return_that_does_not_match_the_credit_fails_its_rooms_and_keeps_the_region():
    led = ledger()
    led.add_demand(0, room=1, session=1, nbytes=4 * KIB)
    led.add_demand(0, room=3, session=1, nbytes=4 * KIB)
    (c,) = led.issue()
    first = led.claim(0, c.start, 512, 1, 1).span
    assert first is not None
    bad = led.on_return(0, c.credit, [WriteRef(room=3, session=1, start=c.start + c.nbytes, nbytes=512)])
    assert not bad.ok and "outside" in bad.reason and bad.rooms == {(1, 1), (3, 1)}
    assert led.claim(0, c.start + 512, 256, 3, 1).verdict is ClaimVerdict.OUTSIDE   # poisoned: no more writes
    assert led.ring.live_regions == 1 and not [i for i in led.issue() if i.credit == c.credit]
    led.release(0, first)                                   # its accepted write: dropped
    assert led.ring.live_regions == 1                       # the peer may still write there
    assert led.peer_lost(0) and led.ring.live_regions == 0  # lost (after its quarantine): freed


def test_a_lost_rank_gives_back_every_credit_once_its_scatters_end():
    led = ledger()
    led.add_demand(0, room=1, session=1, nbytes=4 * KIB)
    led.add_demand(1, room=2, session=1, nbytes=4 * KIB)
    got = {i.peer: i for i in led.issue()}
    span = led.claim(0, got[0].start, 512, 1, 1).span
    led.peer_lost(0)
    assert led.credits_of(0) == [] and led.ring.live_regions == 2   # the write being scattered holds its credit
    led.release(0, span)
    assert led.ring.live_regions == 1 and led.credits_of(1)


def test_credit_states_move_forward_only():
    assert check_move(CreditState.OPEN, CreditState.RETURNED) is CreditState.RETURNED
    with pytest.raises(ValueError):
        check_move(CreditState.CLOSED, CreditState.OPEN)
    with pytest.raises(ValueError):
        check_move(CreditState.RETURNED, CreditState.OPEN)


def test_the_purse_checks_every_grant_against_the_ring():
    p = CreditPurse(epoch=7, ring_size=4 * KIB)
    assert p.on_grant(credit=1, epoch=7, start=0, nbytes=KIB) is GrantVerdict.OK
    assert p.on_grant(credit=1, epoch=7, start=0, nbytes=KIB) is GrantVerdict.DUPLICATE
    assert p.on_grant(credit=1, epoch=7, start=256, nbytes=KIB) is GrantVerdict.MISMATCH
    assert p.on_grant(credit=2, epoch=6, start=KIB, nbytes=KIB) is GrantVerdict.STALE
    assert p.on_grant(credit=2, epoch=7, start=512, nbytes=KIB) is GrantVerdict.MISMATCH   # overlaps credit 1
    assert p.on_grant(credit=2, epoch=7, start=3 * KIB + 512, nbytes=KIB) is GrantVerdict.MISMATCH   # wraps
    assert p.on_grant(credit=2, epoch=7, start=-KIB, nbytes=KIB) is GrantVerdict.MISMATCH
    assert p.on_grant(credit=2, epoch=7, start=KIB, nbytes=0) is GrantVerdict.MISMATCH
    assert p.on_grant(credit=2, epoch=7, start=2 * KIB, nbytes=KIB) is GrantVerdict.OK


def test_the_purse_cuts_writes_in_order_and_gives_credits_back_when_used_up_or_idle():
    p = CreditPurse(epoch=7, ring_size=16 * KIB)
    assert p.on_grant(credit=1, epoch=7, start=0, nbytes=KIB) is GrantVerdict.OK
    a = p.take(512, room=1, session=1)
    b = p.take(256, room=1, session=1)
    assert (a.start, b.start) == (0, 512) and a.credit == b.credit == 1
    assert p.take(512, room=2, session=1) is None     # does not fit: the grant path; credit 1 retired
    assert p.returns() == []                          # writes into it are in flight
    p.done(a, ok=True)
    p.done(b, ok=False)                               # failed: not named
    (g,) = p.returns()
    assert g.credit == 1 and [w.start for w in g.writes] == [0]
    assert p.returns() == [g]                         # re-sent until acknowledged
    p.on_ack(1)
    assert p.returns() == [] and p.free_bytes == 0
    assert p.on_grant(credit=1, epoch=7, start=0, nbytes=KIB) is GrantVerdict.STALE   # a late copy
    assert p.on_grant(credit=2, epoch=7, start=KIB, nbytes=2 * KIB) is GrantVerdict.OK
    p.idle()
    assert [g.credit for g in p.returns()] == [2] and p.take(64, room=3, session=1) is None


def test_credit_messages_round_trip_on_the_wire():
    codec = peer_codec(b"token")
    for msg in (CreditGrant(src=1, dst=2, epoch=3, credit=4, start=5, nbytes=6, wm_round=7, wm_tail=8),
                CreditReturn(src=1, dst=2, epoch=3, credit=4, writes=[CreditWrite(1, 2, 3, 4)]),
                CreditAck(src=1, dst=2, epoch=3, credit=4)):
        assert codec.decode(codec.encode(msg)) == msg


def test_why_pieces_of_several_writers_keep_the_grant_path():
    """Two prefill ranks that both write a part of pieces X and Y (heterogeneous TP), each from
    its own credit, in different orders, in a ring of one part per rank: rank 0 holds X's part,
    rank 1 holds Y's, each waits for the other's part of its piece, and neither has space for it.
    No credit can be issued and a grant would be reserved behind both: a wait cycle. A grant
    reserves every part of a piece at once, so pieces of several writers stay on that path."""
    led = ledger(ring=2 * KIB, ranks=2)
    purses = [CreditPurse(epoch=7, ring_size=2 * KIB) for _ in range(2)]
    led.add_demand(0, room=1, session=1, nbytes=2 * KIB)   # X and Y: one part each of either rank
    led.add_demand(1, room=1, session=1, nbytes=2 * KIB)
    for i in led.issue():
        assert purses[i.peer].on_grant(credit=i.credit, epoch=7, start=i.start, nbytes=i.nbytes) is GrantVerdict.OK
    x0 = purses[0].take(KIB, room=1, session=1)   # rank 0 gathered X first
    y1 = purses[1].take(KIB, room=1, session=1)   # rank 1 gathered Y first
    assert led.claim(0, x0.start, KIB, 1, 1).verdict is ClaimVerdict.OK
    assert led.claim(1, y1.start, KIB, 1, 1).verdict is ClaimVerdict.OK
    # neither piece is whole, so neither part can be scattered and released
    assert purses[0].take(KIB, room=1, session=1) is None and purses[1].take(KIB, room=1, session=1) is None
    assert led.issue() == [] and not led.ring.fits_now(KIB)
    grant = led.ring.allocate(KIB)   # the fallback's region: behind both credits, not writable
    assert not led.ring.is_free(grant)


def test_the_credit_messages_leave_every_other_message_as_it_was_on_the_wire():
    """A build without the credit messages reads what this one sends of its own messages, and
    refuses a credit message as malformed (so credits go only to peers that take them)."""
    from kvstage.transfer.protocol.messages import PEER_MESSAGES, AllocGrant, Piece, WatermarkUpdate
    from kvstage.wire import WIRE_VERSION, Codec, WireError

    old = Codec([m for m in PEER_MESSAGES if not m.__name__.startswith("Credit")], b"t")
    new = peer_codec(b"t")
    v = f"a176{WIRE_VERSION:02x}"   # "v": the wire version (2 at 3440479; the path choice's HelloAck made it 3)
    before = [   # their payloads as the build before credits encoded them (commit 3440479), but for "v"
        (AllocGrant(src=1, dst=2, room=3, session=4, chunk=5, epoch=6, pieces=[Piece(0, 1, 2, 3, 4)]),
            "89a174aa416c6c6f634772616e74" + v + "a373726301a364737402a4726f6f6d03a773657373696f6e04a56368756e6b05a565"
            "706f636806a670696563657391950001020304"),
        (WatermarkUpdate(src=1, dst=2, epoch=3, round=4, tail=5),
            "87a174af57617465726d61726b557064617465" + v + "a373726301a364737402a565706f636803a5726f756e6404a47461696c05"),
    ]
    for msg, payload in before:
        assert new.encode(msg)[0].hex() == payload and old.decode(new.encode(msg)) == msg
    with pytest.raises(WireError, match="malformed"):
        old.decode(new.encode(CreditAck(src=1, dst=2, epoch=3, credit=4)))
