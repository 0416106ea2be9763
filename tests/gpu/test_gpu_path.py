"""A VRAM KV cache beside a host (DRAM) aux pool, two processes per side, real NIXL: staged
(P2 -> D1, pool items copied through the bounce buffer into and out of the staging buffer) and
direct (P2 -> D2, the aux items in a DRAM-to-DRAM write of their own beside the VRAM KV write),
bit-exact. Run by `make gpu-check` only (tests/gpu/conftest.py)."""

from __future__ import annotations

import pytest
from engine_cases import Case, Topo, problems, random_rooms, run_cases

AUX = {"sharding": "replicated", "items": 24, "device": "cpu",
       "tensors": [["float32", [5]], ["int32", [3]], ["bfloat16", [40]]]}
SSM = {"sharding": "heads", "heads": 4, "items": 12, "device": "cuda:0", "tensors": [["float32", [6, 4]]]}


@pytest.mark.timeout(600)
def test_vram_cache_with_a_host_aux_pool_moves_bit_exact():
    cases = []
    for topo, staging in ((Topo(P=2, D=1, H=4), True), (Topo(P=2, D=2, H=4), False), (Topo(P=1, D=2, H=4), False)):
        case = Case(
            topo=topo,
            page_size=16,
            dtype="bfloat16",
            staging=staging,
            backend="nixl",
            rooms=random_rooms(53, 6, 16, base=9000),
        )
        case.pools = {"aux": AUX, "ssm": SSM}
        for r in case.rooms:
            r["pool_items"] = {"aux": 1, "ssm": 1}
        case.prefill_extra = case.decode_extra = {"device": "cuda:0"}
        cases.append(case)
    results, codes, logs, _ = run_cases(cases, timeout=300)
    bad = problems(results, codes, logs)
    assert not bad, "\n".join(bad[:10])
