"""Decode context parallel on VRAM, real NIXL: prefill TP 2 -> decode TP 2 DCP 2 (MLA) with the
KV caches on the GPU, as token runs written from the cache and relayouted (each decode rank's
tokens gathered at page size 1 by the compiled Triton kernel into a VRAM staging buffer, then
written as the decode's slot runs), each request with an aux row: every token bit-exact on the
rank that owns it, the relayout taken where it should be, and its kernels built at start. Run by `make gpu-check` only
(tests/gpu/conftest.py)."""

from __future__ import annotations

import pytest
from dcp_cases import check_moved, split_case
from engine_cases import problems, run_cases


@pytest.mark.timeout(600)
def test_dcp_on_vram_moves_bit_exact_as_runs_and_relayouted():
    """Token runs with a host aux row; relayouted (ten flows of two tokens or more); relayouted
    with a host aux row and 8 KiB buffers, where only the 61-token room's first writes (one
    layer each) are relayouted: every other write carries the aux item, host memory beside the
    VRAM KV, and goes as token runs."""
    moved = [split_case("nixl", 1, 4100, aux=True, device="cuda:0"),
             split_case("nixl", 1, 4200, buffer_bytes=1 << 20, device="cuda:0"),
             split_case("nixl", 1, 4300, aux=True, buffer_bytes=8192, head_dim=128, device="cuda:0")]
    results, codes, logs, _ = run_cases(moved, timeout=300)
    bad = problems(results, codes, logs)
    assert not bad, "\n".join(bad[:10])
    check_moved(moved, results, {moved[1].name: 10, moved[2].name: 2})
    for case in moved[1:]:   # an MLA prefill with buffers built the relayout's kernels (page size 1) at start
        assert all(p["stats"].get("kernel_warmup_s", 0) > 0 for p in results[case.name]["prefill"]), case.name
