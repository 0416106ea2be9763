"""Decode context parallel in the engine's pure parts: a rank's DCP declared in its KVLayout,
carried in its Hello (wire version 6), checked at admission, and judged per request by the
prefill room, which fails a pairing the engine cannot move on both sides with the reason naming
both layouts (token_mapping.engine_refusal) and writes a served one's tokens (1 -> N, N -> N) in
one direct write per decode rank, which the decode room expects to the byte."""

from __future__ import annotations

import itertools

import msgspec
import numpy as np
import pytest
import torch

from kvstage.transfer.config import Timeouts
from kvstage.transfer.layout import KVLayout
from kvstage.transfer.poll import KVPoll
from kvstage.transfer.pool_spec import PoolSpec
from kvstage.transfer.protocol.actions import PeerKey, PostWrite, Send
from kvstage.transfer.protocol.hello_admission import PrefillFacts, admit_hello
from kvstage.transfer.protocol.messages import Hello, KVMemory, RoomMeta, peer_codec
from kvstage.transfer.protocol.prefill.chunk_writes import WriteLimits
from kvstage.transfer.protocol.prefill.room import PrefillRoom
from kvstage.transfer.protocol.token_mapping import DCPLayout, check_dcp_rank, engine_refusal
from kvstage.wire import WIRE_VERSION


def mla(tp: int = 2, rank: int = 0, dcp: int = 1, **kw) -> KVLayout:
    return KVLayout(num_layers=2, total_kv_heads=1, head_dim=8, dtype=torch.uint8, page_size=2, tp_size=tp,
                    tp_rank=rank, mla=True, dcp_size=dcp, **kw)


# -- the layout ------------------------------------------------------------------------------------

def test_a_dcp_rank_is_its_tp_rank_modulo_the_dcp_size():
    assert [mla(tp=4, rank=r, dcp=2).dcp_rank for r in range(4)] == [0, 1, 0, 1]
    assert mla(tp=4, rank=3, dcp=4).dcp() == DCPLayout(dcp_size=4, page_size=2, mla=True)
    assert mla(tp=2, rank=1).dcp_rank == 0   # no DCP: every rank holds every token


@pytest.mark.parametrize(("kw", "words"), [
    ({"dcp": 0}, "dcp_size must be positive"),
    ({"tp": 4, "dcp": 3}, "dcp_size=3 must divide tp_size=4"),
])
def test_an_impossible_dcp_layout_is_named(kw, words):
    with pytest.raises(ValueError, match=words):
        mla(**kw)
    assert mla(dcp=2, pp_size=2, stage=range(0, 1)).dcp_size == 2   # beside PP: each stage its layers


def test_dcp_is_refused_beside_gqa():
    with pytest.raises(ValueError, match="MLA only"):
        KVLayout(num_layers=2, total_kv_heads=2, head_dim=8, dtype=torch.uint8, page_size=2, tp_size=2, tp_rank=0,
                 dcp_size=2)


# -- the Hello and its admission -------------------------------------------------------------------

def hello(**kw) -> Hello:
    lay = mla()
    kv = KVMemory(k_addrs=[1, 2], v_addrs=[], num_pages=10, page_stride=16, token_stride=8)
    base = dict(src=7, engine_id="d", role="decode", tp_size=2, tp_rank=1, ctrl_endpoint="tcp://h:1", backend="nixl",
                backend_identity=b"md", layout=lay.summary(), kv=kv)
    return Hello(**(base | kw))


def facts() -> PrefillFacts:
    return PrefillFacts(summary=mla().summary(), tp_size=1, total_kv_heads=1, mla=True, num_layers=2, stage=range(2),
                        verify=False, backend="nixl", memory_kinds=("DRAM",))


def test_the_hello_carries_the_dcp_group_and_round_trips():
    codec = peer_codec(None)
    msg = codec.decode(codec.encode(hello(dcp_size=2, dcp_rank=1)))
    assert (msg.dcp_size, msg.dcp_rank, msg.v) == (2, 1, WIRE_VERSION)
    old = msgspec.msgpack.decode(codec.encode(hello())[0])
    assert (old["dcp_size"], old["dcp_rank"]) == (1, 0)   # no DCP: the defaults


def test_a_well_formed_dcp_hello_is_admitted_and_a_malformed_one_is_named():
    assert admit_hello(hello(dcp_size=2, dcp_rank=1), facts()).ok
    adm = admit_hello(hello(dcp_size=2, dcp_rank=0), facts())
    assert adm.problems == ("decode context parallel: dcp_rank 0 of TP rank 1 must be tp_rank % dcp_size = 1",)
    assert "must be >= 1 and divide tp_size 2" in admit_hello(hello(dcp_size=4, dcp_rank=1), facts()).problems[0]
    assert check_dcp_rank(1, 0, 3, 2) is None


# -- the engine's verdict per pairing --------------------------------------------------------------

def lay(n: int, is_mla: bool = True, page_size: int = 2) -> DCPLayout:
    return DCPLayout(dcp_size=n, page_size=page_size, mla=is_mla)


def test_the_engine_moves_the_served_pairings_and_names_both_layouts_otherwise():
    for p, d in ((1, 1), (1, 2), (2, 2), (1, 4)):
        assert engine_refusal(lay(p), lay(d)) is None
    assert engine_refusal(lay(1, is_mla=False), lay(1, is_mla=False)) is None
    both = "prefill DCP 2 (page_size 2, MLA) -> decode DCP 4 (page_size 2, MLA)"
    assert engine_refusal(lay(2), lay(4)) == f"{both}: DCP 2 -> 4 is not served (prefill DCP must be 1 or equal the decode's)"
    assert "DCP on the prefill side only is not served" in (engine_refusal(lay(2), lay(1)) or "")
    assert "page sizes differ" in (engine_refusal(lay(1), lay(2, page_size=4)) or "")


# -- the prefill room ------------------------------------------------------------------------------

def room(layout: KVLayout) -> PrefillRoom:
    return PrefillRoom(room=7, num_pages=2, layout=layout, me=1000, now=0.0, timeouts=Timeouts(metadata=50),
                       op_ids=itertools.count(1))


def meta(peer: PeerKey) -> RoomMeta:
    return RoomMeta(src=peer.incarnation, dst=1000, room=7, session=peer.incarnation, num_pages=2, staged=False,
                    dst_pages=np.arange(2, dtype="<i8").tobytes())


@pytest.mark.parametrize(("prefill_dcp", "decode_dcp", "words"), [
    (2, 4, "DCP 2 -> 4 is not served"),
    (2, 1, "DCP on the prefill side only is not served"),
])
def test_a_pairing_the_engine_cannot_move_fails_the_room_on_both_sides_with_the_reason(prefill_dcp, decode_dcp, words):
    r = room(mla(tp=2, rank=0, dcp=prefill_dcp))
    r.add_chunk(np.arange(2), True, 0.5)
    d0 = PeerKey("dec", 0, 2000)
    acts = r.add_meta(d0, 4, meta(d0), 1.0, dcp=lay(decode_dcp))
    assert r.state is KVPoll.Failed and words in r.failure
    assert f"prefill DCP {prefill_dcp} (page_size 2, MLA) -> decode DCP {decode_dcp} (page_size 2, MLA)" in r.failure
    assert not [a for a in acts if isinstance(a, PostWrite)]
    told = [(a.peer, type(a.msg).__name__, getattr(a.msg, "reason", "")) for a in acts if isinstance(a, Send)]
    assert (d0, "RoomFailed", r.failure) in told and (d0, "Quiesced", "") in told


def test_without_dcp_the_room_writes_as_before():
    r = room(mla(tp=1, rank=0))
    r.add_chunk(np.arange(2), True, 0.5)
    d0 = PeerKey("dec", 0, 2000)
    acts = r.add_meta(d0, 1, meta(d0), 1.0, dcp=lay(1))
    assert r.state is not KVPoll.Failed and [a for a in acts if isinstance(a, PostWrite)]


# -- the direct path's pure parts: one pair's runs, their descriptor rows, a rank's share ----------

def test_one_pair_from_its_own_page_lists_is_the_whole_mappings_flow():
    from kvstage.transfer.protocol.token_mapping import build_pair, build_token_mapping

    pre, dec = lay(1, page_size=4), lay(2, page_size=4)
    whole = build_token_mapping(prefill=pre, decode=dec, num_tokens=37, prefix=8, prefill_pages=((9, 3, 4, 5, 1, 7, 8, 10),),
                                decode_pages=((2, 6, 0, 13), (11, 4, 5, 12)))
    for d, dst in enumerate(((2, 6, 0, 13), (11, 4, 5, 12))):
        one = build_pair(prefill=pre, decode=dec, num_tokens=37, prefix=8, src_pages=(9, 3, 4, 5, 1, 7, 8, 10),
                         dst_pages=dst, decode_rank=d)
        ref = whole.for_decode(d)
        assert one.runs() == ref.runs() and one.piece == ref.piece and one.piece_runs == ref.piece_runs


def test_a_ranks_share_of_tokens_and_pages():
    from kvstage.transfer.protocol.token_mapping import local_pages, local_tokens

    dec = lay(2, page_size=4)
    assert [local_tokens(dec, d, 37, 8) for d in range(2)] == [15, 14]   # tokens 8..36: even 8..36, odd 9..35
    assert local_pages(dec, 37) == 5 and local_pages(dec, 40) == 5 and local_pages(dec, 41) == 6


@pytest.mark.parametrize(("num_tokens", "prefix"), [(37, 8), (1, 0), (16, 0), (17, 16)])
def test_token_rows_copy_each_token_to_its_rank_and_slot_and_touch_nothing_else(num_tokens, prefix):
    """Prefill DCP 1 -> decode DCP 2, page size 4, one MLA layer of 3 bytes a token: the rows
    copied byte for byte put token t at decode rank t % 2, local slot t // 2, and leave every
    other byte (the prefix, the final partial page's tail, other pages) as it was."""
    from kvstage.transfer.protocol.direct_ranges import CacheGeometry, token_rows
    from kvstage.transfer.protocol.token_mapping import build_pair, local_pages

    ps, tb, n = 4, 3, 2
    pre, dec = lay(1, page_size=ps), lay(n, page_size=ps)
    rng = np.random.default_rng(num_tokens)
    src_pages = tuple(int(x) for x in rng.permutation(20)[: -(-(num_tokens - prefix) // ps)])
    src = rng.integers(1, 255, size=20 * ps * tb, dtype=np.uint8)
    src_tok = {}   # global token -> its bytes in the prefill cache
    for t in range(prefix, num_tokens):
        slot = src_pages[(t - prefix) // ps] * ps + (t - prefix) % ps
        src_tok[t] = src[slot * tb:(slot + 1) * tb]
    geo = CacheGeometry(bases=(0,), page_size=ps, token_stride=tb, head_bytes=tb)
    need = local_pages(dec, num_tokens) - prefix // (ps * n)
    for d in range(n):
        dst_pages = tuple(int(x) for x in rng.permutation(20)[:need])
        before = np.zeros(20 * ps * tb, dtype=np.uint8)
        dst = before.copy()
        pair = build_pair(prefill=pre, decode=dec, num_tokens=num_tokens, prefix=prefix, src_pages=src_pages,
                          dst_pages=dst_pages, decode_rank=d)
        rows = token_rows(geo, geo, pair.src_slot, pair.dst_slot, pair.length)
        for s_off, d_off, length in zip(rows.src_off, rows.dst_off, rows.lengths, strict=True):
            dst[int(d_off):int(d_off + length)] = src[int(s_off):int(s_off + length)]
        want = before.copy()
        for t in range(prefix + (d - prefix) % n, num_tokens, n):
            local = t // n - prefix // n
            slot = dst_pages[local // ps] * ps + local % ps
            want[slot * tb:(slot + 1) * tb] = src_tok[t]
        assert np.array_equal(dst, want), d


# -- the rooms on the direct path ------------------------------------------------------------------

def dcp_meta(peer: PeerKey, pages: list[int], prefix: int = 0) -> RoomMeta:
    return RoomMeta(src=peer.incarnation, dst=1000, room=7, session=peer.incarnation, num_pages=prefix + len(pages),
                    staged=False, dst_pages=np.asarray(pages, dtype="<i8").tobytes(), prefix_pages=prefix)


def test_a_prefill_room_writes_each_decode_dcp_rank_its_tokens_in_one_exact_write():
    """7 tokens (pages of 2) from prefill DCP 1 -> decode DCP 2: rank 0 gets tokens 0, 2, 4, 6,
    rank 1 tokens 1, 3, 5, each token from its prefill slot to its local slot, once the last
    send is in; 16 bytes a token (2 layers of one 8-byte latent)."""
    r = PrefillRoom(room=7, num_pages=4, layout=mla(tp=1), me=1000, now=0.0, timeouts=Timeouts(metadata=50),
                    op_ids=itertools.count(1), num_tokens=7)
    d0, d1 = PeerKey("dec", 0, 2000), PeerKey("dec", 1, 2001)
    assert not [a for a in r.add_meta(d0, 2, dcp_meta(d0, [3, 4]), 1.0, dcp=lay(2)) if isinstance(a, PostWrite)]
    r.add_meta(d1, 2, dcp_meta(d1, [5, 9]), 1.0, dcp=lay(2))
    assert not [a for a in r.add_chunk(np.array([10, 11]), False, 1.5) if isinstance(a, PostWrite)]
    ops = {a.op.peer.tp_rank: a.op for a in r.add_chunk(np.array([12, 13]), True, 2.0) if isinstance(a, PostWrite)}
    assert sorted(ops) == [0, 1] and r.state is not KVPoll.Failed
    runs = {d: [tuple(int(x) for x in arr) for arr in op.token_runs] for d, op in ops.items()}
    assert runs[0] == [(20, 22, 24, 26), (6, 7, 8, 9), (1, 1, 1, 1)]   # slots 20.. of pages 10-13 -> pages 3, 4
    assert runs[1] == [(21, 23, 25), (10, 11, 18), (1, 1, 1)]          # -> pages 5 (slots 10, 11) and 9 (18)
    assert (ops[0].nbytes, ops[1].nbytes) == (64, 48)
    assert (ops[1].tag.page_start, ops[1].tag.num_pages, ops[1].tag.nbytes) == (0, 2, 48)


def test_a_decode_prefix_is_in_local_pages_and_a_rank_owning_no_token_gets_no_write():
    """17 tokens with a decode prefix of one local page (8 tokens of page size 2 x DCP 4): the
    prefill skips its first 4 pages; tokens 8..16 go to ranks 0..3 and rank 0 gets 8, 12, 16."""
    r = PrefillRoom(room=7, num_pages=9, layout=mla(tp=1), me=1000, now=0.0, timeouts=Timeouts(metadata=50),
                    op_ids=itertools.count(1), num_tokens=17)
    peers = [PeerKey("dec", d, 2000 + d) for d in range(4)]
    for d, p in enumerate(peers):
        r.add_meta(p, 4, dcp_meta(p, [40 + 2 * d, 41 + 2 * d], prefix=1), 1.0, dcp=lay(4))
    assert r.prefix == 4
    ops = {a.op.peer.tp_rank: a.op for a in r.add_chunk(np.arange(100, 109), True, 2.0) if isinstance(a, PostWrite)}
    assert {d: int(op.token_runs[2].sum()) for d, op in ops.items()} == {0: 3, 1: 2, 2: 2, 3: 2}
    assert [int(x) for x in ops[0].token_runs[0]] == [208, 212, 216]   # tokens 8, 12, 16: prefill pages 104, 106, 108
    assert [int(x) for x in ops[0].token_runs[1]] == [80, 81, 82]       # local slots 0-2 past the prefix: pages 40, 41

    one = PrefillRoom(room=7, num_pages=1, layout=mla(tp=1), me=1000, now=0.0, timeouts=Timeouts(metadata=50),
                      op_ids=itertools.count(1), num_tokens=1)
    for d, p in enumerate(peers[:2]):
        one.add_meta(p, 2, dcp_meta(p, [d]), 1.0, dcp=lay(2))
    ops = [a.op for a in one.add_chunk(np.array([5]), True, 2.0) if isinstance(a, PostWrite)]
    assert [op.peer.tp_rank for op in ops] == [0]   # token 0 only: rank 1 owns none


def test_equal_dcp_writes_each_rank_its_own_local_slots():
    """Prefill TP 2 DCP 2 -> decode TP 2 DCP 2: prefill rank 1 writes decode rank 1 its local
    slots one for one (9 tokens: rank 1 holds 1, 3, 5, 7 in 2 pages)."""
    r = PrefillRoom(room=7, num_pages=3, layout=mla(tp=2, rank=1, dcp=2), me=1000, now=0.0,
                    timeouts=Timeouts(metadata=50), op_ids=itertools.count(1), num_tokens=9)
    d1 = PeerKey("dec", 1, 2001)
    r.add_meta(d1, 2, dcp_meta(d1, [6, 2, 8]), 1.0, dcp=lay(2))
    ops = [a.op for a in r.add_chunk(np.array([4, 5, 7]), True, 2.0) if isinstance(a, PostWrite)]
    assert len(ops) == 1 and [[int(x) for x in arr] for arr in ops[0].token_runs] == [[8, 10], [12, 4], [2, 2]]
    assert ops[0].nbytes == 4 * 16


def test_the_request_token_count_and_page_counts_must_agree_or_the_room_fails_with_both_layouts():
    r = PrefillRoom(room=7, num_pages=4, layout=mla(tp=1), me=1000, now=0.0, timeouts=Timeouts(metadata=50),
                    op_ids=itertools.count(1))
    d0 = PeerKey("dec", 0, 2000)
    r.add_meta(d0, 2, dcp_meta(d0, [3, 4]), 1.0, dcp=lay(2))
    assert r.state is KVPoll.Failed and "needs the request's token count on the prefill side" in r.failure
    r = PrefillRoom(room=7, num_pages=4, layout=mla(tp=1), me=1000, now=0.0, timeouts=Timeouts(metadata=50),
                    op_ids=itertools.count(1), num_tokens=9)
    r.add_meta(d0, 2, dcp_meta(d0, [3, 4]), 1.0, dcp=lay(2))
    assert r.state is KVPoll.Failed and "9 tokens take 5 pages on this prefill rank, it was given 4" in r.failure
    assert "prefill DCP 1 (page_size 2, MLA) -> decode DCP 2 (page_size 2, MLA)" in r.failure


def test_a_dcp_tracker_takes_one_write_of_exactly_its_tokens():
    from kvstage.transfer.protocol.decode.tracker import Outcome, RoomTracker

    t = RoomTracker(2, {0: 64}, num_layers=2, token_bytes={0: 48})   # 3 tokens of 16 bytes in 2 pages of 2
    assert t.arrive_direct(0, 0, 0, 2, 64, layers=range(2)).outcome is Outcome.REJECTED   # whole pages: no
    assert t.arrive_direct(0, 0, 0, 1, 32, layers=range(2)).outcome is Outcome.REJECTED   # a part: no
    assert not t.complete
    assert t.arrive_direct(0, 0, 0, 2, 48, layers=range(2)).outcome is Outcome.ACCEPTED and t.complete
    assert RoomTracker(1, {0: 32}, num_layers=2, token_bytes={0: 0}).complete   # owns no token: nothing to wait for


def test_a_dcp_tracker_beside_pp_takes_each_stages_layers_of_its_tokens():
    """Two writers, a PP stage each (layers [0, 1) and [1, 2)): each writes its layer of this
    rank's tokens, counted over the room's every layer; a decode PP stage holding layer 1 only
    expects that layer's share; a stage owning none of the tokens and no pool item writes nothing."""
    from kvstage.transfer.protocol.decode.tracker import Outcome, RoomTracker

    t = RoomTracker(2, {0: 64, 1: 64}, num_layers=2, token_bytes={0: 48, 1: 48},
                    writer_layers={0: range(0, 1), 1: range(1, 2)})
    assert t.arrive_direct(0, 0, 0, 2, 48, layers=range(0, 1)).outcome is Outcome.REJECTED   # both layers' bytes
    assert t.arrive_direct(0, 0, 0, 2, 24, layers=range(0, 1)).outcome is Outcome.ACCEPTED and not t.complete
    assert t.arrive_direct(1, 0, 0, 2, 24, layers=range(1, 2)).outcome is Outcome.ACCEPTED and t.complete
    held = RoomTracker(2, {1: 64}, num_layers=2, token_bytes={1: 48}, writer_layers={1: range(1, 2)},
                       held=range(1, 2))
    assert held.arrive_direct(1, 0, 0, 2, 24, layers=range(1, 2)).outcome is Outcome.ACCEPTED and held.complete
    # the first stage owns none of the tokens and carries no pool item: only the second's write (its aux) counts
    aux = RoomTracker(1, {0: 32, 1: 32}, {1: 8}, num_layers=2, token_bytes={0: 0, 1: 0},
                      writer_layers={0: range(0, 1), 1: range(1, 2)})
    assert not aux.complete
    assert aux.arrive_direct(1, 0, 0, 1, 8, layers=range(1, 2)).outcome is Outcome.ACCEPTED and aux.complete


def dcp_decode_room(rank: int = 1, pools: tuple[PoolSpec, ...] = ()):
    from kvstage.transfer.protocol.decode.plan import RoomPlan
    from kvstage.transfer.protocol.decode.room import DecodeRoom
    from kvstage.transfer.protocol.head_mapping import compute_assignments

    lay = mla(tp=2, rank=rank, dcp=2)
    a = compute_assignments(1, 2, 1, True).find(0, rank)
    plan = RoomPlan(writers=((PeerKey("pre", 0, 900), a),), notices=(), staged=False,
                    head_page_bytes=lay.num_kv * lay.num_layers * lay.page_size * lay.head_bytes)
    room = DecodeRoom(room=7, session=55, me=2001, layout=lay, now=0.0, timeouts=Timeouts(metadata=50), pools=pools)
    room.on_plan(plan, 0.0)
    return room


def test_a_decode_dcp_room_expects_its_own_tokens_to_the_byte():
    """Decode DCP rank 1 of 2, pages of 2, 9 tokens past a prefix of one local page (4 tokens):
    tokens 5 and 7 are its, 16 bytes each; its RoomMeta names its local pages."""
    r = dcp_decode_room()
    acts = r.init(np.array([6, 8]), 1.0, prefix_pages=1, num_tokens=9)
    assert r.state is not KVPoll.Failed and r.tracker.token_bytes == {0: 32}
    metas = [a.msg for a in acts if isinstance(a, Send) and type(a.msg).__name__ == "RoomMeta"]
    assert [(m.num_pages, m.prefix_pages, m.pages().tolist()) for m in metas] == [(3, 1, [6, 8])]


@pytest.mark.parametrize(("pages", "prefix", "tokens", "words"), [
    ([6, 8], 0, None, "needs the request's token count (init(num_tokens=...))"),
    ([6], 0, 9, "9 tokens take 3 pages on every DCP rank, this rank was given 0 prefix pages and 1 more"),
])
def test_a_decode_dcp_room_without_its_token_count_or_with_the_wrong_pages_fails_naming_why(pages, prefix, tokens,
                                                                                             words):
    r = dcp_decode_room()
    r.init(np.array(pages), 1.0, prefix_pages=prefix, num_tokens=tokens)
    assert r.state is KVPoll.Failed and words in r.failure and "decode DCP rank 1 of 2" in r.failure


def test_a_decode_room_failing_before_its_metadata_tells_its_prefill_ranks_and_their_sender_fails():
    """A decode room that fails at init (here: no token count under DCP), before any RoomMeta
    went out, still tells every prefill rank of its plan; a sender there that waits for the
    room's metadata fails with the decode's reason instead of waiting for it."""
    r = dcp_decode_room()
    acts = r.init(np.array([6, 8]), 1.0, prefix_pages=0, num_tokens=None)
    assert r.state is KVPoll.Failed
    told = [a for a in acts if isinstance(a, Send) and type(a.msg).__name__ == "RoomFailed"]
    assert [(a.peer, a.msg.room, a.msg.session) for a in told] == [(PeerKey("pre", 0, 900), 7, 55)]
    sender = PrefillRoom(room=7, num_pages=3, layout=mla(tp=1), me=900, now=0.0, timeouts=Timeouts(metadata=50),
                         op_ids=itertools.count(1), num_tokens=9)
    m = told[0].msg
    sender.on_room_failed(PeerKey("dec", 1, 2001), m.session, m.kind, m.reason, 2.0)
    assert sender.state is KVPoll.Failed and "token count" in sender.failure


def test_a_decode_room_aborted_before_init_tells_its_prefill_ranks():
    r = dcp_decode_room()
    acts = r.abort(None, 1.0)
    assert r.state is KVPoll.Failed
    assert [a.peer for a in acts if isinstance(a, Send) and type(a.msg).__name__ == "RoomFailed"] == \
        [PeerKey("pre", 0, 900)]


def test_a_decode_dcp_rank_owning_none_of_the_tokens_succeeds_once_its_metadata_is_out():
    r = dcp_decode_room(rank=1)
    r.init(np.array([3]), 1.0, num_tokens=1)
    assert r.state is KVPoll.Success


def test_a_dcp_write_over_the_descriptor_cap_goes_in_layer_groups_the_tracker_adds_up():
    from kvstage.transfer.protocol.decode.tracker import Outcome, RoomTracker

    r = PrefillRoom(room=7, num_pages=4, layout=mla(tp=1), me=1000, now=0.0, timeouts=Timeouts(metadata=50),
                    op_ids=itertools.count(1), num_tokens=7, limits=WriteLimits(max_ranges=4))   # 4 runs a layer: one layer a write
    d0, d1 = PeerKey("dec", 0, 2000), PeerKey("dec", 1, 2001)
    r.add_meta(d0, 2, dcp_meta(d0, [3, 4]), 1.0, dcp=lay(2))
    r.add_meta(d1, 2, dcp_meta(d1, [5, 9]), 1.0, dcp=lay(2))
    ops = [a.op for a in r.add_chunk(np.arange(10, 14), True, 2.0) if isinstance(a, PostWrite) and a.op.peer == d0]
    assert [(op.layers, op.chunk, op.nbytes) for op in ops] == [(range(0, 1), 0, 32), (range(1, 2), 1, 32)]
    t = RoomTracker(2, {0: 64}, num_layers=2, token_bytes={0: 64})
    for op in ops:
        assert t.arrive_direct(0, op.chunk, 0, 2, op.nbytes, layers=op.layers).outcome is Outcome.ACCEPTED
    assert t.complete


AUX = PoolSpec(name="aux", sharding="replicated", heads=0, dtypes=["uint8"], rows=[[24]])


def aux_meta(peer: PeerKey, pages: list[int], item: int) -> RoomMeta:
    return msgspec.structs.replace(dcp_meta(peer, pages), pool_items={"aux": np.array([item], dtype="<i8").tobytes()})


def test_pool_items_ride_with_each_decode_dcp_ranks_last_write_and_a_rank_owning_no_token_gets_them_alone():
    """An aux row (SGLang's, one per request) beside DCP: 7 tokens to decode DCP 2 in two layer
    groups, the second (the last layer) carrying the rank's aux item; a 1-token request, whose
    rank 1 owns no token, writes rank 1 its aux item in a write of every layer and no token. The
    decode trackers take each write to the byte and complete on it."""
    from kvstage.transfer.protocol.decode.tracker import Outcome, RoomTracker

    r = PrefillRoom(room=7, num_pages=4, layout=mla(tp=1), me=1000, now=0.0, timeouts=Timeouts(metadata=50),
                    op_ids=itertools.count(1), num_tokens=7, limits=WriteLimits(max_ranges=4), pools=(AUX,), pool_items={"aux": np.array([9])})
    d0, d1 = PeerKey("dec", 0, 2000), PeerKey("dec", 1, 2001)
    r.add_meta(d0, 2, aux_meta(d0, [3, 4], 5), 1.0, dcp=lay(2))
    r.add_meta(d1, 2, aux_meta(d1, [5, 9], 6), 1.0, dcp=lay(2))
    ops = [a.op for a in r.add_chunk(np.arange(10, 14), True, 2.0) if isinstance(a, PostWrite)]
    assert r.state is not KVPoll.Failed
    by_rank = {d: [op for op in ops if op.peer.tp_rank == d] for d in (0, 1)}
    assert [(op.layers, op.nbytes, len(op.pools)) for op in by_rank[0]] == [(range(0, 1), 32, 0), (range(1, 2), 56, 1)]
    (copy,) = by_rank[1][1].pools
    assert ([int(x) for x in copy.src_items], [int(x) for x in copy.dst_items], copy.nbytes) == ([9], [6], 24)
    t = RoomTracker(2, {0: 64}, {0: 24}, num_layers=2, token_bytes={0: 64})
    for op in by_rank[0]:
        assert t.arrive_direct(0, op.chunk, 0, 2, op.nbytes, layers=op.layers).outcome is Outcome.ACCEPTED
    assert t.complete

    one = PrefillRoom(room=7, num_pages=1, layout=mla(tp=1), me=1000, now=0.0, timeouts=Timeouts(metadata=50),
                      op_ids=itertools.count(1), num_tokens=1, pools=(AUX,), pool_items={"aux": np.array([2])})
    one.add_meta(d0, 2, aux_meta(d0, [0], 5), 1.0, dcp=lay(2))
    one.add_meta(d1, 2, aux_meta(d1, [1], 6), 1.0, dcp=lay(2))
    ops = {a.op.peer.tp_rank: a.op for a in one.add_chunk(np.array([5]), True, 2.0) if isinstance(a, PostWrite)}
    assert sorted(ops) == [0, 1]
    alone = ops[1]
    assert (alone.layers, alone.nbytes, int(alone.token_runs[2].size), len(alone.pools)) == (range(0, 2), 24, 0, 1)
    t = RoomTracker(1, {0: 32}, {0: 24}, num_layers=2, token_bytes={0: 0})
    assert not t.complete   # it owns no token, but its aux item is still to come
    assert t.arrive_direct(0, alone.chunk, 0, 1, alone.nbytes, layers=alone.layers).outcome is Outcome.ACCEPTED
    assert t.complete


def test_a_decode_dcp_room_with_an_aux_item_waits_for_it_even_owning_no_token():
    r = dcp_decode_room(rank=1, pools=(AUX,))
    r.init(np.array([3]), 1.0, num_tokens=1, pool_items={"aux": np.array([4])})
    assert r.state is not KVPoll.Success and r.state is not KVPoll.Failed


def test_pool_item_counts_that_differ_beside_dcp_fail_the_room_naming_the_pool():
    r = PrefillRoom(room=7, num_pages=4, layout=mla(tp=1), me=1000, now=0.0, timeouts=Timeouts(metadata=50),
                    op_ids=itertools.count(1), num_tokens=7, pools=(AUX,), pool_items={"aux": np.array([9])})
    d0 = PeerKey("dec", 0, 2000)
    r.add_meta(d0, 2, msgspec.structs.replace(dcp_meta(d0, [3, 4]), pool_items={"aux": np.array([1, 2], dtype="<i8").tobytes()}),
               1.0, dcp=lay(2))
    assert r.state is KVPoll.Failed and "aux" in r.failure


def test_a_prefill_with_a_draft_facing_decode_dcp_fails_the_room_naming_it_and_one_with_pp_does_not():
    from kvstage.transfer.draft_kv import DraftKV

    def room(**extra) -> PrefillRoom:
        r = PrefillRoom(room=7, num_pages=4, layout=mla(tp=1, **extra), me=1000, now=0.0,
                        timeouts=Timeouts(metadata=50), op_ids=itertools.count(1), num_tokens=7)
        d0 = PeerKey("dec", 0, 2000)
        r.add_meta(d0, 2, dcp_meta(d0, [3, 4]), 1.0, dcp=lay(2))
        return r

    r = room(draft=DraftKV(num_layers=1))
    assert r.state is KVPoll.Failed and "direct (no staging or draft)" in r.failure
    # beside PP each stage writes its layers of the decode rank's tokens (nothing fails at the metadata)
    assert room(pp_size=2, pp_rank=0, stage=range(0, 1)).state is not KVPoll.Failed


def test_equal_dcp_a_prefill_rank_told_of_a_room_it_does_not_write_only_takes_note():
    """Prefill TP 4 DCP 2 -> decode TP 2 DCP 2: decode rank d is written by prefill rank d % 4,
    so prefill rank 3 writes nobody; decode rank 3 % 2 = 1 tells it of the room (a notice: the
    same DCP rank, as the DCP size divides both TP sizes), and it fails nothing and writes nothing."""
    r = PrefillRoom(room=7, num_pages=3, layout=mla(tp=4, rank=3, dcp=2), me=1000, now=0.0,
                    timeouts=Timeouts(metadata=50), op_ids=itertools.count(1), num_tokens=9)
    d1 = PeerKey("dec", 1, 2001)
    acts = r.add_meta(d1, 2, dcp_meta(d1, [6, 2, 8]), 1.0, dcp=lay(2))
    acts += r.add_chunk(np.array([4, 5, 7]), True, 2.0)
    assert r.state is not KVPoll.Failed, r.failure
    assert not [a for a in acts if isinstance(a, PostWrite)]


# -- the relayout: a split's tokens gathered into a staging buffer, written as the decode's runs --

def relayout_room(relayout_bytes: int, **kw) -> PrefillRoom:
    """7 tokens (pages of 2, one 8-byte latent a token and layer: 8 bytes a token a layer) from
    prefill DCP 1 -> decode DCP 2; decode rank 0's pages 3, 4 are consecutive, rank 1's 5, 9
    are not."""
    return PrefillRoom(room=7, num_pages=4, layout=mla(tp=1), me=1000, now=0.0, timeouts=Timeouts(metadata=50),
                       op_ids=itertools.count(1), num_tokens=7, limits=WriteLimits(relayout_bytes=relayout_bytes), **kw)


def relayout_ops(r: PrefillRoom, pools: bool = False) -> dict[int, list]:
    d0, d1 = PeerKey("dec", 0, 2000), PeerKey("dec", 1, 2001)
    r.add_meta(d0, 2, aux_meta(d0, [3, 4], 5) if pools else dcp_meta(d0, [3, 4]), 1.0, dcp=lay(2))
    r.add_meta(d1, 2, aux_meta(d1, [5, 9], 6) if pools else dcp_meta(d1, [5, 9]), 1.0, dcp=lay(2))
    ops = [a.op for a in r.add_chunk(np.arange(10, 14), True, 2.0) if isinstance(a, PostWrite)]
    assert r.state is not KVPoll.Failed, r.failure
    return {d: [op for op in ops if op.peer.tp_rank == d] for d in (0, 1)}


def test_a_split_with_staging_buffers_gathers_each_ranks_tokens_and_writes_the_decodes_slot_runs():
    """Rank 0's four tokens (prefill slots 20, 22, 24, 26: four runs of one) land in one run of
    decode slots 6..9; rank 1's three (21, 23, 25) in slots 10, 11 and 18 (two runs). Both layers
    fit a 64-byte buffer: one write each, with the tag and bytes the direct runs' write has."""
    ops = relayout_ops(relayout_room(64))
    plain = relayout_ops(relayout_room(0))
    for d, (want_src, want_dst, want_len) in {0: ([20, 22, 24, 26], [6], [4]), 1: ([21, 23, 25], [10, 18], [2, 1])}.items():
        (op,) = ops[d]
        (ref,) = plain[d]
        moves = op.relayout
        assert moves is not None and ref.relayout is None
        assert ([int(x) for x in moves.src_slots], [int(x) for x in moves.dst_slot], [int(x) for x in moves.length]) \
            == (want_src, want_dst, want_len)
        assert (op.layers, op.nbytes, op.tag) == (ref.layers, ref.nbytes, ref.tag)
        assert all(np.array_equal(a, b) for a, b in zip(op.token_runs, ref.token_runs, strict=True))


def test_a_relayout_write_holds_the_layers_its_buffer_holds_and_a_layer_too_big_goes_as_direct_runs():
    """32 bytes a layer for rank 0, 24 for rank 1: a 40-byte buffer holds one layer (two writes
    each, numbered as chunks as the descriptor cap's groups are); a 30-byte one holds rank 1's
    layer but not rank 0's, whose writes go as direct runs; the last write carries the aux item,
    whose 24 bytes count against the buffer too."""
    ops = relayout_ops(relayout_room(40))
    assert [(op.layers, op.chunk, op.relayout is not None) for op in ops[0]] == [
        (range(0, 1), 0, True), (range(1, 2), 1, True)]
    ops = relayout_ops(relayout_room(30))
    assert [op.relayout is not None for op in ops[0]] == [False]
    assert [(op.layers, op.relayout is not None) for op in ops[1]] == [(range(0, 1), True), (range(1, 2), True)]
    ops = relayout_ops(relayout_room(40 + 24, pools=(AUX,), pool_items={"aux": np.array([9])}), pools=True)
    assert [(op.layers, op.nbytes, len(op.pools), op.relayout is not None) for op in ops[0]] == [
        (range(0, 1), 32, 0, True), (range(1, 2), 56, 1, True)]


def test_runs_that_already_are_pages_and_a_lone_token_are_not_relayouted():
    """Equal DCP (slot for slot: runs of pages on both sides) and a one-token flow gain nothing
    from a gather: they go as direct runs whatever the buffers."""
    from kvstage.transfer.protocol.token_mapping import build_pair, worth_relayout

    equal = build_pair(prefill=lay(2), decode=lay(2), num_tokens=9, prefix=0, src_pages=(4, 5, 7),
                       dst_pages=(6, 2, 8), decode_rank=1)
    lone = build_pair(prefill=lay(1), decode=lay(2), num_tokens=1, prefix=0, src_pages=(5,), dst_pages=(0,),
                      decode_rank=0)
    split = build_pair(prefill=lay(1), decode=lay(2), num_tokens=7, prefix=0, src_pages=(10, 11, 12, 13),
                       dst_pages=(3, 4), decode_rank=0)
    assert worth_relayout(equal) is None and worth_relayout(lone) is None
    assert worth_relayout(split) is not None
