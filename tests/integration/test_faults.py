"""A fault-injecting wrapper around the real backends and the control plane drops,
duplicates, reorders and corrupts notifications and control messages on every rank. Every
room must end bit-exact or Failed with a reason: never corrupt, never hung."""

import pytest
from engine_cases import TEST_TIMEOUTS, Case, Topo, random_rooms, run_cases
from records import assert_exact

pytestmark = pytest.mark.integration

FAULTS = {"drop_tags": 0.03, "dup_tags": 0.1, "reorder_tags": 0.2, "corrupt_tags": 0.03,
          "drop_msgs": 0.03, "dup_msgs": 0.05, "reorder_msgs": 0.1, "corrupt_msgs": 0.03, "hold_s": 0.05}
DEADLINES = {**TEST_TIMEOUTS, "arrival": 2.0, "heartbeat": 0.25, "metadata": 20.0, "watermark": 10.0,
             "scatter": 5.0, "room": 60.0}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("backend,token", [("nixl", None), ("mooncake", "s3cret")])
def test_every_room_ends_exact_or_failed_under_injected_faults(backend, token):
    cases = []
    for i, (topo, staging) in enumerate(
        ((Topo(P=2, D=2, H=4), False), (Topo(P=4, D=2, H=8), True), (Topo(P=2, D=1, H=2), True))
    ):
        case = Case(
            topo=topo,
            page_size=16,
            dtype="bfloat16",
            staging=staging,
            backend=backend,
            rooms=random_rooms(31 + i, 24, 16, max_tokens=300),
            extra={"timeouts": DEADLINES, "run_timeout_s": 150},
        )
        case.rank_extra = {
            (role, r): {"faults": {**FAULTS, "seed": 100 * i + 10 * r + (role == "decode")}}
            for role in ("prefill", "decode")
            for r in range(4)
        }
        cases.append(case)
    results, codes, logs, _ = run_cases(cases, timeout=250, env={"KVSTAGE_AUTH_TOKEN": token} if token else None)
    assert not any(codes), codes
    outcomes = {"Success": 0, "Failed": 0}
    for case in cases:
        for side in ("prefill", "decode"):
            assert len(results[case.name][side]) == (case.topo.P if side == "prefill" else case.topo.D), side
            for res in results[case.name][side]:
                assert not res.get("error"), f"{res['name']}: {res['error']}\n{res.get('traceback')}"
                assert len(res["rooms"]) == len(case.rooms), "every room ended (none hung)"
                for r in res["rooms"]:
                    assert r["kind"] != "driver_timeout", r
                    assert r["state"] in outcomes, r
                    outcomes[r["state"]] += 1
                    if r["state"] == "Success":
                        assert_exact(side, r)  # decode: every byte checked; prefill: nothing to check
                    else:
                        assert r["failure"], r
        dec = [res["stats"] for res in results[case.name]["decode"]]
        # an injected duplicate is dropped as such, or, when its original was the room's last tag
        # and completed the room in the same batch, as a tag of a finished room
        assert sum(st.get("dropped_tags", {}).get(k, 0) for st in dec for k in ("duplicate", "finished_room")) > 0
    assert outcomes["Success"] > outcomes["Failed"], outcomes  # retransmission keeps most rooms alive
