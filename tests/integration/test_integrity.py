"""End-to-end integrity (verify=True): every landed write is checked against the digest its
writer sent, over real NIXL and Mooncake, staged and direct, state pools included. With bytes
flipped on purpose (the corrupt_data fault), every corrupted request fails as `corrupt` on both
sides and none is reported as Success; the others succeed, bit-exact."""

from __future__ import annotations

import pytest
from engine_cases import Case, Topo, corrupt_rooms, random_rooms, run_cases

AUX = {"sharding": "replicated", "items": 40, "tensors": [["float32", [5]], ["int32", [3]]]}
SSM = {"sharding": "heads", "heads": 4, "items": 40, "tensors": [["float32", [4, 8]]]}


def verified_cases(backend: str, faults: dict | None) -> list[Case]:
    cases = []
    for topo, staging in ((Topo(P=2, D=1, H=4), True), (Topo(P=2, D=1, H=4), False), (Topo(P=1, D=1, H=4), False)):
        rooms = random_rooms(71, 24, 16, base=11000)
        for r in rooms:
            r["pool_items"] = {"aux": 1, "ssm": 1}
        case = Case(
            topo=topo,
            page_size=16,
            dtype="bfloat16",
            staging=staging,
            backend=backend,
            rooms=rooms,
            pools={"aux": AUX, "ssm": SSM},
            extra={"verify": True},
        )
        if faults:
            case.decode_extra = {"faults": faults}
        cases.append(case)
    return cases


@pytest.mark.timeout(400)
@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_every_corrupted_request_fails_as_corrupt_and_no_other(backend):
    cases = verified_cases(backend, {"corrupt_data": 0.08, "seed": 3})
    results, codes, logs, _ = run_cases(cases, timeout=240)
    assert not any(codes), codes
    for c in cases:
        (dec,) = results[c.name]["decode"]
        # every request that got a flipped byte failed, and only those: 100% detected, no false alarm
        # (the sets: a miss and a false alarm would leave the counts equal)
        failed = corrupt_rooms(c.name, dec)
        st = dec["stats"]
        assert failed and st["corrupted_rooms"] == len(failed), (c.name, failed)
        assert st["rooms"].get("success", 0) > 0, (c.name, st["rooms"])
        for pre in results[c.name]["prefill"]:
            assert {r["room"] for r in pre["rooms"]} == {r["room"] for r in dec["rooms"]}, c.name
            for r in pre["rooms"]:
                if r["room"] in failed:
                    assert r["state"] == "Failed" and r["kind"] == "remote_corrupt", (c.name, r)
                else:
                    assert r["state"] == "Success", (c.name, r)


@pytest.mark.timeout(300)
def test_verify_on_one_side_only_refuses_the_connection():
    cases = []
    for backend in ("nixl", "mooncake"):
        case = Case(
            topo=Topo(P=1, D=1, H=4),
            page_size=16,
            dtype="bfloat16",
            staging=False,
            backend=backend,
            rooms=random_rooms(81, 2, 16, base=12000),
        )
        case.decode_extra = {"verify": True}
        cases.append(case)
    results, codes, logs, _ = run_cases(cases, timeout=120)
    assert not any(codes), codes
    for c in cases:
        (dec,) = results[c.name]["decode"]
        for r in dec["rooms"]:
            assert r["state"] == "Failed" and "verify: off here vs on at peer" in r["failure"], (c.name, r)
