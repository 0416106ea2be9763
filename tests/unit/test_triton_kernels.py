"""The fused Triton gather/scatter kernels: bit-exact against the torch reference, one launch
per region, the reference's errors, the kernel choice (KVSTAGE_STAGING_KERNELS), and an
ahead-of-time compile for sm_80 and sm_90.

Without a GPU the kernels run under Triton's CPU interpreter: tests/conftest.py sets
TRITON_INTERPRET=1 before any test module imports triton, and
`test_kernels_run_on_the_gpu_or_interpreted` fails if that did not take (on a GPU machine: if the
kernels are not compiled and run there). The interpreter works on raw host addresses, so the
int64 address table, the word reinterpretation and every index computation are exercised as on
the GPU.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstage.staging import kernels
from kvstage.staging import triton_kernels as tk
from kvstage.staging.copy_units import unit_for
from kvstage.staging.gather_scatter import Gatherer, Scatterer, region_nbytes
from kvstage.staging.triton_kernels import TritonGatherer, TritonScatterer

DEVICE = torch.device("cuda" if torch.cuda.is_available() and not tk.interpreted() else "cpu")
FP8 = [torch.float8_e4m3fn] if hasattr(torch, "float8_e4m3fn") else []
DTYPES = [*FP8, torch.bfloat16, torch.float16, torch.float32, torch.int8]
HEAD_DIMS = [72, 96, 128, 3]     # 3: rows of 3/6/12 bytes -> int8/int16/int32 words


def make_cache(layers, has_v, num_pages, page_size, heads, head_dim, dtype, seed):
    """Per-layer K (and V) whose bytes are random (any bit pattern: NaNs, fp8 specials)."""
    gen = torch.Generator().manual_seed(seed)
    es = torch.empty(0, dtype=dtype).element_size()

    def one():
        raw = torch.randint(0, 256, (num_pages * page_size, heads, head_dim * es), dtype=torch.uint8, generator=gen)
        return raw.view(dtype).to(DEVICE)

    return [one() for _ in range(layers)], ([one() for _ in range(layers)] if has_v else None)


def clone(ts):
    return None if ts is None else [t.clone() for t in ts]


def raw(ts) -> list[bytes]:
    return [] if ts is None else [t.view(torch.uint8).cpu().numpy().tobytes() for t in ts]


def check_gather(k, v, pages, page_size, heads, offset=0):
    """Triton and torch gather the same bytes; the bytes around the region stay untouched."""
    n = region_nbytes(len(k), v is not None, len(pages) * page_size, heads[1] - heads[0], k[0].shape[2],
                      k[0].element_size())
    ref = torch.full((n + offset + 16,), 0xA5, dtype=torch.uint8, device=DEVICE)
    got = ref.clone()
    assert Gatherer().gather(k, v, pages, page_size, heads, ref[offset:]) == n
    assert TritonGatherer().gather(k, v, pages, page_size, heads, got[offset:]) == n
    assert torch.equal(got, ref)
    return ref[offset: offset + n]


def check_scatter(region, k, v, pages, page_size, heads):
    """Triton and torch scatter to identical caches; other heads' bytes are left as they were."""
    ref_k, ref_v, got_k, got_v = clone(k), clone(v), clone(k), clone(v)
    assert Scatterer().scatter(region, ref_k, ref_v, pages, page_size, heads) == region.numel()
    assert TritonScatterer().scatter(region, got_k, got_v, pages, page_size, heads) == region.numel()
    assert raw(got_k) == raw(ref_k) and raw(got_v) == raw(ref_v)
    assert raw(got_k) != raw(k)  # it wrote something (the region is random bytes)


# ----------------------------------------------------------------------------- mode and geometry

def test_kernels_run_on_the_gpu_or_interpreted():
    """On a GPU machine the kernels are compiled and every test here runs them on the GPU;
    without one (or with TRITON_INTERPRET=1) they run under the interpreter. Either way
    something runs them: compiled kernels with host tensors would leave them untested."""
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        assert not tk.interpreted(), "a GPU is here, yet the kernels are interpreted"
        assert DEVICE.type == "cuda"
        (k,), _ = make_cache(1, False, 1, 1, 1, 8, torch.bfloat16, 0)
        assert k.is_cuda
    else:
        assert tk.interpreted(), "TRITON_INTERPRET=1 did not take: triton was imported before tests/conftest.py"
        assert os.environ.get("TRITON_INTERPRET") == "1" and DEVICE.type == "cpu"


def test_tile_shape_powers_of_two_within_tile():
    for span in (1, 3, 9, 36, 128, 1000, 1024, 5000):
        block_r, block_w = tk.tile_shape(span)
        assert block_r & (block_r - 1) == 0 and block_w & (block_w - 1) == 0
        assert block_r * block_w <= 4096 and block_w >= min(span, 1024)


@pytest.mark.parametrize("head_dim, dtype, offset, word", [
    (128, torch.bfloat16, 0, torch.int64), (72, torch.float8_e4m3fn, 0, torch.int64),
    (3, torch.bfloat16, 0, torch.int16), (3, torch.int8, 0, torch.uint8), (3, torch.float32, 0, torch.int32),
    (128, torch.bfloat16, 4, torch.int32), (128, torch.bfloat16, 1, torch.uint8),
])
def test_word_is_widest_unit_dividing_row_and_alignment(head_dim, dtype, offset, word):
    k, _ = make_cache(1, False, 1, 1, 1, head_dim, dtype, 0)
    region = torch.empty(64 + head_dim * 8, dtype=torch.uint8, device=DEVICE)[offset:]
    assert unit_for(head_dim * k[0].element_size(), [*k, region]).dtype == word


def test_one_launch_per_region_with_address_table(monkeypatch):
    """All layers, K and V, all pages: one launch whose grid covers 2 x layers blocks."""
    launches = []

    class Spy:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(table, region, *args, **kw):
                launches.append((grid, table.cpu().tolist(), region.dtype, kw["GATHER"]))
                return self.kernel[grid](table, region, *args, **kw)
            return launch

    monkeypatch.setattr(tk, "copy_rows_kernel", Spy(tk.copy_rows_kernel))
    k, v = make_cache(5, True, 6, 4, 4, 64, torch.bfloat16, 1)
    region = check_gather(k, v, [4, 0, 2], 4, (1, 3))
    dk, dv = clone(k), clone(v)
    TritonScatterer().scatter(region, dk, dv, [5, 1, 3], 4, (2, 4))
    assert len(launches) == 2
    for (grid, table, word, gather), cache, want in zip(launches, (k + v, dk + dv), (True, False), strict=True):
        assert grid[1] == 10 and table == [t.data_ptr() for t in cache] and word == torch.int64
        assert gather is want   # the direction is the kernel's compile-time constant


# ----------------------------------------------------------------------------- bit-exact matrix

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_round_trip_head_slice_bit_exact(dtype, head_dim, page_size):
    """Unsorted pages with a repeat, a head sub-range, into a different head range of the decode side."""
    k, v = make_cache(2, True, 5, page_size, 4, head_dim, dtype, head_dim * page_size)
    region = check_gather(k, v, [3, 0, 4, 0, 2], page_size, (1, 3))
    dk, dv = make_cache(2, True, 7, page_size, 3, head_dim, dtype, 99)
    check_scatter(region, dk, dv, [6, 1, 4, 0, 5], page_size, (1, 3))


@pytest.mark.parametrize("case", ["p_gt_d", "p_lt_d", "equal", "replicated", "mla"])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_tp_geometries(case, page_size):
    """Head ranges as the TP mapping produces them (docs/protocol.md section 1)."""
    dt, hd, has_v = torch.bfloat16, 128, True
    if case == "p_gt_d":        # prefill tp 4, decode tp 2, 8 heads: all 2 heads -> heads [2, 4) of 4
        src_heads, gather, dst_heads, scatter = 2, (0, 2), 4, (2, 4)
    elif case == "p_lt_d":      # prefill tp 2, decode tp 4: heads [2, 4) of 4 -> all 2 heads
        src_heads, gather, dst_heads, scatter = 4, (2, 4), 2, (0, 2)
    elif case == "equal":
        src_heads, gather, dst_heads, scatter = 4, (0, 4), 4, (0, 4)
    elif case == "replicated":  # 2 heads, tp 8 on both sides: one local head each
        src_heads, gather, dst_heads, scatter = 1, (0, 1), 1, (0, 1)
    else:                       # MLA: one latent "head" of 576 (512 + 64 rope), no V
        src_heads, gather, dst_heads, scatter, hd, has_v = 1, (0, 1), 1, (0, 1), 576, False
    k, v = make_cache(3, has_v, 6, page_size, src_heads, hd, dt, page_size)
    region = check_gather(k, v, [5, 2, 3, 0], page_size, gather)
    dk, dv = make_cache(3, has_v, 9, page_size, dst_heads, hd, dt, 7)
    check_scatter(region, dk, dv, [8, 0, 4, 1], page_size, scatter)


@pytest.mark.parametrize("offset", [1, 2, 4, 8])
def test_misaligned_regions_narrow_the_word(offset):
    k, v = make_cache(2, True, 4, 4, 2, 96, torch.float16, offset)
    region = check_gather(k, v, [1, 3, 0], 4, (1, 2), offset=offset)
    ring = torch.empty(region.numel() + offset, dtype=torch.uint8, device=DEVICE)[offset:]
    ring.copy_(region)
    check_scatter(ring, k, v, [2, 0, 3], 4, (0, 1))


def test_long_rows_loop_over_words():
    """A head range wider than one tile step (span > 1024 words) goes round the word loop."""
    k, v = make_cache(1, True, 3, 2, 8, 256, torch.float32, 5)  # 8 heads x 128 words = 1024 ...
    region = check_gather(k, v, [2, 0], 2, (0, 8))
    k2, v2 = make_cache(1, True, 3, 2, 9, 256, torch.float32, 6)  # ... 9 heads: 1152 words
    check_gather(k2, v2, [1, 2, 0], 2, (0, 9))
    check_scatter(region, k, v, [1, 2], 2, (0, 8))


def test_empty_page_list_launches_nothing():
    k, v = make_cache(1, True, 2, 4, 2, 8, torch.bfloat16, 0)
    out = torch.zeros(8, dtype=torch.uint8, device=DEVICE)
    assert TritonGatherer().gather(k, v, [], 4, (0, 2), out) == 0
    assert TritonScatterer().scatter(out[:0], k, v, np.zeros(0, np.int64), 4, (0, 2)) == 0
    assert out.sum().item() == 0


def test_address_table_follows_a_replaced_cache():
    """A memoised cache whose tensors were swapped (set_) gets a new table, not stale pointers."""
    g = TritonGatherer()
    k, v = make_cache(2, True, 3, 2, 2, 16, torch.bfloat16, 3)
    check_gather(k, v, [2, 1], 2, (0, 2))
    out = torch.empty(region_nbytes(2, True, 4, 2, 16, 2), dtype=torch.uint8, device=DEVICE)
    g.gather(k, v, [2, 1], 2, (0, 2), out)
    k2, v2 = make_cache(2, True, 3, 2, 2, 16, torch.bfloat16, 4)
    for a, b in zip(k + v, k2 + v2):
        a.set_(b)
    ref = torch.empty_like(out)
    Gatherer().gather(k, v, [2, 1], 2, (0, 2), ref)
    g.gather(k, v, [2, 1], 2, (0, 2), out)
    assert torch.equal(out, ref)


# ----------------------------------------------------------------------------- errors

def errors(call_torch, call_triton):
    with pytest.raises((ValueError, TypeError)) as ref:
        call_torch()
    with pytest.raises(ref.type) as got:
        call_triton()
    assert str(got.value) == str(ref.value)
    return str(got.value)


@pytest.mark.parametrize("bad", ["small_out", "heads", "page_oob", "float_pages", "dtype_mix", "page_size",
                                 "region_device", "region_dtype"])
def test_gather_errors_match_reference(bad):
    k, v = make_cache(2, True, 3, 2, 4, 8, torch.bfloat16, 0)
    pages, heads, ps = [0, 2], (1, 3), 2
    out = torch.empty(region_nbytes(2, True, 4, 2, 8, 2), dtype=torch.uint8, device=DEVICE)
    if bad == "small_out":
        out = out[:-1]
    elif bad == "heads":
        heads = (3, 5)
    elif bad == "page_oob":
        pages = [0, 3]
    elif bad == "float_pages":
        pages = np.array([0.0, 1.0])
    elif bad == "dtype_mix":
        v = [v[0], v[1].view(torch.float16)]
    elif bad == "page_size":
        ps = 1.5
    elif bad == "region_device":   # a region on another device than the cache
        out = torch.empty(out.numel(), dtype=torch.uint8, device="meta")
    else:
        out = out.view(torch.int16)
    msg = errors(lambda: Gatherer().gather(k, v, pages, ps, heads, out),
                 lambda: TritonGatherer().gather(k, v, pages, ps, heads, out))
    if bad == "region_device":
        assert "device mismatch" in msg


@pytest.mark.parametrize("bad", ["duplicate_pages", "small_src", "heads"])
def test_scatter_errors_match_reference(bad):
    k, v = make_cache(2, True, 3, 2, 4, 8, torch.bfloat16, 0)
    pages, heads = [0, 2], (1, 3)
    src = torch.zeros(region_nbytes(2, True, 4, 2, 8, 2), dtype=torch.uint8, device=DEVICE)
    if bad == "duplicate_pages":
        pages = [2, 2]
    elif bad == "small_src":
        src = src[:-2]
    else:
        heads = (2, 2)
    before = raw(k) + raw(v)
    errors(lambda: Scatterer().scatter(src, k, v, pages, 2, heads),
           lambda: TritonScatterer().scatter(src, k, v, pages, 2, heads))
    assert raw(k) + raw(v) == before


# ----------------------------------------------------------------------------- choosing the kernels

@pytest.mark.parametrize("setting, device, want", [
    (None, "cpu", "torch"), ("auto", "cpu", "torch"), ("torch", "cuda:0", "torch"), ("auto", "cuda:0", "triton"),
    ("triton", "cuda:1", "triton"), ("triton", "cpu", "triton"), (" Triton ", "cpu", "triton"),
])
def test_kernel_choice(monkeypatch, setting, device, want):
    """The choice for each setting and device. Triton on a CPU cache holds under Triton's
    interpreter only (the next tests cover the compiled case), so that case says it is
    interpreted: on a GPU machine, where the kernels are compiled, the same rows hold."""
    if device == "cpu" and want == "triton":
        monkeypatch.setattr(tk, "interpreted", lambda: True)
    if setting is None:
        monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(kernels.ENV_VAR, setting)
    assert kernels.kernel_choice(device) == want
    g, s = kernels.make_gatherer(device), kernels.make_scatterer(device)
    assert (type(g), type(s)) == ((TritonGatherer, TritonScatterer) if want == "triton" else (Gatherer, Scatterer))
    assert not torch.cuda.is_initialized() or DEVICE.type == "cuda"  # choosing touches no GPU


def test_kernel_choice_bad_value(monkeypatch):
    monkeypatch.setenv(kernels.ENV_VAR, "cuda")
    with pytest.raises(ValueError, match="KVSTAGE_STAGING_KERNELS='cuda': expected one of auto, torch, triton"):
        kernels.make_gatherer("cpu")


def test_triton_on_cpu_without_interpreter_is_an_error(monkeypatch):
    monkeypatch.setenv(kernels.ENV_VAR, "triton")
    monkeypatch.setattr(tk, "interpreted", lambda: False)
    with pytest.raises(ValueError, match="needs a CUDA KV cache, got one on cpu"):
        kernels.make_scatterer("cpu")
    assert kernels.kernel_choice("cuda:0") == "triton"


def test_triton_missing(monkeypatch, caplog):
    """auto on CUDA falls back to torch with one warning; triton by name is an error."""
    monkeypatch.setitem(sys.modules, "kvstage.staging.triton_kernels", None)  # import -> ImportError
    monkeypatch.setattr(kernels, "_warned_fallback", False)
    monkeypatch.setenv(kernels.ENV_VAR, "auto")
    with caplog.at_level(logging.WARNING, logger=kernels.__name__):
        assert type(kernels.make_gatherer("cuda:0")) is Gatherer
        assert type(kernels.make_scatterer("cuda:0")) is Scatterer
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["KVSTAGE_STAGING_KERNELS=auto"]
    monkeypatch.setenv(kernels.ENV_VAR, "triton")
    with pytest.raises(RuntimeError, match="triton cannot be imported"):
        kernels.make_gatherer("cuda:0")


def test_workers_fail_at_construction_on_a_bad_setting(monkeypatch):
    from kvstage.staging.workers import ScatterWorker, TransferWorkers

    monkeypatch.setenv(kernels.ENV_VAR, "fast")
    k, v = make_cache(1, True, 2, 2, 2, 8, torch.bfloat16, 0)
    with pytest.raises(ValueError, match="KVSTAGE_STAGING_KERNELS"):
        TransferWorkers([], k, v, 2, submit=None, report=None)
    with pytest.raises(ValueError, match="KVSTAGE_STAGING_KERNELS"):
        ScatterWorker(k, v, 2, report=None)


# ----------------------------------------------------------------------------- ahead-of-time compile

def test_aot_compile_for_sm80_and_sm90(tmp_path):
    """Lower the kernel in both directions for every word size to PTX and a cubin (bundled ptxas),
    no GPU needed."""
    env = {key: val for key, val in os.environ.items() if key != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    script = Path(__file__).with_name("aot_compile_kernels.py")
    proc = subprocess.run([sys.executable, str(script), "80", "90"], env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    bits = {"int64": 64, "int32": 32, "int16": 16, "uint8": 8}
    assert {(r["cap"], r["kernel"], r["direction"], r["word"]) for r in rows} == {
        (cap, "copy_rows_kernel", direction, word) for cap in (80, 90) for direction in ("gather", "scatter")
        for word in bits}
    for r in rows:
        assert r["cubin_elf"] and r["cubin_bytes"] > 1000 and r["ptx_target"] and r["ptx_entry"], r
        assert r["store_bits"] == [bits[r["word"]]], r  # whole words, never narrower stores
    ptx = {(r["cap"], r["direction"], r["word"]): r["ptx_sha256"] for r in rows}
    for cap in (80, 90):  # the GATHER constexpr specialises the kernel: two different programs
        assert all(ptx[cap, "gather", word] != ptx[cap, "scatter", word] for word in bits)


def test_cpu_workers_do_not_import_triton():
    """The CPU product path (auto) never imports triton: rank processes stay light."""
    code = ("import sys, torch\n"
            "from kvstage.staging.kernels import make_gatherer, make_scatterer\n"
            "from kvstage.staging.workers import ScatterWorker\n"
            "from kvstage.staging.workers import TransferWorkers\n"
            "make_gatherer('cpu'); make_scatterer('cpu')\n"
            "print('triton' in sys.modules)\n")
    env = {key: val for key, val in os.environ.items() if key != kernels.ENV_VAR}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "False"


@pytest.mark.parametrize("head_dim", [576, 72])
def test_a_relayout_gathers_pool_slots_of_a_paged_mla_cache_token_by_token(head_dim):
    """A DCP relayout (token_mapping.Relayout) gathers pool slots of a cache of 16-token pages at
    page size 1: every other token of three scattered pages, in order, as the tokens themselves
    (both kernels, bit-exact)."""
    k, _ = make_cache(3, False, 8, 16, 1, head_dim, torch.bfloat16, head_dim)
    slots = np.concatenate([np.arange(p * 16, p * 16 + 16, 2) for p in (5, 1, 6)])
    region = check_gather(k, None, slots, 1, (0, 1))
    want = torch.cat([t[torch.as_tensor(slots, device=DEVICE)].reshape(-1).view(torch.uint8) for t in k])
    assert torch.equal(region, want)
