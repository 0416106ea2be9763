"""Kernels ready before the first request (staging/warmup.py): which launches build every
variant a layout can use. On CPU (the interpreter, or the torch kernels) nothing is built."""

from __future__ import annotations

import torch

from kvstage.staging.warmup import warm_kernels, warm_variants


def test_every_head_split_of_both_directions_on_a_cuda_decode_rank():
    vs = warm_variants(role="decode", local_heads=8, num_pages=100, kernels="triton", device_type="cuda")
    sizes = {v.heads[1] - v.heads[0] for v in vs}
    assert sizes == {8, 4, 2, 1}                                    # every divisor: any peer TP's split
    assert {v.heads[0] for v in vs if v.heads[1] - v.heads[0] == 4} == {0, 4}   # at head 0 and further in
    assert {v.pages for v in vs} == {1, 3}
    assert {v.gather for v in vs} == {True, False}
    assert all(v.heads[1] <= 8 for v in vs)


def test_a_prefill_rank_only_gathers_and_small_caches_are_bounded():
    vs = warm_variants(role="prefill", local_heads=3, num_pages=2, kernels="triton", device_type="cuda")
    assert all(v.gather for v in vs)
    assert {v.heads for v in vs} == {(0, 3), (0, 1), (1, 2)} and {v.pages for v in vs} == {1, 2}


def test_nothing_to_build_on_cpu_or_on_the_torch_kernels():
    assert warm_variants(role="decode", local_heads=8, num_pages=100, kernels="torch", device_type="cuda") == ()
    assert warm_variants(role="decode", local_heads=8, num_pages=100, kernels="triton", device_type="cpu") == ()
    assert warm_variants(role="decode", local_heads=8, num_pages=0, kernels="triton", device_type="cuda") == ()
    k = [torch.zeros(64, 2, 16, dtype=torch.bfloat16)]
    assert warm_kernels(role="decode", k=k, v=k, page_size=16, local_heads=2, num_pages=4, region_bytes=4096) == (0, 0.0)


def test_the_launches_leave_the_cache_as_it_was(monkeypatch):
    """The shell's gather-then-scatter of the same pages and heads, run with the torch kernels on
    CPU in place of the CUDA ones: every byte of the cache is unchanged."""
    import kvstage.staging.warmup as w

    variants = warm_variants(role="decode", local_heads=4, num_pages=8, kernels="triton", device_type="cuda")
    monkeypatch.setattr(w, "warm_variants", lambda **kw: variants)
    g = torch.Generator().manual_seed(3)
    k = [torch.randint(-100, 100, (8 * 16, 4, 8), generator=g).to(torch.bfloat16) for _ in range(2)]
    v = [torch.randint(-100, 100, (8 * 16, 4, 8), generator=g).to(torch.bfloat16) for _ in range(2)]
    before = [t.clone() for t in k + v]
    region = 2 * 2 * 16 * 4 * 8 * 2      # K and V, 2 layers, 16 tokens, 4 heads x 8, bf16: one page
    launches, seconds = w.warm_kernels(role="decode", k=k, v=v, page_size=16, local_heads=4, num_pages=8,
                                       region_bytes=region)
    assert launches == len(variants) > 0 and seconds > 0
    assert all(torch.equal(a, b) for a, b in zip(before, k + v, strict=True))
