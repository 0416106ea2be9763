"""Gather/scatter: the region byte layout (the contract), bit-exact round trips, errors, reuse."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvstage.staging.gather_scatter as gs
from kvstage.staging.buffers import StagingBuffer
from kvstage.staging.gather_scatter import Gatherer, Scatterer, region_nbytes

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int8]
PATHS = ["auto", "index", "runs"]  # which copy formulation (forced through the module knobs)


# ----------------------------------------------------------------------------- helpers

def make_cache(layers: int, has_v: bool, num_pages: int, page_size: int, heads: int, head_dim: int,
               dtype: torch.dtype, gen: torch.Generator, fill: str = "random"):
    """Per-layer K (and V) tensors whose bytes are random (any bit pattern, NaNs included)."""
    es = torch.empty(0, dtype=dtype).element_size()

    def one():
        shape = (num_pages * page_size, heads, head_dim * es)
        if fill == "random":
            raw = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
        else:
            raw = torch.zeros(shape, dtype=torch.uint8)
        return raw.view(dtype)

    k = [one() for _ in range(layers)]
    v = [one() for _ in range(layers)] if has_v else None
    return k, v


def byte_pages(t: torch.Tensor, page_size: int) -> np.ndarray:
    """One layer as a numpy uint8 array [pages, page_size, heads, head_dim * elem_size]."""
    b = t.view(torch.uint8).numpy()
    return b.reshape(b.shape[0] // page_size, page_size, b.shape[1], b.shape[2])


def numpy_region(k, v, pages, page_size, heads) -> np.ndarray:
    """The region by numpy fancy indexing: [K/V][layer][token][head][head_dim] bytes."""
    h0, h1 = heads
    idx = np.asarray(pages, dtype=np.int64)
    parts = [byte_pages(t, page_size)[idx][:, :, h0:h1].reshape(-1) for t in list(k) + list(v or [])]
    return np.concatenate(parts) if parts else np.zeros(0, np.uint8)


def slow_region(k, v, pages, page_size, heads) -> bytes:
    """The region spelled out element by element in pure Python (pins the contract)."""
    h0, h1 = heads
    out = bytearray()
    for kv in ([k] if v is None else [k, v]):            # K first, then V
        for layer in kv:                                  # then layer
            raw = layer.view(torch.uint8)
            for p in list(pages):                         # then tokens of the pages in list order
                for tok in range(page_size):
                    row = int(p) * page_size + tok
                    for h in range(h0, h1):               # then head, then head_dim bytes
                        out += bytes(raw[row, h].tolist())
    return bytes(out)


def as_bytes(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.uint8).numpy().copy()


@pytest.fixture
def force_path(monkeypatch):
    def set_path(path: str) -> None:
        if path == "index":
            monkeypatch.setattr(gs, "_GATHER_MAX_RUNS", 0)
            monkeypatch.setattr(gs, "_SCATTER_MAX_RUNS", 0)
        elif path == "runs":
            monkeypatch.setattr(gs, "_GATHER_MAX_RUNS", 1 << 30)
            monkeypatch.setattr(gs, "_SCATTER_MAX_RUNS", 1 << 30)
            monkeypatch.setattr(gs, "_gather_slices_win", lambda *a: True)
        else:
            monkeypatch.undo()
    return set_path


def page_patterns(num_pages: int, rng: np.random.Generator) -> dict[str, list[int]]:
    """Source page lists (gather may repeat pages); all have distinct-able sizes <= num_pages."""
    return {
        "single": [int(rng.integers(num_pages))],
        "consecutive": list(range(2, 2 + min(6, num_pages - 2))),
        "two-runs": [7, 8, 9, 1, 2],
        "random": rng.permutation(num_pages)[:6].tolist(),
        "repeated": [3, 3, 5, 3, 5, 5],
    }


def distinct_pages(n: int, num_pages: int, rng: np.random.Generator, style: str) -> list[int]:
    if style == "consecutive":
        start = int(rng.integers(0, num_pages - n + 1))
        return list(range(start, start + n))
    return rng.permutation(num_pages)[:n].tolist()


def round_trip(k, v, src_pages, page_size, src_heads, dst_cache, dst_pages, dst_heads, out):
    """gather -> scatter; checks the region bytes and the destination bytes exactly."""
    g, s = Gatherer(), Scatterer()
    nbytes = g.gather(k, v, torch.tensor(src_pages), page_size, src_heads, out)
    expect = numpy_region(k, v, src_pages, page_size, src_heads)
    assert nbytes == expect.size
    np.testing.assert_array_equal(out[:nbytes].numpy(), expect)

    dk, dv = dst_cache
    before = [as_bytes(t) for t in list(dk) + list(dv or [])]
    assert s.scatter(out, dk, dv, torch.tensor(dst_pages), page_size, dst_heads) == nbytes
    sh0, sh1 = src_heads
    dh0, dh1 = dst_heads
    for src_t, dst_t, old in zip(list(k) + list(v or []), list(dk) + list(dv or []), before):
        want = old.reshape(-1, page_size, old.shape[1], old.shape[2]).copy()
        want[dst_pages, :, dh0:dh1] = byte_pages(src_t, page_size)[src_pages][:, :, sh0:sh1]
        np.testing.assert_array_equal(byte_pages(dst_t, page_size), want)
    return nbytes


# ----------------------------------------------------------------------------- the contract

def test_region_nbytes():
    assert region_nbytes(32, True, 2048, 4, 128, 2) == 2 * 32 * 2048 * 4 * 128 * 2
    assert region_nbytes(3, False, 5, 1, 576, 1) == 3 * 5 * 576
    assert region_nbytes(1, True, 0, 8, 128, 2) == 0
    with pytest.raises(ValueError, match="num_layers"):
        region_nbytes(-1, True, 1, 1, 1, 1)
    with pytest.raises(TypeError, match="head_dim"):
        region_nbytes(1, True, 1, 1, 1.5, 1)


@pytest.mark.parametrize("has_v", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32])
def test_region_layout_matches_pure_python(dtype, has_v):
    gen = torch.Generator().manual_seed(1)
    k, v = make_cache(2, has_v, num_pages=6, page_size=2, heads=3, head_dim=4, dtype=dtype, gen=gen)
    for heads in [(0, 3), (1, 2), (2, 3), (0, 2)]:
        for pages in ([4, 0, 5], [1, 2, 3], [2], [3, 3, 0]):
            n = region_nbytes(2, has_v, len(pages) * 2, heads[1] - heads[0], 4, k[0].element_size())
            out = torch.full((n + 7,), 0xEE, dtype=torch.uint8)
            assert Gatherer().gather(k, v, torch.tensor(pages), 2, heads, out) == n
            assert bytes(out[:n].tolist()) == slow_region(k, v, pages, 2, heads)
            assert out[n:].eq(0xEE).all()  # nothing written past the region


def test_region_layout_hand_computed():
    # 1 layer, K and V, 2 pages of 2 tokens, 2 heads of 1 int8 element: byte = identifiable value.
    k = [torch.arange(0, 8, dtype=torch.int8).view(4, 2, 1)]        # token t, head h -> 2t+h
    v = [torch.arange(100, 108, dtype=torch.int8).view(4, 2, 1)]
    out = torch.zeros(4, dtype=torch.uint8)
    Gatherer().gather(k, v, torch.tensor([1]), 2, (1, 2), out)
    # page 1 = tokens 2, 3; head 1: K bytes 5, 7 then V bytes 105, 107
    assert out.tolist() == [5, 7, 105, 107]


# ----------------------------------------------------------------------------- round trips

@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_bit_exact(dtype, page_size, force_path):
    """Every dtype x page size, head ranges at start / middle / end / whole, with and without V,
    1 and 3 layers, page patterns, both copy formulations; into another cache at other pages."""
    rng = np.random.default_rng(page_size)
    gen = torch.Generator().manual_seed(page_size)
    head_dim, src_heads_total = 8, 4
    num_pages = 12
    for layers in (1, 3):
        for has_v in (True, False):
            k, v = make_cache(layers, has_v, num_pages, page_size, src_heads_total, head_dim, dtype, gen)
            buf = StagingBuffer.host(region_nbytes(layers, has_v, 6 * page_size, 4, head_dim, 4) + 64)
            for heads in [(0, 4), (0, 1), (1, 3), (3, 4)]:
                hh = heads[1] - heads[0]
                # destination rank: a different head count, the writer's range at some place in it
                dst_total = hh + int(rng.integers(0, 3))
                d0 = int(rng.integers(0, dst_total - hh + 1))
                for name, src_pages in page_patterns(num_pages, rng).items():
                    for path in PATHS:
                        force_path(path)
                        dst = make_cache(layers, has_v, num_pages + 3, page_size, dst_total, head_dim, dtype, gen)
                        style = "consecutive" if name in ("consecutive", "single") else "random"
                        dst_pages = distinct_pages(len(src_pages), num_pages + 3, rng, style)
                        round_trip(k, v, src_pages, page_size, heads, dst, dst_pages, (d0, d0 + hh),
                                   buf.region(0, buf.nbytes))
            force_path("auto")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_round_trip_random_geometry(data):
    dtype = data.draw(st.sampled_from(DTYPES))
    layers = data.draw(st.integers(1, 3))
    has_v = data.draw(st.booleans())
    page_size = data.draw(st.sampled_from([1, 2, 3, 16]))
    heads_total = data.draw(st.integers(1, 6))
    head_dim = data.draw(st.sampled_from([1, 3, 4, 8, 12, 64]))  # odd row sizes -> narrow units
    num_pages = data.draw(st.integers(1, 10))
    h0 = data.draw(st.integers(0, heads_total - 1))
    h1 = data.draw(st.integers(h0 + 1, heads_total))
    src_pages = data.draw(st.lists(st.integers(0, num_pages - 1), min_size=1, max_size=8))
    n = len(src_pages)
    dst_num_pages = n + data.draw(st.integers(0, 5))
    dst_pages = data.draw(st.permutations(range(dst_num_pages)))[:n]
    dst_extra = data.draw(st.integers(0, 2))
    d0 = data.draw(st.integers(0, dst_extra))
    offset = data.draw(st.integers(0, 17))  # unaligned regions go through the temp
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))

    k, v = make_cache(layers, has_v, num_pages, page_size, heads_total, head_dim, dtype, gen)
    dst = make_cache(layers, has_v, dst_num_pages, page_size, h1 - h0 + dst_extra, head_dim, dtype, gen)
    es = k[0].element_size()
    nbytes = region_nbytes(layers, has_v, n * page_size, h1 - h0, head_dim, es)
    with StagingBuffer.host(nbytes + offset) as buf:
        region = buf.region(offset, nbytes)
        assert round_trip(k, v, src_pages, page_size, (h0, h1), dst, dst_pages, (d0, d0 + h1 - h0), region) == nbytes
        del region


@pytest.mark.parametrize("offset", [0, 8, 3, 4096 + 5, 4])
def test_gather_into_offset_region_of_staging_buffer(offset):
    gen = torch.Generator().manual_seed(7)
    k, v = make_cache(2, True, 8, 4, 4, 16, torch.bfloat16, gen)
    pages = [6, 1, 2, 3]
    n = region_nbytes(2, True, 16, 2, 16, 2)
    with StagingBuffer.host(offset + n + 4096) as buf:
        buf.tensor.fill_(0xAB)
        region = buf.region(offset, n)
        g = Gatherer()
        assert g.gather(k, v, pages, 4, (2, 4), region) == n
        np.testing.assert_array_equal(region.numpy(), numpy_region(k, v, pages, 4, (2, 4)))
        assert buf.tensor[:offset].eq(0xAB).all() and buf.tensor[offset + n:].eq(0xAB).all()
        # the same region back into another cache through an unaligned source as well
        dk, dv = make_cache(2, True, 5, 4, 2, 16, torch.bfloat16, gen, fill="zeros")
        Scatterer().scatter(region, dk, dv, [4, 0, 1, 2], 4, (0, 2))
        for s_t, d_t in zip(k + v, dk + dv):
            np.testing.assert_array_equal(byte_pages(d_t, 4)[[4, 0, 1, 2]], byte_pages(s_t, 4)[pages][:, :, 2:4])
        del region


def test_empty_page_list_writes_nothing():
    gen = torch.Generator().manual_seed(0)
    k, v = make_cache(1, True, 4, 2, 2, 4, torch.float16, gen)
    out = torch.full((8,), 9, dtype=torch.uint8)
    assert Gatherer().gather(k, v, torch.tensor([], dtype=torch.int64), 2, (0, 2), out) == 0
    assert Scatterer().scatter(out, k, v, [], 2, (0, 2)) == 0
    assert out.eq(9).all()


def test_page_list_types():
    gen = torch.Generator().manual_seed(0)
    k, v = make_cache(1, False, 6, 2, 2, 4, torch.float16, gen)
    n = region_nbytes(1, False, 4, 2, 4, 2)
    ref = numpy_region(k, v, [5, 0], 2, (0, 2))
    for pages in ([5, 0], (5, 0), np.array([5, 0], dtype=np.int32), torch.tensor([5, 0], dtype=torch.int32),
                  torch.tensor([5, 0])):
        out = torch.zeros(n, dtype=torch.uint8)
        Gatherer().gather(k, v, pages, 2, (0, 2), out)
        np.testing.assert_array_equal(out.numpy(), ref)


# ----------------------------------------------------------------------------- concurrency

def test_concurrent_scatter_of_disjoint_heads_into_same_pages():
    """P > D: several writers scatter different head ranges of the same pages at once."""
    gen = torch.Generator().manual_seed(3)
    page_size, head_dim, writers, per_writer = 16, 64, 4, 2
    srcs = [make_cache(2, True, 40, page_size, per_writer, head_dim, torch.bfloat16, gen) for _ in range(writers)]
    src_pages = list(range(3, 35))
    dst_pages = np.random.default_rng(0).permutation(40)[:32].tolist()
    regions = []
    for k, v in srcs:
        out = torch.empty(region_nbytes(2, True, 32 * page_size, per_writer, head_dim, 2), dtype=torch.uint8)
        Gatherer().gather(k, v, src_pages, page_size, (0, per_writer), out)
        regions.append(out)
    for _ in range(5):
        dk, dv = make_cache(2, True, 40, page_size, writers * per_writer, head_dim, torch.bfloat16, gen, fill="zeros")
        barrier = threading.Barrier(writers)
        errors = []

        def work(w):
            try:
                s = Scatterer()
                barrier.wait()
                for _ in range(3):
                    s.scatter(regions[w], dk, dv, dst_pages, page_size, (w * per_writer, (w + 1) * per_writer))
            except Exception as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(w,)) for w in range(writers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not errors and not any(t.is_alive() for t in threads)
        for layer, d_t in enumerate(dk + dv):
            got = byte_pages(d_t, page_size)[dst_pages]
            for w, (k, v) in enumerate(srcs):
                want = byte_pages((k + v)[layer], page_size)[src_pages]
                np.testing.assert_array_equal(got[:, :, w * per_writer:(w + 1) * per_writer], want)


def test_concurrent_gatherers():
    gen = torch.Generator().manual_seed(4)
    k, v = make_cache(4, True, 64, 16, 8, 64, torch.float16, gen)
    pages = np.random.default_rng(1).permutation(64)[:40].tolist()
    halves = [(0, 4), (4, 8)]
    outs = [torch.empty(region_nbytes(4, True, 40 * 16, 4, 64, 2), dtype=torch.uint8) for _ in halves]
    threads = [threading.Thread(target=Gatherer().gather, args=(k, v, pages, 16, h, o)) for h, o in zip(halves, outs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for h, o in zip(halves, outs):
        np.testing.assert_array_equal(o.numpy(), numpy_region(k, v, pages, 16, h))


# ----------------------------------------------------------------------------- errors

@pytest.fixture
def small():
    gen = torch.Generator().manual_seed(0)
    k, v = make_cache(2, True, 4, 2, 3, 4, torch.bfloat16, gen)
    out = torch.zeros(region_nbytes(2, True, 4, 3, 4, 2), dtype=torch.uint8)
    return k, v, out


def test_error_out_too_small(small):
    k, v, out = small
    with pytest.raises(ValueError, match=r"out has 383 bytes, the region needs 384"):
        Gatherer().gather(k, v, [0, 1], 2, (0, 3), out[:383])
    with pytest.raises(ValueError, match=r"src has 10 bytes"):
        Scatterer().scatter(out[:10], k, v, [0, 1], 2, (0, 3))


@pytest.mark.parametrize("heads", [(0, 4), (2, 2), (3, 1), (-1, 2), (1, 9)])
def test_error_head_range_out_of_bounds(small, heads):
    k, v, out = small
    with pytest.raises(ValueError, match="head|heads"):
        Gatherer().gather(k, v, [0], 2, heads, out)
    with pytest.raises(ValueError, match="head|heads"):
        Scatterer().scatter(out, k, v, [0], 2, heads)


def test_error_heads_not_a_pair(small):
    k, v, out = small
    with pytest.raises(ValueError, match="heads must be a"):
        Gatherer().gather(k, v, [0], 2, 3, out)


@pytest.mark.parametrize("pages", [[0, 4], [-1], [1, 2, 7]])
def test_error_page_index_out_of_range(small, pages):
    k, v, out = small
    with pytest.raises(ValueError, match=r"page index -?\d+ is out of range for a cache of 4 pages"):
        Gatherer().gather(k, v, pages, 2, (0, 3), out)
    with pytest.raises(ValueError, match=r"out of range"):
        Scatterer().scatter(out, k, v, pages, 2, (0, 3))


def test_error_bad_page_lists(small):
    k, v, out = small
    with pytest.raises(ValueError, match="integers"):
        Gatherer().gather(k, v, torch.tensor([0.0, 1.0]), 2, (0, 3), out)
    with pytest.raises(ValueError, match="1-D"):
        Gatherer().gather(k, v, torch.tensor([[0, 1]]), 2, (0, 3), out)
    with pytest.raises(ValueError, match="distinct"):
        Scatterer().scatter(out, k, v, [1, 0, 1], 2, (0, 3))


def test_error_mismatched_dtypes(small):
    k, v, out = small
    with pytest.raises(ValueError, match=r"dtype mismatch: k\[1\] is torch.float16"):
        Gatherer().gather([k[0], k[1].view(torch.float16)], v, [0], 2, (0, 3), out)
    with pytest.raises(ValueError, match=r"dtype mismatch: v\[0\]"):
        Scatterer().scatter(out, k, [v[0].view(torch.int16), v[1]], [0], 2, (0, 3))
    with pytest.raises(ValueError, match="out must be a 1-D torch.uint8"):
        Gatherer().gather(k, v, [0], 2, (0, 3), out.view(torch.int8))
    with pytest.raises(ValueError, match="src must be a 1-D torch.uint8"):
        Scatterer().scatter(out.view(2, -1), k, v, [0], 2, (0, 3))
    with pytest.raises(ValueError, match="out must be contiguous"):
        Gatherer().gather(k, v, [0], 2, (0, 3), torch.zeros(2 * out.numel(), dtype=torch.uint8)[::2])
    with pytest.raises(ValueError, match="out must be a torch.Tensor"):
        Gatherer().gather(k, v, [0], 2, (0, 3), bytearray(out.numel()))


def test_error_mismatched_devices(small):
    k, v, out = small
    meta_layer = torch.empty(k[1].shape, dtype=k[1].dtype, device="meta")
    with pytest.raises(ValueError, match=r"device mismatch: k\[1\] is on meta"):
        Gatherer().gather([k[0], meta_layer], v, [0], 2, (0, 3), out)
    meta_out = torch.empty(out.shape, dtype=torch.uint8, device="meta")
    with pytest.raises(ValueError, match=r"device mismatch: out is on meta, the KV cache on cpu"):
        Gatherer().gather(k, v, [0], 2, (0, 3), meta_out)
    with pytest.raises(ValueError, match=r"device mismatch: src is on meta"):
        Scatterer().scatter(meta_out, k, v, [0], 2, (0, 3))


def test_error_cache_shapes(small):
    k, v, out = small
    with pytest.raises(ValueError, match=r"v has 1 layers but k has 2"):
        Gatherer().gather(k, v[:1], [0], 2, (0, 3), out)
    with pytest.raises(ValueError, match=r"shape mismatch: v\[1\]"):
        Gatherer().gather(k, [v[0], v[1][:4]], [0], 2, (0, 3), out)
    with pytest.raises(ValueError, match="not a multiple of page_size=3"):
        Gatherer().gather(k, v, [0], 3, (0, 3), out)
    with pytest.raises(ValueError, match=r"k\[0\] must be \[tokens, heads, head_dim\]"):
        Gatherer().gather([k[0][0]], None, [0], 2, (0, 3), out)
    with pytest.raises(ValueError, match="contiguous"):
        Gatherer().gather([k[0].transpose(0, 1).contiguous().transpose(0, 1)] * 2, None, [0], 2, (0, 3), out)
    with pytest.raises(ValueError, match="non-empty sequence"):
        Gatherer().gather([], None, [0], 2, (0, 3), out)
    with pytest.raises(ValueError, match="non-empty sequence"):
        Gatherer().gather(k[0], None, [0], 2, (0, 3), out)
    with pytest.raises(ValueError, match="page_size"):
        Gatherer().gather(k, v, [0], 0, (0, 3), out)


# ----------------------------------------------------------------------------- reuse

def test_temp_is_reused_not_reallocated():
    gen = torch.Generator().manual_seed(0)
    k, v = make_cache(3, True, 16, 4, 4, 32, torch.bfloat16, gen)
    n = region_nbytes(3, True, 8 * 4, 2, 32, 2)
    raw = torch.empty(n + 8, dtype=torch.uint8)
    out = raw[1:1 + n]  # unaligned: staged through the temp
    g, s = Gatherer(), Scatterer()
    assert g.temp is None
    g.gather(k, v, list(range(8)), 4, (1, 3), out)
    s.scatter(out, k, v, list(range(8, 16)), 4, (1, 3))
    ptrs = (g.temp.data_ptr(), s.temp.data_ptr())
    prepared = (list(g._memo.values()), list(s._memo.values()))
    for i in range(5):
        g.gather(k, v, [(i + j) % 16 for j in range(8)], 4, (1, 3), out)
        g.gather(k, v, [1, 2], 4, (0, 1), raw[3:3 + region_nbytes(3, True, 8, 1, 32, 2)])  # smaller fits
        s.scatter(out, k, v, list(range(8, 16)), 4, (1, 3))
    assert (g.temp.data_ptr(), s.temp.data_ptr()) == ptrs
    assert (list(g._memo.values()), list(s._memo.values())) == prepared  # cache views prepared once
    # a larger request grows the temp once, then it stays
    big = region_nbytes(3, True, 16 * 4, 4, 32, 2)
    raw2 = torch.empty(big + 1, dtype=torch.uint8)
    g.gather(k, v, list(range(16)), 4, (0, 4), raw2[1:])
    grown = g.temp.data_ptr()
    g.gather(k, v, list(range(16)), 4, (0, 4), raw2[1:])
    assert g.temp.data_ptr() == grown
    # aligned regions need no temp at all
    g2 = Gatherer()
    g2.gather(k, v, list(range(8)), 4, (1, 3), raw[:n])
    assert g2.temp is None


def test_prepared_cache_is_refreshed_when_tensors_change():
    gen = torch.Generator().manual_seed(0)
    k, v = make_cache(1, True, 4, 2, 2, 4, torch.float32, gen)
    g = Gatherer()
    out = torch.zeros(region_nbytes(1, True, 2, 2, 4, 4), dtype=torch.uint8)
    g.gather(k, v, [1], 2, (0, 2), out)
    k2, v2 = make_cache(1, True, 4, 2, 2, 4, torch.float32, gen)  # new tensors
    g.gather(k2, v2, [1], 2, (0, 2), out)
    np.testing.assert_array_equal(out.numpy(), numpy_region(k2, v2, [1], 2, (0, 2)))
    k[0].set_(k2[0].clone())  # same object, new storage
    g.gather(k, v, [1], 2, (0, 2), out)
    np.testing.assert_array_equal(out.numpy(), numpy_region(k, v, [1], 2, (0, 2)))
    for _ in range(6):  # the memo stays bounded
        kk, vv = make_cache(1, True, 4, 2, 2, 4, torch.float32, gen)
        g.gather(kk, vv, [0], 2, (0, 2), out)
    assert 1 <= len(g._memo) <= 4
    g.forget()
    assert g.temp is None and not g._memo


def test_no_cuda_initialisation_on_cpu_paths():
    gen = torch.Generator().manual_seed(0)
    k, v = make_cache(1, True, 4, 2, 2, 4, torch.float32, gen)
    with StagingBuffer.host(4096) as buf:
        out = buf.region(0, region_nbytes(1, True, 2, 2, 4, 4))
        Gatherer().gather(k, v, [1], 2, (0, 2), out)
        Scatterer().scatter(out, k, v, [2], 2, (0, 2))
        del out
    assert not torch.cuda.is_initialized()


# ----------------------------------------------------------------------------- calls per copy

_COPIES = {"copy_", "cat", "index_select", "index_copy_", "_foreach_copy_"}


class _CountCopies(torch.overrides.TorchFunctionMode):
    """Counts the torch calls that move bytes (each lets go of Python's lock and takes it back)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in _COPIES:
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(("pages", "gather_calls"), [([5], ["cat"]), ([5, 6, 7], ["cat"]),
                                                     ([9, 10, 2, 3], ["index_select"] * 32)],
                         ids=["one-page", "one-run", "two-runs"])
def test_a_few_runs_move_in_one_torch_call_not_one_per_layer(pages, gather_calls):
    """A page list of few runs (a one-page request's) moves all of its 2 x 16 (K/V, layer) blocks
    in one torch call: a call per block waited for Python's lock once each under load
    (docs/staging_kernels.md, "One call per copy"). A gather of two runs takes the page index, one
    call per block, as before. Both directions stay bit-exact."""
    gen = torch.Generator().manual_seed(3)
    k, v = make_cache(16, True, 12, 4, 4, 32, torch.bfloat16, gen)
    dk, dv = make_cache(16, True, 12, 4, 4, 32, torch.bfloat16, gen)
    n = region_nbytes(16, True, len(pages) * 4, 2, 32, 2)
    out = torch.empty(n, dtype=torch.uint8)
    g, s = Gatherer(), Scatterer()
    with _CountCopies() as gathered:
        g.gather(tuple(k), tuple(v), np.asarray(pages), 4, (2, 4), out)
    dst = list(range(len(pages)))
    with _CountCopies() as scattered:
        s.scatter(out, tuple(dk), tuple(dv), np.asarray(dst), 4, (0, 2))
    assert gathered.calls == gather_calls
    assert scattered.calls == ["_foreach_copy_"]
    np.testing.assert_array_equal(out.numpy(), numpy_region(k, v, pages, 4, (2, 4)))
    for src_t, dst_t in zip(k + v, dk + dv, strict=True):
        np.testing.assert_array_equal(byte_pages(dst_t, 4)[dst][:, :, 0:2], byte_pages(src_t, 4)[pages][:, :, 2:4])
