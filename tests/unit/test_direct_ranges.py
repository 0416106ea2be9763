"""Direct-path descriptors: checked by applying them to real byte buffers."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstage.transfer.protocol.direct_ranges import (
    CacheGeometry,
    DirectRowsCache,
    direct_descriptors,
    page_runs,
    rows_of,
    tensor_rows,
)


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


@pytest.mark.parametrize("heads", [((0, 4), (0, 4), 4, 4), ((2, 4), (0, 2), 4, 2)])   # whole pages; head slices
def test_a_layer_wise_write_adds_its_tensors_bases_to_the_rooms_rows(heads):
    """rows_of(tensor_rows(...)) over a subset of layers is exactly direct_descriptors over it."""
    sh_range, dh_range, sh, dh = heads
    hb, layers = 8, 5
    src = CacheGeometry(tuple(1000 + t * 10_000 for t in range(2 * layers)), 4, sh * hb, hb, num_kv=2)
    dst = CacheGeometry(tuple(900_000 + t * 10_000 for t in range(2 * layers)), 4, dh * hb, hb, device=3, num_kv=2)
    sp, dp = np.array([5, 6, 7, 1]), np.array([2, 3, 9, 4])
    rows = tensor_rows(src, dst, sp, dp, sh_range, dh_range)
    for part in (range(0, 1), range(1, 4), range(4, 5), range(0, layers)):
        got = rows_of(rows, src.of_layers(part), dst.of_layers(part))
        want = direct_descriptors(src.of_layers(part), dst.of_layers(part), sp, dp, sh_range, dh_range)
        assert all((g == w).all() for g, w in zip(got, want)), part


def _cache_geometries(layers=5, sh=4, dh=4, hb=8):
    src = CacheGeometry(tuple(1000 + t * 10_000 for t in range(2 * layers)), 4, sh * hb, hb, num_kv=2)
    dst = CacheGeometry(tuple(900_000 + t * 10_000 for t in range(2 * layers)), 4, dh * hb, hb, device=3, num_kv=2)
    return src, dst


@pytest.mark.parametrize("max_rows", [1 << 18, 0])   # every tensor's rows kept; over the cap, TensorRows only
@pytest.mark.parametrize("heads", [((0, 4), (0, 4), 4, 4), ((2, 4), (0, 2), 4, 2)])   # whole pages; head slices
def test_the_rows_cache_gives_exactly_the_direct_descriptors_of_each_write(heads, max_rows):
    sh_range, dh_range, sh, dh = heads
    src, dst = _cache_geometries(sh=sh, dh=dh)
    sp, dp = np.array([5, 6, 7, 1]), np.array([2, 3, 9, 4])
    cache = DirectRowsCache(max_rows=max_rows)
    for part in (range(0, 1), range(1, 4), range(4, 5), range(0, 5), range(2, 3)):
        got = cache.descriptors(1, 7, None, src=src, dst=dst, src_pages=sp, dst_pages=dp, heads=(sh_range, dh_range),
                                src_layers=part, dst_layers=part)
        want = direct_descriptors(src.of_layers(part), dst.of_layers(part), sp, dp, sh_range, dh_range)
        assert all(g.shape == w.shape and (g == w).all() for g, w in zip(got, want)), part
    # a PP stage: its own tensors hold layers [0, 2) locally, the decode rank's are all five
    stage = CacheGeometry(src.bases[0:2] + src.bases[5:7], 4, sh * 8, 8, num_kv=2)
    got = cache.descriptors(2, 7, None, src=stage, dst=dst, src_pages=sp, dst_pages=dp, heads=(sh_range, dh_range),
                            src_layers=range(1, 2), dst_layers=range(3, 4))
    want = direct_descriptors(stage.of_layers(range(1, 2)), dst.of_layers(range(3, 4)), sp, dp, sh_range, dh_range)
    assert all((g == w).all() for g, w in zip(got, want))
    with pytest.raises(ValueError):
        cache.descriptors(1, 7, None, src=src, dst=dst, src_pages=sp, dst_pages=dp, heads=(sh_range, dh_range),
                          src_layers=range(4, 6), dst_layers=range(4, 6))


def test_the_rows_cache_serves_only_equal_pages_the_same_heads_and_peer_memory(monkeypatch):
    import kvstage.transfer.protocol.direct_ranges as dr

    computed = []
    real = dr.tensor_rows
    monkeypatch.setattr(dr, "tensor_rows", lambda *a: computed.append(1) or real(*a))
    src, dst = _cache_geometries()
    cache = DirectRowsCache()
    sp, dp, heads, peer = np.array([1, 2]), np.array([3, 4]), ((0, 4), (0, 4)), object()

    def get(room=1, peer_key=7, peer=peer, sp=sp, dp=dp, heads=heads):
        cache.descriptors(room, peer_key, peer, src=src, dst=dst, src_pages=sp, dst_pages=dp, heads=heads,
                          src_layers=range(1, 2), dst_layers=range(1, 2))
        return len(computed)

    assert get() == 1 and get(sp=sp.copy()) == 1           # one chunk's layer-wise writes: computed once
    sp[0] = 9                                              # the caller's array changed after: not served
    assert get() == 2
    assert get(dp=np.array([3, 5])) == 3
    assert get(sp=np.array([9, 2, 5]), dp=np.array([3, 5, 6])) == 4
    assert get(heads=((0, 2), (2, 4))) == 5
    assert get(peer=object()) == 6                         # the peer reconnected: new memory
    assert get(peer_key=8) == 7 and len(cache) == 2        # one entry per (room, decode peer)
    assert get(room=2) == 8 and len(cache) == 3
    cache.forget(1)
    assert len(cache) == 1 and get(room=2) == 8
