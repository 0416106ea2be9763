"""The path choice between real processes (docs/path_choice.md): equal TP forced onto the staged
path (whole pages through the ring) bit-exact; the automatic choice with costs measured at
start (a calibration per rank over the real backend) bit-exact, each request reporting its path,
why, and its predicted and actual time in stats()."""

import pytest
from engine_cases import TEST_TIMEOUTS, Case, Topo, problems, random_rooms, run_cases

pytestmark = pytest.mark.integration

MOONCAKE_TIMEOUTS = {**TEST_TIMEOUTS, "write": 120.0, "lease": 60.0}


def _case(topo: Topo, backend: str, path: str, seed: int) -> Case:
    extra = {"path": path, "calibrate": True}
    if backend == "mooncake":
        extra["timeouts"] = MOONCAKE_TIMEOUTS
    return Case(topo=topo, page_size=16, dtype="bfloat16", staging=True, backend=backend, extra=extra,
                rooms=random_rooms(seed, 4, 16), label=f"{path}-{backend}")


@pytest.mark.timeout(400)
def test_equal_tp_staged_and_the_measured_choice_are_bit_exact():
    forced = [_case(Topo(P=1, D=1, H=2), "nixl", "staged", 1), _case(Topo(P=2, D=2, H=4), "mooncake", "staged", 2)]
    auto = [_case(Topo(P=1, D=1, H=2), "nixl", "auto", 3), _case(Topo(P=1, D=2, H=4), "mooncake", "auto", 4)]
    results, codes, logs, _ = run_cases(forced + auto, timeout=300)
    bad = problems(results, codes, logs)
    assert not bad, "\n".join(bad[:20])
    for case in forced + auto:
        rooms = len(case.rooms)
        for res in results[case.name]["decode"]:
            assert all(r["verified"] is True for r in res["rooms"]), case.name
            st = res["stats"]
            assert sum(st.get("path_choices", {}).values()) == rooms, (case.name, st.get("path_choices"))
            if case in forced:
                assert st["path_choices"] == {"staged": rooms} and st["path_reasons"] == {"forced": rooms}
                assert st["scatters"], case.name          # whole pages went through the ring
            else:
                # measured at start: every request predicted, its predicted and actual time summed
                warned = [line for text in logs.values() for line in text.splitlines()
                          if "measuring the path costs failed" in line]
                assert st["path_reasons"] == {"predicted": rooms}, (case.name, st["path_reasons"], warned)
                assert set(st["path_predicted_s"]) == set(st["path_actual_s"]) == set(st["path_choices"])
                assert all(v > 0 for v in st["path_predicted_s"].values())
        for res in results[case.name]["prefill"]:
            st = res["stats"]
            if case in forced:
                assert st.get("staged_writes", 0) == st.get("write_requests", 0) > 0, case.name
            else:
                assert st["calibration_s"] > 0, case.name
