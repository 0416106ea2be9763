"""The DCP token-axis mapping against SGLang's rule (token t -> decode DCP rank t % N, local
slot t // N), token by token, and a simulated copy of both paths on numpy pools."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstage.transfer.protocol.token_mapping import (
    DCPLayout,
    DCPPairing,
    build_token_mapping,
    describe_pairing,
)


def layouts(p_dcp, d_dcp, page_size, mla=True):
    return (
        DCPLayout(dcp_size=p_dcp, page_size=page_size, mla=mla),
        DCPLayout(dcp_size=d_dcp, page_size=page_size, mla=mla),
    )


@st.composite
def requests(draw):
    page_size = draw(st.sampled_from([1, 2, 3, 4, 16]))
    n = draw(st.integers(1, 5))
    equal = n > 1 and draw(st.booleans())
    p_dcp = n if equal else 1
    prefix = page_size * n * draw(st.integers(0, 3))
    num_tokens = prefix + draw(st.integers(0, 6 * page_size * n + 3))
    new = num_tokens - prefix
    sorted_pages = draw(st.booleans())  # consecutive pages merge into long runs

    def pick(count, extra):
        pool = count + extra
        if sorted_pages:
            start = draw(st.integers(0, extra))
            return tuple(range(start, start + count))
        return tuple(draw(st.permutations(range(pool)))[:count])

    extra = draw(st.integers(0, 4))
    prefill_pages = tuple(pick(-(-new // (page_size * p_dcp)), extra) for _ in range(p_dcp))
    decode_pages = tuple(pick(-(-new // (page_size * n)), extra) for _ in range(n))
    prefill, decode = layouts(p_dcp, n, page_size)
    return dict(
        prefill=prefill,
        decode=decode,
        num_tokens=num_tokens,
        prefix=prefix,
        prefill_pages=prefill_pages,
        decode_pages=decode_pages,
    )


def reference(req, t):
    """SGLang's rule for token t: (prefill rank, prefill pool slot, decode rank, decode pool slot)."""
    ps, n, pn = req["decode"].page_size, req["decode"].dcp_size, req["prefill"].dcp_size
    prefix = req["prefix"]
    d = t % n
    j = t // n - prefix // n
    dst = req["decode_pages"][d][j // ps] * ps + j % ps
    p = t % pn
    i = t // pn - prefix // pn
    src = req["prefill_pages"][p][i // ps] * ps + i % ps
    return p, src, d, dst


def expand(pair):
    """(token, src slot, dst slot) for every token of a pair, in run order."""
    out = []
    for t, s, d, n in zip(pair.first_token, pair.src_slot, pair.dst_slot, pair.length, strict=True):
        assert n >= 1
        out += [(int(t) + k * pair_step(pair), int(s) + k, int(d) + k) for k in range(int(n))]
    return out


def pair_step(pair):
    return pair.piece.step


@settings(max_examples=300, deadline=None)
@given(requests())
def test_every_token_moved_once_where_sglang_puts_it(req):
    m = build_token_mapping(**req)
    n = req["decode"].dcp_size
    seen = {}
    src_used: dict[int, set] = {}
    for d, pair in enumerate(m.pairs):
        assert pair.decode_rank == d
        moved = expand(pair)
        dst_slots = [x[2] for x in moved]
        assert len(set(dst_slots)) == len(dst_slots), "runs overlap on the decode side"
        for t, s, dslot in moved:
            assert t not in seen, f"token {t} moved twice"
            seen[t] = (pair.prefill_rank, s, d, dslot)
            used = src_used.setdefault(pair.prefill_rank, set())
            assert s not in used, "runs overlap on the prefill side"
            used.add(s)
        # maximal runs: two adjacent runs are never contiguous on both sides
        for a in range(len(pair.length) - 1):
            end_s = pair.src_slot[a] + pair.length[a]
            end_d = pair.dst_slot[a] + pair.length[a]
            assert not (end_s == pair.src_slot[a + 1] and end_d == pair.dst_slot[a + 1])
        # staged: the piece is the runs' tokens in order, and lands where the runs say
        assert [x[0] for x in moved] == list(pair.piece)
        landed = [r.dst_page * pair.page_size + r.dst_offset + k for r in pair.piece_runs for k in range(r.length)]
        assert landed == dst_slots
        assert [r.piece_offset for r in pair.piece_runs] == list(
            np.cumsum([0] + [r.length for r in pair.piece_runs])[:-1]
        )
        # a decode rank has one writer
        assert pair.prefill_rank == (d if m.pairing is DCPPairing.EQUAL else 0)
    assert set(seen) == set(range(req["prefix"], req["num_tokens"])), "exactly the tokens beyond the prefix"
    for t, got in seen.items():
        assert got == reference(req, t)
    assert sum(pair.num_tokens for pair in m.pairs) == req["num_tokens"] - req["prefix"]
    assert all(
        len(m.for_prefill(p)) == (1 if m.pairing is DCPPairing.EQUAL else n) for p in range(req["prefill"].dcp_size)
    )


@settings(max_examples=150, deadline=None)
@given(requests(), st.lists(st.integers(0, 10**6), max_size=4))
def test_chunk_windows_together_move_the_whole_request(req, cuts):
    """A chunked send: the windows of a partition of [prefix, L) move, per decode rank and in
    order, exactly what the whole request moves."""
    whole = build_token_mapping(**req)
    lo, hi = req["prefix"], req["num_tokens"]
    bounds = sorted({lo, hi, *(lo + c % (hi - lo + 1) for c in cuts)})
    moved = {d: [] for d in range(req["decode"].dcp_size)}
    for a, b in zip(bounds, bounds[1:]):
        chunk = build_token_mapping(**req, window=(a, b))
        assert chunk.window == (a, b)
        for pair in chunk.pairs:
            got = expand(pair)
            assert all(a <= t < b for t, _, _ in got)
            assert [x[0] for x in got] == list(pair.piece)
            moved[pair.decode_rank] += got
    for pair in whole.pairs:
        assert moved[pair.decode_rank] == expand(pair)


def test_window_outside_the_tokens_to_move_raises():
    prefill, decode = layouts(1, 2, 4)
    with pytest.raises(ValueError, match=r"window \[0, 9\) outside the tokens \[8, 12\)"):
        build_token_mapping(
            prefill=prefill,
            decode=decode,
            num_tokens=12,
            prefix=8,
            prefill_pages=((0,),),
            decode_pages=((0,), (1,)),
            window=(0, 9),
        )


def test_run_rows_read_as_pages_and_offsets():
    prefill, decode = layouts(1, 2, 4)
    m = build_token_mapping(
        prefill=prefill,
        decode=decode,
        num_tokens=10,
        prefix=0,
        prefill_pages=((7, 3, 9),),
        decode_pages=((5, 6), (0, 2)),
    )
    rows = m.for_decode(1).runs()
    # tokens 1,3,5,7,9 -> rank 1 slots 0..4: page 0 offsets 0-3, then page 2 offset 0
    assert [(r.first_token, r.src_page, r.src_offset, r.dst_page, r.dst_offset, r.length) for r in rows] == [
        (1, 7, 1, 0, 0, 1),
        (3, 7, 3, 0, 1, 1),
        (5, 3, 1, 0, 2, 1),
        (7, 3, 3, 0, 3, 1),
        (9, 9, 1, 2, 0, 1),
    ]
    assert [(p.piece_offset, p.dst_page, p.dst_offset, p.length) for p in m.for_decode(1).piece_runs] == [
        (0, 0, 0, 4),
        (4, 2, 0, 1),
    ]
    assert m.pairing is DCPPairing.SPLIT and len(m.for_prefill(0)) == 2


def test_final_partial_page_exact():
    # 2 virtual pages + 1 token beyond the prefix: rank 0 writes one slot of its last page,
    # ranks 1-3 nothing there
    prefill, decode = layouts(1, 4, 2)
    prefix, new = 8, 2 * 8 + 1
    m = build_token_mapping(
        prefill=prefill,
        decode=decode,
        num_tokens=prefix + new,
        prefix=prefix,
        prefill_pages=(tuple(range(9)),),
        decode_pages=tuple((10 * d, 10 * d + 1, 10 * d + 2) for d in range(4)),
    )
    for d, pair in enumerate(m.pairs):
        slots = sorted(x[2] for x in expand(pair))
        want = [10 * d * 2 + k for k in range(4)] + ([10 * d * 2 + 4] if d == 0 else [])
        assert slots == want
        assert pair.piece == range(prefix + d, prefix + new, 4)


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 6), st.sampled_from([1, 4, 16]), st.integers(0, 300), st.integers(0, 2))
def test_equal_dcp_is_the_identity_per_rank(n, page_size, new, prefix_pages):
    prefill, decode = layouts(n, n, page_size)
    prefix = prefix_pages * page_size * n
    count = -(-new // (page_size * n))
    pages = tuple(tuple(range(100 * r, 100 * r + count)) for r in range(n))
    m = build_token_mapping(
        prefill=prefill, decode=decode, num_tokens=prefix + new, prefix=prefix, prefill_pages=pages, decode_pages=pages
    )
    assert m.pairing is DCPPairing.EQUAL
    for r, pair in enumerate(m.pairs):
        assert pair.prefill_rank == pair.decode_rank == r
        assert np.array_equal(pair.src_slot, pair.dst_slot), "local slot for local slot"
        assert len(pair.length) <= 1, "consecutive pages on both sides: one run"


def test_no_dcp_on_either_side_is_the_identity_for_any_attention():
    for mla in (True, False):
        prefill, decode = layouts(1, 1, 4, mla=mla)
        m = build_token_mapping(
            prefill=prefill, decode=decode, num_tokens=11, prefix=4, prefill_pages=((1, 2),), decode_pages=((5, 6),)
        )
        (pair,) = m.pairs
        assert [(r.src_page, r.dst_page, r.length) for r in pair.runs()] == [(1, 5, 7)]


@pytest.mark.parametrize(
    "p_dcp,d_dcp,mla,match",
    [
        (2, 1, True, "prefill DCP 2 .* -> decode DCP 1 .*prefill side only"),
        (2, 4, True, "prefill DCP 2 .* -> decode DCP 4 .*not served"),
        (4, 2, True, "prefill DCP 4 .* -> decode DCP 2 .*not served"),
        (1, 2, False, "prefill DCP 1 .*GQA/MHA.* -> decode DCP 2 .*MLA only"),
        (2, 2, False, "MLA only"),
    ],
)
def test_pairings_kvstage_cannot_serve_name_both_layouts(p_dcp, d_dcp, mla, match):
    prefill, decode = layouts(p_dcp, d_dcp, 4, mla=mla)
    reason = describe_pairing(prefill, decode)
    assert isinstance(reason, str)
    with pytest.raises(ValueError, match=match):
        build_token_mapping(
            prefill=prefill,
            decode=decode,
            num_tokens=0,
            prefix=0,
            prefill_pages=((),) * p_dcp,
            decode_pages=((),) * d_dcp,
        )


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(prefix=4), r"prefix 4 is not a multiple of page_size x decode DCP = 8"),
        (dict(prefix=20), "outside the request"),
        (dict(prefill_pages=((0, 1),)), "prefill DCP rank 0 has 2 pages, the request needs 3"),
        (dict(decode_pages=((0, 1),)), "2 decode page lists for 2 decode DCP ranks|1 decode page lists"),
        (dict(decode_pages=((0, 1), (3, 3))), "decode DCP rank 1 page list has a negative or repeated page"),
        (dict(decode=DCPLayout(dcp_size=2, page_size=2, mla=True)), "page sizes differ"),
    ],
)
def test_bad_requests_raise_naming_both_layouts(kw, match):
    prefill, decode = layouts(1, 2, 4)
    args = dict(
        prefill=prefill,
        decode=decode,
        num_tokens=12,
        prefix=0,
        prefill_pages=((0, 1, 2),),
        decode_pages=((0, 1), (2, 3)),
    )
    args.update(kw)
    with pytest.raises(ValueError, match=match) as err:
        build_token_mapping(**args)
    assert "prefill DCP 1" in str(err.value) and "decode DCP 2" in str(err.value)


@settings(max_examples=60, deadline=None)
@given(requests(), st.booleans())
def test_simulated_copy_is_bit_exact(req, staged):
    """Apply the runs (direct) or the relayout (staged: the tokens gathered in piece order, then
    landed as the destination runs) to numpy pools; every decode slot holds its token's bytes
    as SGLang's rule places them, and nothing else changed."""
    rng = np.random.default_rng(0)
    ps, n, pn = req["decode"].page_size, req["decode"].dcp_size, req["prefill"].dcp_size
    width = 5  # bytes per token (one layer's latent, say)
    kv = rng.integers(0, 256, size=(req["num_tokens"], width), dtype=np.uint8)  # token t's bytes
    pool_pages = 1 + max([max(p, default=0) for p in req["prefill_pages"] + req["decode_pages"]])
    src_pools = [np.zeros((pool_pages * ps, width), np.uint8) for _ in range(pn)]
    for t in range(req["prefix"], req["num_tokens"]):
        p, s, _, _ = reference(req, t)
        src_pools[p][s] = kv[t]
    sentinel = np.uint8(0xA5)
    dst_pools = [np.full((pool_pages * ps, width), sentinel, np.uint8) for _ in range(n)]
    m = build_token_mapping(**req)
    for pair in m.pairs:
        src, dst = src_pools[pair.prefill_rank], dst_pools[pair.decode_rank]
        if staged:   # the relayout: gathered slot by slot, landed run after run in order
            moves = pair.relayout()
            piece = src[moves.src_slots]
            assert len(piece) == pair.num_tokens == int(moves.length.sum())
            at = 0
            for d, k in zip(moves.dst_slot, moves.length, strict=True):
                dst[d : d + k] = piece[at : at + k]
                at += k
        else:
            for s, d, k in zip(pair.src_slot, pair.dst_slot, pair.length, strict=True):
                dst[d : d + k] = src[s : s + k]
    expected = [np.full_like(pool, sentinel) for pool in dst_pools]
    for t in range(req["prefix"], req["num_tokens"]):
        _, _, d, slot = reference(req, t)
        expected[d][slot] = kv[t]
    for got, want in zip(dst_pools, expected, strict=True):
        assert np.array_equal(got, want)
