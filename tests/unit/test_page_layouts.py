"""Head-major and K/V-fused page formats (transfer/page_format.py, page_layouts.py): for every
format x prefill TP x decode TP in {1, 2, 4, 8}, with and without head replication, and MLA,
the descriptors of the direct path and the staged gather/scatter move exactly the bytes each
decode rank holds, into the request's pages and nowhere else, checked element by element in
the engine's own tensor shapes. Each element of the model's cache carries a unique code, so a
byte moved to the wrong head, token, page, layer or K/V shows up as a wrong code."""

from __future__ import annotations

import ctypes
import itertools

import numpy as np
import pytest
import torch

from kvstage.staging.gather_scatter import Gatherer, Scatterer, region_nbytes
from kvstage.transfer.layout import KVLayout
from kvstage.transfer.page_format import PageFormat
from kvstage.transfer.page_layouts import EngineCache
from kvstage.transfer.protocol.direct_ranges import CacheGeometry, direct_descriptors
from kvstage.transfer.protocol.head_mapping import compute_assignments

LAYERS, BLOCK, DIM = 2, 4, 3
TPS = (1, 2, 4, 8)
CASES = [(fmt, heads, False) for fmt in PageFormat for heads in (2, 8)] + \
        [(fmt, 1, True) for fmt in (PageFormat.NHD, PageFormat.HND)]


def model_codes(heads: int, pages: int, mla: bool) -> np.ndarray:
    """The request's KV: [layer, K/V, page, global head, token, dim] of unique nonzero codes."""
    kv = 1 if mla else 2
    return np.arange(1, LAYERS * kv * pages * heads * BLOCK * DIM + 1, dtype=np.int32).reshape(
        LAYERS, kv, pages, heads, BLOCK, DIM)


def engine_tensors(fmt: PageFormat, codes: np.ndarray, heads: range, blocks: int, pages: np.ndarray):
    """A rank's per-layer engine tensors (int32 codes seen as float32) holding `codes` of its
    `heads` at block ids `pages` (request page i in block pages[i]); other blocks hold -1."""
    kv = codes.shape[1]
    full = np.full((LAYERS, kv, blocks, len(heads), BLOCK, DIM), -1, dtype=np.int32)
    full[:, :, pages] = codes[:, :, :, heads.start:heads.stop]
    return [engine_shape(fmt, full[layer]) for layer in range(LAYERS)]


def engine_shape(fmt: PageFormat, per_layer: np.ndarray) -> list[torch.Tensor]:
    """[K/V, block, head, token, dim] into the format's tensors (a list: K then V, or one)."""
    if fmt is PageFormat.NHD:        # [B * S, H, D]
        out = [x.transpose(0, 2, 1, 3).reshape(-1, x.shape[1], DIM) for x in per_layer]
    elif fmt is PageFormat.HND:      # [B, H, S, D]
        out = list(per_layer)
    else:                            # [B, H, S, 2D]: K then V per head and token
        out = [np.concatenate([per_layer[0], per_layer[1]], axis=-1)]
    return [torch.from_numpy(np.ascontiguousarray(x)).view(torch.float32) for x in out]


def split(fmt: PageFormat, tensors: list[list[torch.Tensor]], mla: bool):
    """(k, v) per layer from [layer][K/V tensors]."""
    if mla or fmt.kv_fused:
        return [t[0] for t in tensors], None
    return [t[0] for t in tensors], [t[1] for t in tensors]


def make_rank(fmt, heads, mla, tp, rank, codes, blocks, pages):
    eng = EngineCache(page_format=fmt, num_layers=LAYERS, total_kv_heads=heads, head_dim=DIM, dtype=torch.float32,
                      block_size=BLOCK, tp_size=tp, tp_rank=rank, mla=mla)
    layout = eng.kv_layout()
    held = layout.heads_of(rank) if not mla else range(0, 1)
    k, v = split(fmt, engine_tensors(fmt, codes, held, blocks, pages), mla)
    return eng, layout, eng.buffers(k, v), (k, v)


def geometry(layout: KVLayout, buffers) -> CacheGeometry:
    return CacheGeometry(tuple(t.data_ptr() for t in buffers.tensors()), layout.page_size, layout.token_bytes,
                         layout.head_bytes)


def expected_decode(fmt, heads, mla, tp, rank, codes, blocks, pages):
    """What decode rank `rank` must hold: its heads' codes in the request's blocks, 0 elsewhere."""
    eng = EngineCache(page_format=fmt, num_layers=LAYERS, total_kv_heads=heads, head_dim=DIM, dtype=torch.float32,
                      block_size=BLOCK, tp_size=tp, tp_rank=rank, mla=mla)
    held = eng.kv_layout().heads_of(rank) if not mla else range(0, 1)
    kv = codes.shape[1]
    full = np.zeros((LAYERS, kv, blocks, len(held), BLOCK, DIM), dtype=np.int32)
    full[:, :, pages] = codes[:, :, :, held.start:held.stop]
    return [engine_shape(fmt, full[layer]) for layer in range(LAYERS)]


def zeroed(fmt, heads, mla, tp, rank, blocks):
    eng = EngineCache(page_format=fmt, num_layers=LAYERS, total_kv_heads=heads, head_dim=DIM, dtype=torch.float32,
                      block_size=BLOCK, tp_size=tp, tp_rank=rank, mla=mla)
    shape = eng.tensor_shape(blocks)
    per_layer = [[torch.zeros(shape) for _ in range(1 if (mla or fmt.kv_fused) else 2)] for _ in range(LAYERS)]
    k, v = split(fmt, per_layer, mla)
    return eng.kv_layout(), eng.buffers(k, v), per_layer


def run_transfer(fmt, heads, mla, P, D, staged: bool):
    """Move a 3-page request from every prefill rank to every decode rank; return the decode
    ranks' tensors, the expected ones, and the descriptor count of each assignment."""
    rng = np.random.default_rng(P * 100 + D)
    n, blocks = 3, 7
    codes = model_codes(heads, n, mla)
    src_pages = rng.choice(blocks, n, replace=False)
    dst_pages = rng.choice(blocks, n, replace=False)
    prefill = [make_rank(fmt, heads, mla, P, p, codes, blocks, src_pages) for p in range(P)]
    decode = [zeroed(fmt, heads, mla, D, d, blocks) for d in range(D)]
    mapping = compute_assignments(P, D, heads, mla)
    counts = {}
    for a in mapping.assignments:
        _, s_layout, s_buf, _ = prefill[a.prefill_rank]
        d_layout, d_buf, _ = decode[a.decode_rank]
        if staged:
            hh = a.num_heads
            nbytes = region_nbytes(LAYERS, s_layout.has_v, n * s_layout.page_size, hh, s_layout.head_dim, 4)
            region = torch.zeros(nbytes, dtype=torch.uint8)
            Gatherer().gather(s_buf.k, s_buf.v, torch.as_tensor(src_pages), s_layout.page_size, a.src_heads, region)
            Scatterer().scatter(region, d_buf.k, d_buf.v, torch.as_tensor(dst_pages), d_layout.page_size,
                                a.dst_heads)
        else:
            src, dst = direct_descriptors(geometry(s_layout, s_buf), geometry(d_layout, d_buf), src_pages, dst_pages,
                                          a.src_heads, a.dst_heads)
            for (sa, ln, _), (da, dl, _) in zip(src, dst):
                assert ln == dl
                ctypes.memmove(int(da), int(sa), int(ln))
            counts[(a.prefill_rank, a.decode_rank)] = len(src)
    got = [per_layer for _, _, per_layer in decode]
    want = [expected_decode(fmt, heads, mla, D, d, codes, blocks, dst_pages) for d in range(D)]
    return got, want, counts, n, mapping


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
@pytest.mark.parametrize("fmt,heads,mla", CASES, ids=[f"{f.value}-H{h}{'-mla' if m else ''}" for f, h, m in CASES])
def test_every_decode_byte_is_its_heads_of_the_request(fmt, heads, mla, staged):
    for P, D in itertools.product(TPS, TPS):
        got, want, counts, n, mapping = run_transfer(fmt, heads, mla, P, D, staged)
        for d in range(D):
            for layer in range(LAYERS):
                for g, w in zip(got[d][layer], want[d][layer]):
                    assert torch.equal(g.view(torch.int32), w.view(torch.int32)), (
                        f"P={P} D={D} decode rank {d} layer {layer}: wrong bytes")
        if staged:
            continue
        tensors = LAYERS * (1 if (mla or fmt.kv_fused) else 2)
        p_heads, d_heads = max(1, heads // P), max(1, heads // D)
        for a in mapping.assignments:
            whole = a.num_heads == p_heads == d_heads
            if fmt.head_major or whole:
                # whole pages: one run per page at most; a head slice of a head-major page is
                # one contiguous run per page and tensor
                assert counts[(a.prefill_rank, a.decode_rank)] <= n * tensors
            else:
                assert counts[(a.prefill_rank, a.decode_rank)] == n * BLOCK * tensors


def test_head_major_layouts_are_views_of_the_engine_memory():
    for fmt in (PageFormat.HND, PageFormat.HND_KV_FUSED):
        eng = EngineCache(page_format=fmt, num_layers=1, total_kv_heads=4, head_dim=8, dtype=torch.bfloat16,
                          block_size=16, tp_size=2, tp_rank=1)
        t = torch.zeros(eng.tensor_shape(5), dtype=torch.bfloat16)
        buf = eng.buffers([t], None if fmt.kv_fused else [torch.zeros_like(t)])
        assert buf.k[0].data_ptr() == t.data_ptr() and buf.num_pages == 5
        assert buf.k[0].untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
        layout = eng.kv_layout()
        assert layout.page_size == 1 and layout.head_dim == 16 * 8 * (2 if fmt.kv_fused else 1)
        assert layout.summary().layout_format == fmt.value


def test_bad_shapes_and_formats_are_refused_naming_them():
    eng = EngineCache(page_format="HND_KV_FUSED", num_layers=1, total_kv_heads=2, head_dim=8,
                      dtype=torch.float32, block_size=4, tp_size=1, tp_rank=0)
    with pytest.raises(ValueError, match=r"k\[0\] has shape \(3, 2, 4, 8\), expected \[num_blocks, 2, 4, 16\]"):
        eng.buffers([torch.zeros(3, 2, 4, 8)])
    with pytest.raises(ValueError, match="K and V fused"):
        eng.buffers([torch.zeros(3, 2, 4, 16)], [torch.zeros(3, 2, 4, 16)])
    with pytest.raises(ValueError, match="not contiguous"):
        eng.buffers([torch.zeros(3, 4, 2, 16).transpose(1, 2)])
    with pytest.raises(ValueError, match="page format 'FLASHINFER' is not supported"):
        EngineCache(page_format="FLASHINFER", num_layers=1, total_kv_heads=2, head_dim=8, dtype=torch.float32,
                    block_size=4, tp_size=1, tp_rank=0)
    with pytest.raises(ValueError, match="an MLA cache has no V"):
        EngineCache(page_format="HND_KV_FUSED", num_layers=1, total_kv_heads=1, head_dim=8, dtype=torch.float32,
                    block_size=4, tp_size=1, tp_rank=0, mla=True).kv_layout()
    with pytest.raises(ValueError, match="described with page_size 1"):
        KVLayout(num_layers=1, total_kv_heads=2, head_dim=8, dtype=torch.float32, page_size=4, tp_size=1, tp_rank=0,
                 page_format=PageFormat.HND)


def test_two_formats_never_connect():
    common = dict(num_layers=1, total_kv_heads=2, head_dim=64, dtype=torch.float32, page_size=1, tp_size=1,
                  tp_rank=0)
    hnd = KVLayout(**common, page_format=PageFormat.HND).summary()
    nhd = KVLayout(**common).summary()
    assert hnd.mismatches(nhd) == ["layout_format: 'HND' here vs 'NHD' at peer"]
