"""The path choice with VRAM KV caches (docs/path_choice.md), real NIXL, one process per rank on
GPU 0: equal TP forced onto the staged path (whole pages through a VRAM ring) and the choice from
costs measured at start (probe writes on VRAM) at equal and unequal TP, bit-exact, every request
predicted. Run by `make gpu-check` only (tests/gpu/conftest.py)."""

from __future__ import annotations

import pytest
from engine_cases import Case, Topo, problems, random_rooms, run_cases


def _case(topo: Topo, path: str, seed: int, backend: str = "nixl") -> Case:
    case = Case(topo=topo, page_size=16, dtype="bfloat16", staging=True, backend=backend,
                rooms=random_rooms(seed, 6, 16, base=9100), label=f"{path}-gpu")
    case.extra = {"path": path, "calibrate": True}
    case.prefill_extra = case.decode_extra = {"device": "cuda:0"}
    return case


def check(cases: list[Case]) -> None:
    results, codes, logs, _ = run_cases(cases, timeout=300)
    bad = problems(results, codes, logs)
    assert not bad, "\n".join(bad[:10])
    for case in cases:
        for res in results[case.name]["decode"]:
            st = res["stats"]
            reasons = st.get("path_reasons", {})
            want = "forced" if case.extra["path"] == "staged" else "predicted"
            assert reasons == {want: len(case.rooms)}, (case.name, reasons)


@pytest.mark.timeout(600)
def test_equal_tp_staged_and_the_measured_choice_on_vram():
    check([_case(Topo(P=1, D=1, H=4), "staged", 61), _case(Topo(P=1, D=1, H=4), "auto", 62),
           _case(Topo(P=2, D=1, H=4), "auto", 63)])
