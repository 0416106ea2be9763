"""Direct-path descriptors: checked by applying them to real byte buffers."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstage.transfer.protocol.direct_ranges import CacheGeometry, direct_descriptors, page_runs


def test_page_runs():
    s, d, n = page_runs(np.array([3, 4, 5, 9, 10, 2]), np.array([0, 1, 7, 8, 9, 1]))
    assert s.tolist() == [3, 5, 9, 2] and d.tolist() == [0, 7, 8, 1] and n.tolist() == [2, 1, 2, 1]
    assert [x.size for x in page_runs(np.array([], int), np.array([], int))] == [0, 0, 0]
    with pytest.raises(ValueError):
        page_runs(np.array([1, 2]), np.array([1]))


def make_cache(rng, tensors, pages, page_size, heads, head_bytes):
    per = pages * page_size * heads * head_bytes
    mem = rng.integers(0, 256, size=tensors * per, dtype=np.uint8)
    return mem, per


def apply(src_mem, dst_mem, sdesc, ddesc, sbase, dbase):
    assert (sdesc[:, 1] == ddesc[:, 1]).all()
    for (sa, ln, _), (da, _, _) in zip(sdesc.tolist(), ddesc.tolist()):
        dst_mem[da - dbase:da - dbase + ln] = src_mem[sa - sbase:sa - sbase + ln]


@given(st.integers(1, 3), st.sampled_from([1, 4]), st.sampled_from([(2, 4, 0, 0), (4, 2, 2, 0), (2, 4, 0, 2), (4, 4, 0, 0), (1, 2, 0, 1)]),
       st.integers(1, 6), st.randoms(use_true_random=False))
@settings(max_examples=150, deadline=None)
def test_descriptors_move_exactly_the_right_bytes(tensors, page_size, heads, n, rnd):
    sh, dh, s0, d0 = heads  # src local heads, dst local heads, src head start, dst head start
    nheads = min(sh, dh)
    if s0 + nheads > sh or d0 + nheads > dh:
        return
    hb = 8
    rng = np.random.default_rng(rnd.randint(0, 1 << 30))
    pages = 8
    src_mem, sper = make_cache(rng, tensors, pages, page_size, sh, hb)
    dst_mem = np.zeros(tensors * pages * page_size * dh * hb, dtype=np.uint8)
    dper = pages * page_size * dh * hb
    SB, DB = 1 << 20, 1 << 30
    src = CacheGeometry(tuple(SB + t * sper for t in range(tensors)), page_size, sh * hb, hb)
    dst = CacheGeometry(tuple(DB + t * dper for t in range(tensors)), page_size, dh * hb, hb)
    sp = np.array(rnd.sample(range(pages), n))
    dp = np.array(rnd.sample(range(pages), n))
    if rnd.random() < 0.5:
        sp.sort(); dp.sort()
    sd, dd = direct_descriptors(src, dst, sp, dp, (s0, s0 + nheads), (d0, d0 + nheads))
    apply(src_mem, dst_mem, sd, dd, SB, DB)
    S = src_mem.reshape(tensors, pages, page_size, sh, hb)
    Dm = dst_mem.reshape(tensors, pages, page_size, dh, hb)
    want = np.zeros_like(Dm)
    want[:, dp, :, d0:d0 + nheads] = S[:, sp, :, s0:s0 + nheads]
    assert (Dm == want).all()
    if nheads == sh == dh:
        runs = page_runs(sp, dp)[2].size
        assert sd.shape[0] == tensors * runs  # coalesced
    else:
        assert sd.shape[0] == tensors * n * page_size


def test_rejects_mismatched_geometry():
    a = CacheGeometry((0,), 4, 32, 8)
    with pytest.raises(ValueError):
        direct_descriptors(a, CacheGeometry((0, 1), 4, 32, 8), np.array([0]), np.array([0]), (0, 4), (0, 4))
    with pytest.raises(ValueError):
        direct_descriptors(a, CacheGeometry((0,), 4, 64, 16), np.array([0]), np.array([0]), (0, 4), (0, 4))
    with pytest.raises(ValueError):
        direct_descriptors(a, a, np.array([0]), np.array([0]), (0, 4), (0, 2))


def test_of_layers_keeps_k_then_v_of_those_layers_only():
    geo = CacheGeometry(tuple(range(100, 106)), 4, 32, 8, num_kv=2)   # K0 K1 K2 V0 V1 V2
    assert geo.of_layers(range(1, 3)).bases == (101, 102, 104, 105)
    assert geo.of_layers(range(0, 3)) is geo
    mla = CacheGeometry((7, 8, 9), 4, 32, 8)
    assert mla.of_layers(range(2, 3)).bases == (9,)
    with pytest.raises(ValueError, match="layers range"):
        geo.of_layers(range(2, 4))
