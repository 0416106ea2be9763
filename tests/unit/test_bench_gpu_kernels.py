"""examples/bench_gpu_kernels.py (its code: support/bench_gpu_kernels.py) without a GPU: its smoke mode runs end to end under Triton's
interpreter and writes what a GPU run would (figures aside), its byte counts follow the region
layout, its bit-exactness check catches a wrong gather or a scatter outside its head range, and
without CUDA it refuses to run (exit 2) instead of timing something else.

The smoke run is a subprocess with TRITON_INTERPRET=1, as CI would run the script; the verify
checks run in this process on the kernels as tests/conftest.py set them up (interpreted here,
compiled on a GPU machine, where they run on cuda).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from kvstage.staging import triton_kernels as tk
from kvstage.support import bench_gpu_kernels as bench

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "bench_gpu_kernels.py"

DEVICE = torch.device("cuda" if torch.cuda.is_available() and not tk.interpreted() else "cpu")
SMOKE = {c.name: c for c in bench.SMOKE_CASES}

# Region bytes of the smoke cases, spelled out here rather than taken from the script:
# K/V blocks x layers x tokens x heads moved x head_dim x 2 bytes (bf16). Chunks of 16 tokens are
# 4 pages of 4; 10 tokens round up to 3 whole pages, 12 tokens.
EXPECTED_BYTES = {
    ("gqa4-ps4-tp1to2", 16): 2 * 2 * 16 * 2 * 8 * 2,    # half of 4 heads gathered, head_dim 8
    ("gqa4-ps4-tp2to1", 16): 2 * 2 * 16 * 2 * 12 * 2,   # all 2 heads, into heads [2, 4) of 4
    ("mla-ps4", 16): 1 * 2 * 16 * 1 * 36 * 2,           # MLA: K only, one 36-wide head
    ("gqa4-ps4-tp1to2", 10): 2 * 2 * 12 * 2 * 8 * 2,
    ("gqa4-ps4-tp2to1", 10): 2 * 2 * 12 * 2 * 12 * 2,
    ("mla-ps4", 10): 1 * 2 * 12 * 1 * 36 * 2,
}


def test_smoke_run_verifies_and_writes_the_json(tmp_path):
    out = tmp_path / "gpu_kernels.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    argv = [sys.executable, str(SCRIPT), "--smoke", "--tokens", "16,10", "--iters", "1", "--json", str(out)]
    res = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "NOT GPU figures" in res.stdout
    doc = json.loads(out.read_text())
    meta = doc["meta"]
    assert meta["smoke"] is True and meta["timer"] == "time.perf_counter" and meta["goal"] == 0.7
    assert meta["device"] == "cpu" and meta["iters"] == 1 and meta["warmup"] == 1
    got = {(c["name"], c["tokens_asked"]): c for c in doc["cases"]}
    assert len(doc["cases"]) == 6 and set(got) == set(EXPECTED_BYTES)
    for (name, tokens), c in got.items():
        assert c["verified"] is True
        assert c["bytes"] == EXPECTED_BYTES[(name, tokens)] > 0
        # the record's own geometry gives the same count (kv x layers x tokens x heads x head_dim x 2)
        heads = c["gather"][1] - c["gather"][0]
        assert heads == c["scatter"][1] - c["scatter"][0]
        assert c["kv"] * c["layers"] * c["tokens"] * heads * c["head_dim"] * c["elem_size"] == c["bytes"]
        assert c["pages"] * c["page_size"] == c["tokens"] == {16: 16, 10: 12}[tokens]
        for op in ("gather", "scatter", "bare_gather", "bare_scatter", "copy"):
            assert c[f"{op}_gbps"] > 0 and c[f"{op}_us"] > 0 and c[f"{op}_host_us"] > 0
        for op in ("gather", "scatter", "bare_gather", "bare_scatter"):
            assert c[f"{op}_over_copy"] == pytest.approx(c[f"{op}_gbps"] / c["copy_gbps"])


class CorruptGatherer(tk.TritonGatherer):
    """Gathers, then flips one bit in the middle of the region."""

    def gather(self, k, v, pages, page_size, heads, out):
        n = super().gather(k, v, pages, page_size, heads, out)
        out[n // 2] ^= 1
        return n


class StrayScatterer(tk.TritonScatterer):
    """Scatters, then also changes one byte of head 0 of the first page: outside [2, 4)."""

    def scatter(self, src, k, v, pages, page_size, heads):
        n = super().scatter(src, k, v, pages, page_size, heads)
        k[0].view(torch.uint8)[int(pages[0]) * page_size, 0, 0] ^= 1
        return n


def buffers(name: str):
    return bench.make_buffers(SMOKE[name], 16, DEVICE, seed=3)


def test_verify_passes_with_the_real_kernels():
    for name, case in SMOKE.items():
        assert bench.verify(case, buffers(name), tk.TritonGatherer(), tk.TritonScatterer()) == [], name


def test_verify_detects_a_corrupted_gather():
    problems = bench.verify(SMOKE["gqa4-ps4-tp1to2"], buffers("gqa4-ps4-tp1to2"), CorruptGatherer(),
                            tk.TritonScatterer())
    assert problems == ["gather: 1 of 2048 bytes differ from the torch reference"]


def test_verify_detects_a_scatter_outside_its_head_range():
    case = SMOKE["gqa4-ps4-tp2to1"]
    assert case.scatter == (2, 4)
    problems = bench.verify(case, buffers("gqa4-ps4-tp2to1"), tk.TritonGatherer(), StrayScatterer())
    assert problems == ["scatter: decode cache tensor 0 (K layers, then V) differs from the torch reference"]


def test_a_failed_verification_exits_before_timing():
    broken = types.SimpleNamespace(**vars(tk))
    broken.TritonGatherer = CorruptGatherer
    args = types.SimpleNamespace(warmup=1, iters=1)
    with pytest.raises(SystemExit) as exc:
        bench.run_case(broken, SMOKE["mla-ps4"], 16, DEVICE, args)
    assert "NOT bit-exact, not timed" in str(exc.value.code) and "gather: 1 of 2304 bytes" in str(exc.value.code)


def test_without_cuda_it_exits_2_saying_a_gpu_is_needed(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(SystemExit) as exc:
        bench.main(["--tokens", "2048"])
    assert exc.value.code == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--tokens", "0"], ["--tokens", "2048,x"], ["--iters", "0"], ["--warmup", "1.5"],
                                  ["--device", "nonsense"], ["--smoke", "--device", "cuda"], ["--cases", "nope"],
                                  ["--host-only", "--device", "cuda"]])
def test_bad_arguments_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(argv)
    assert exc.value.code == 2 and "error:" in capsys.readouterr().err


def test_host_only_times_the_calls_with_the_launch_off(tmp_path):
    """--host-only: host microseconds per call on the CPU; no kernel runs, so nothing is written
    into the region (figures aside: no timed asserts)."""
    out = tmp_path / "host.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    argv = [sys.executable, str(SCRIPT), "--host-only", "--smoke", "--tokens", "16", "--iters", "2", "--warmup", "1",
            "--json", str(out)]
    res = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "kernel launch off" in res.stdout
    doc = json.loads(out.read_text())
    assert doc["meta"]["host_only"] is True and doc["meta"]["iters"] == 2
    assert {c["name"] for c in doc["cases"]} == set(SMOKE)
    for c in doc["cases"]:
        assert c["bytes"] == EXPECTED_BYTES[(c["name"], 16)]
        assert c["piece_pages"] == 1   # 4 pages cut in 4 pieces
        for op in ("gather", "scatter", "gather_piece", "scatter_piece"):
            assert c[f"{op}_host_us"] > 0 and c[f"{op}_host_mean_us"] > 0 and c[f"{op}_first_us"] > 0


def test_launches_off_runs_no_kernel_and_restores_the_launch():
    b = buffers("mla-ps4")
    launch = tk.KernelLaunch.__call__
    g = tk.TritonGatherer()
    b.region.fill_(0x5A)
    with bench.launches_off(tk):
        assert g.gather(b.src_k, b.src_v, b.src_pages, 4, (0, 1), b.region) == b.nbytes
    assert bool((b.region == 0x5A).all())      # planned, not copied
    assert tk.KernelLaunch.__call__ is launch
    g.gather(b.src_k, b.src_v, b.src_pages, 4, (0, 1), b.region)
    assert not bool((b.region == 0x5A).all())
