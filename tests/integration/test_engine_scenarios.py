"""Order of creation, aborts from either side, and a layout mismatch, between real processes."""

import copy
import tempfile

import pytest
from engine_cases import TEST_TIMEOUTS, Case, Topo, problems, random_rooms, run_cases
from records import assert_exact

pytestmark = pytest.mark.integration


def by_room(results, case, side):
    out = {}
    for res in results[case.name][side]:
        for r in res["rooms"]:
            out.setdefault(r["room"], []).append(r)
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_creation_order_and_aborts(backend):
    """Senders created before and after the decode metadata arrives; aborts mid-transfer from
    the prefill side and from the decode side: the aborted room fails on both sides with a
    reason and is released, every other room is bit-exact."""
    made = []
    for topo, staging in ((Topo(P=2, D=2, H=4), False), (Topo(P=4, D=2, H=8), True), (Topo(P=2, D=4, H=8), True)):
        rooms = random_rooms(7, 12, 16, max_tokens=200)
        for r in rooms[1:4]:
            r["create_delay_s"] = 1.5          # decode metadata arrives before the sender exists
        for r in rooms[4:7]:
            r["init_delay_s"] = 1.5            # the sender exists long before the metadata
        rooms[7].update(pages=8, chunks=[2, 2, 2, 2], chunk_delay_s=0.3, abort_after_chunks=2)
        flag = tempfile.mktemp(prefix="kvstage-aborted-")
        rooms[8].update(pages=8, chunks=[2, 2, 2, 2], chunk_delay_s=0.2, abort_after_s=0.3,  # mid-transfer:
                        hold_last_until=[f"{flag}-{d}" for d in range(topo.D)],       # the last chunk waits
                        touch_after_abort=flag + "-{rank}")                            # for every abort
        rooms[9]["abort_before_init"] = True       # the prefill side must hear of it all the same
        made.append(Case(topo=topo, page_size=16, dtype="bfloat16", staging=staging, backend=backend, rooms=rooms,
                         extra={"timeouts": {**TEST_TIMEOUTS, "metadata": 40.0}}))
    results, codes, logs, _ = run_cases(made, timeout=200)
    bad = problems(results, codes, logs, expect_success=False)
    assert not bad, "\n".join(bad[:20])
    for case in made:
        pre, dec = by_room(results, case, "prefill"), by_room(results, case, "decode")
        every = sorted(r["room"] for r in case.rooms)
        assert sorted(pre) == every and sorted(dec) == every, (case.name, sorted(pre), sorted(dec))
        assert all(len(pre[room]) == case.topo.P and len(dec[room]) == case.topo.D for room in every), case.name
        aborted = [case.rooms[i]["room"] for i in (7, 8, 9)]
        for room in aborted:
            for rec in pre[room] + dec[room]:
                assert rec["state"] == "Failed", (case.name, room, rec)
                assert rec["failure"] and "abort" in rec["failure"], rec
                # the failure as SGLang's failure_exception() needs it, and the request's metrics
                assert rec["exception"] == {"type": "KVTransferError", "kind": rec["kind"],
                                            "reason": rec["failure"]}, rec
                assert rec["metrics"]["state"] == "Failed", rec
        for role, side in (("prefill", pre), ("decode", dec)):
            for room, recs in side.items():
                if room in aborted:
                    continue
                for rec in recs:
                    assert_exact(role, rec)   # decode: every byte checked; prefill: nothing to check


@pytest.mark.timeout(200)
def test_layout_mismatch_fails_clearly_on_both_sides():
    case = Case(
        topo=Topo(P=2, D=2, H=4),
        page_size=16,
        dtype="bfloat16",
        staging=False,
        backend="nixl",
        rooms=random_rooms(3, 3, 16),
    )
    geo = copy.deepcopy(case.geometry())
    geo["page_size"] = 8
    case.decode_extra = {
        "geometry": geo,
        "timeouts": {"lease": 20.0, "heartbeat": 0.5, "connect": 20.0, "bootstrap": 45.0, "close": 2.0},
    }
    case.prefill_extra = {"run_timeout_s": 60}
    results, codes, logs, _ = run_cases([case], timeout=90)
    assert not any(codes), codes
    dec = [r for res in results[case.name]["decode"] for r in res["rooms"]]
    pre = [r for res in results[case.name]["prefill"] for r in res["rooms"]]
    assert dec and pre
    for r in dec:
        assert r["state"] == "Failed" and "page_size" in r["failure"], r
        assert r["kind"] == "layout"
    for r in pre:
        assert r["state"] == "Failed" and "page_size" in r["failure"], r
