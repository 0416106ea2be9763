"""Ring credits under faults, between real processes (real NIXL, the real bootstrap server):
prefill TP 1 -> decode TP 1 on the staged path (forced), so every piece has one writer and goes
through the credits the decode rank gives (docs/protocol.md, "Ring credits"). Four processes at
most: the faults, not the topology, are what these cases add to test_failures.py and
test_lifecycle.py.

- A prefill rank killed while its writes into credits are in flight: the decode ranks fail its
  rooms with a reason within a lease, close its credits once its quarantine is over (the ring
  comes back whole), and serve the restarted rank's requests bit-exact through new credits.
- One room id aborted by the decode side mid-transfer, with writes into credits in flight, and
  used again: the aborted use fails on both sides, the later uses succeed with their own bytes,
  and no region is left but the credits the live rank holds.
- And without faults, a request larger than its credit: its first pieces go into the credit,
  the rest of its one chunk through the grant path (its remainder), bit-exact.
"""

import time

import pytest
from engine_cases import Case, Topo, each_rank, problems, run_cases
from live_stats import wait_for_stat
from test_failures import LEASE, assert_clean_exit, assert_failed_fast, assert_verified, rooms, rooms_of, wait_file

from kvstage.support.cluster import Cluster, rank_spec

pytestmark = pytest.mark.integration

FAST = {"lease": LEASE, "heartbeat": 0.25, "connect": 3.0, "bootstrap": 25.0, "close": 3.0, "arrival": 3.0,
        "metadata": 30.0, "write": 5.0, "watermark": 10.0}
GEOM = {"layers": 2, "heads": 2, "head_dim": 32, "dtype": "bfloat16", "page_size": 16, "pages": 512}
FIELDS = {"geometry": GEOM, "ring_mb": 1, "buffer_mb": 1, "inflight": 4, "timeouts": FAST, "run_timeout_s": 90,
          "staging": True, "calibrate": False, "path": "staged",
          "credits": True}


def credit_stats(st: dict) -> tuple[int, int]:
    """(credits granted, credit tags accepted) of a decode rank's stats."""
    return st.get("credits", {}).get("granted", 0), st.get("credit_tags", {}).get("ok", 0)


@pytest.mark.timeout(200)
def test_prefill_rank_killed_with_credit_writes_in_flight(tmp_path):
    started, release = str(tmp_path / "started"), str(tmp_path / "release")
    with Cluster() as cl:
        early, late = rooms(100, 4, True), rooms(200, 4, False)
        for r in early:
            r["hold_last_until"] = [release]   # no early room can finish before the kill; the late rooms start
                                               # after them (4 in flight), towards the restarted rank
        victim = cl.launch([rank_spec("prefill", 0, 1, early, "nixl", **FIELDS, started_file=started)], "p0-victim")
        live = tmp_path / "decode-live.json"
        decode = [cl.launch([rank_spec("decode", 0, 1, early + late, "nixl", **FIELDS, live_stats=str(live))], "d0")]
        wait_file(started)
        wait_for_stat(live, "bytes_received")   # writes into credits are landing
        killed_at = time.time()
        victim.kill()
        open(release, "w").close()
        restarted = cl.launch([rank_spec("prefill", 0, 1, late, "nixl", **FIELDS)], "p0-restarted")
        for p in decode + [restarted]:
            p.proc.wait(150)
        assert_clean_exit(decode + [restarted])
        for d in decode:
            assert_failed_fast(rooms_of(d), [r["room"] for r in early], killed_at, LEASE + 3)
            assert_verified(d, [r["room"] for r in late])
            (st,) = [res["stats"] for res in d.result()]
            granted, taken = credit_stats(st)
            assert granted >= 2 and taken >= len(late), st   # both incarnations wrote into credits
            # what is left of the ring is credits the restarted rank holds (its last return may be on its
            # way): the lost rank's credits closed, no room holds a region
            assert st["ring_held_bytes"] == st["ring_credit_bytes"], st


@pytest.mark.timeout(200)
def test_a_room_id_aborted_mid_transfer_and_reused_with_credits_in_flight(tmp_path):
    uses = [
        {"room": 42, "pages": 6, "chunks": [2, 2, 2], "chunk_delay_s": 0.3, "abort_after_s": 0.2,
         "touch_after_abort": str(tmp_path / "use0-aborted-{rank}"),
         "hold_last_until": [str(tmp_path / "use0-aborted-0")], "pattern_key": 1042},
        {"room": 42, "pages": 6, "chunks": [2, 2, 2], "pattern_key": 2042, "drain_before": True},
        {"room": 42, "pages": 3, "chunks": [1, 2], "pattern_key": 3042, "drain_before": True},
    ]
    ranks = ["prefill-0", "decode-0"]
    for i, use in enumerate(uses):   # a use starts once the one before it ended on every rank
        use["done_file"] = str(tmp_path / f"use{i}-{{role}}-{{rank}}")
        if i:
            use["start_after_file"] = [str(tmp_path / f"use{i - 1}-{r}") for r in ranks]
    case = Case(topo=Topo(P=1, D=1, H=4), page_size=16, dtype="bfloat16", staging=True, backend="nixl", rooms=uses,
                extra={"path": "staged", "credits": True})
    results, codes, logs, _ = run_cases([case], timeout=120)
    assert not any(codes), problems(results, codes, logs, expect_success=False)[:10]
    taken = 0
    for _, side, res in each_rank([case], results):
        assert [r["state"] for r in res["rooms"]] == ["Failed", "Success", "Success"], (side, res["rooms"])
        assert "abort" in res["rooms"][0]["failure"], res["rooms"][0]
        if side == "decode":
            assert [r["verified"] for r in res["rooms"][1:]] == [True, True], res["rooms"]
            st = res["stats"]
            taken += credit_stats(st)[1]
            assert st["ring_held_bytes"] == st["ring_credit_bytes"], st   # only credits of the live rank
    assert taken >= 1, "some writes went into credits"


@pytest.mark.timeout(200)
def test_a_request_larger_than_its_credit_goes_partly_by_credit_and_partly_by_grant():
    """96 pages of 8 KiB in one chunk (768 KiB) towards a 1 MiB ring: 256 KiB pieces (a quarter
    of the ring), a credit of at most half the ring for the one busy rank. The pieces that fit
    go into the credit, the rest is granted; every byte arrives once, bit-exact."""
    room = {"room": 700, "pages": 96, "chunks": [96]}
    case = Case(topo=Topo(P=1, D=1, H=4), page_size=16, dtype="bfloat16", staging=True, backend="nixl", rooms=[room],
                extra={"path": "staged", "credits": True, "ring_mb": 1, "buffer_mb": 1, "piece_mb": 0.25})
    results, codes, logs, _ = run_cases([case], timeout=120)
    bad = problems(results, codes, logs)
    assert not bad, "\n".join(bad[:10])
    (st,) = [res["stats"] for _, side, res in each_rank([case], results) if side == "decode"]
    by_credit = credit_stats(st)[1]
    assert st["bytes_received"] == 96 * 8 << 10, st
    assert by_credit >= 1 and st["tags_received"] - by_credit >= 1, st   # both paths carried pieces of it
    assert st["ring_held_bytes"] == st["ring_credit_bytes"], st
