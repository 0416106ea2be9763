import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstage.transfer.protocol.pieces import max_piece_pages, plan_pieces


def test_max_piece_pages():
    assert max_piece_pages([1000, 1000], buffer_bytes=10_000, ring_bytes=1 << 20) == 10  # buffer bound
    assert max_piece_pages([1000, 1000], buffer_bytes=1 << 20, ring_bytes=9000) == 4    # ring bound
    assert max_piece_pages([1000, 1000], buffer_bytes=999, ring_bytes=1 << 20) == 0     # not one page
    assert max_piece_pages([1000], buffer_bytes=1 << 20, ring_bytes=4096, align=2048) == 4
    assert max_piece_pages([2000, 1000], buffer_bytes=4000, ring_bytes=1 << 20) == 2     # largest writer
    with pytest.raises(ValueError, match="a piece has writers"):
        max_piece_pages([], 1, 1)


def test_plan_examples():
    assert plan_pieces(10, 5, max_pages=8, fit_now=8) == [(10, 5)]
    assert plan_pieces(0, 20, max_pages=8, fit_now=3) == [(0, 3), (3, 8), (11, 8), (19, 1)]
    assert plan_pieces(0, 20, max_pages=8, fit_now=0) == [(0, 8), (8, 8), (16, 4)]
    with pytest.raises(ValueError):
        plan_pieces(0, 4, max_pages=0, fit_now=0)


@given(st.integers(0, 100), st.integers(1, 500), st.integers(1, 64), st.integers(0, 100))
def test_plan_tiles_the_chunk(start, n, max_pages, fit_now):
    pieces = plan_pieces(start, n, max_pages, fit_now)
    pos = start
    for s, c in pieces:
        assert s == pos and 1 <= c <= max_pages
        pos += c
    assert pos == start + n
    if fit_now:
        assert pieces[0][1] <= fit_now
