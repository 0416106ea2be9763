"""Mooncake with VRAM KV caches: the CUDA build (mooncake-transfer-engine-cuda13) registers VRAM;
staged (P2 -> D1) and direct (P1 -> D2), bit-exact. Collected only where examples/gpu_check.py
found that build installed (it sets KVSTAGE_GPU_MOONCAKE=1; tests/gpu/conftest.py)."""

from __future__ import annotations

import pytest
from engine_cases import TEST_TIMEOUTS, Case, Topo, problems, random_rooms, run_cases


@pytest.mark.timeout(600)
def test_mooncake_vram_staged_and_direct_bit_exact():
    cases = []
    for topo, staging, path in ((Topo(P=2, D=1, H=4), True, "staged"), (Topo(P=1, D=2, H=4), False, "direct")):
        case = Case(topo=topo, page_size=16, dtype="bfloat16", staging=staging, backend="mooncake",
                    rooms=random_rooms(71, 6, 16, base=9200), label="gpu")
        case.extra = {"path": path, "timeouts": {**TEST_TIMEOUTS, "write": 120.0, "lease": 60.0}}
        case.prefill_extra = case.decode_extra = {"device": "cuda:0"}
        cases.append(case)
    results, codes, logs, _ = run_cases(cases, timeout=300)
    bad = problems(results, codes, logs)
    assert not bad, "\n".join(bad[:10])
