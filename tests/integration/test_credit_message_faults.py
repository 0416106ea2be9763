"""Ring credits with a room id aborted and used again while the decode ranks' control messages
are duplicated and held back (docs/protocol.md, "Ring credits", the finding of 2026-11-27):
prefill TP 1 -> decode TP 2 on the staged path (forced), credits on, real NIXL between
processes. Three fault seeds, one engine pair each, in one cluster.

Each use starts once the one before it ended on every rank (the room-reuse contract). A message
of an earlier use may still reach a later use's sender; whatever it does, every use must end
Success bit-exact or Failed with a reason on every rank, none may wait for the driver (whose
timeout is far below the 600 s room deadline: a hang fails the test as a driver timeout), and
no ring region may be left held but the credits of the live rank.
"""

import pytest
from engine_cases import TEST_TIMEOUTS, Case, Topo, each_rank, problems, run_cases

pytestmark = pytest.mark.integration

SEEDS = (3, 4, 6)
MSG_FAULTS = {"dup_msgs": 0.5, "reorder_msgs": 0.5, "hold_s": 0.5}
# metadata: how long a decode room's metadata may wait for a prefill sender (then it fails)
TIMEOUTS = {**TEST_TIMEOUTS, "lease": 2.0, "heartbeat": 0.25, "connect": 3.0, "close": 3.0, "arrival": 3.0,
            "metadata": 3.0, "write": 5.0, "watermark": 10.0}


def uses(tmp_path, seed: int) -> list[dict]:
    d = tmp_path / f"s{seed}"
    d.mkdir()
    out = [
        {"room": 42, "pages": 6, "chunks": [2, 2, 2], "chunk_delay_s": 0.3, "abort_after_s": 0.2,
         "touch_after_abort": str(d / "use0-aborted-{rank}"),
         "hold_last_until": [str(d / "use0-aborted-0"), str(d / "use0-aborted-1")], "pattern_key": 1042},
        {"room": 42, "pages": 6, "chunks": [2, 2, 2], "pattern_key": 2042, "drain_before": True},
        {"room": 42, "pages": 3, "chunks": [1, 2], "pattern_key": 3042, "drain_before": True},
    ]
    ranks = ["prefill-0", "decode-0", "decode-1"]
    for i, use in enumerate(out):   # a use starts once the one before it ended on every rank
        use["done_file"] = str(d / f"use{i}-{{role}}-{{rank}}")
        if i:
            use["start_after_file"] = [str(d / f"use{i - 1}-{r}") for r in ranks]
    return out


@pytest.mark.timeout(120)
def test_a_reused_room_id_under_duplicated_and_held_back_messages_never_hangs_nor_leaks(tmp_path):
    cases = []
    for seed in SEEDS:
        case = Case(topo=Topo(P=1, D=2, H=4), staging=True, backend="nixl", rooms=uses(tmp_path, seed),
                    label=f"seed{seed}",
                    extra={"path": "staged", "credits": True, "timeouts": TIMEOUTS, "run_timeout_s": 40})
        case.rank_extra = {("decode", r): {"faults": {**MSG_FAULTS, "seed": seed}} for r in range(2)}
        cases.append(case)
    results, codes, logs, _ = run_cases(cases, timeout=60)
    assert not any(codes), problems(results, codes, logs, expect_success=False)[:10]
    for case, side, res in each_rank(cases, results):
        rooms = res["rooms"]
        assert len(rooms) == 3, (case.label, side, rooms)   # every use ended (none left to the driver)
        for r in rooms:
            assert r["kind"] != "driver_timeout", (case.label, side, r)
            assert r["state"] in ("Success", "Failed"), (case.label, side, r)
            if r["state"] == "Failed":
                assert r["failure"], (case.label, side, r)
            elif side == "decode":
                assert r["verified"], (case.label, side, r)   # bit-exact, with its own use's bytes
        assert rooms[0]["state"] == "Failed", (case.label, side, rooms[0])   # the aborted use
        if side == "decode":
            st = res["stats"]
            # no region is held but the live rank's credits (ring_live_bytes also counts regions freed behind a
            # credit whose return is still on its way)
            assert st["ring_held_bytes"] == st["ring_credit_bytes"], (case.label, st)
