"""State pools (aux rows, Mamba-like states, GDN-like conv states of sub-blocks sharded each on
its own) move with each request's last page over real NIXL and Mooncake, staged and direct,
across hetero TP, bit-exact; bad pool input fails cleanly."""

from __future__ import annotations

import pytest
from engine_cases import Case, Topo, each_rank, problems, random_rooms, run_cases

from kvstage.transfer.protocol.head_mapping import compute_assignments

AUX = {"sharding": "replicated", "items": 24, "tensors": [["float32", [5]], ["int32", [3]], ["bfloat16", [40]]]}


def mamba(heads: int) -> dict:
    return {"sharding": "heads", "heads": heads, "items": 12, "tensors": [["float32", [6, 4]], ["bfloat16", [3]]]}


# GDN's conv state: [q | k | v] along the head axis, each sub-block sharded on its own
CONV = {"sharding": "heads", "blocks": [8, 8, 16], "items": 10, "tensors": [["bfloat16", [3]], ["float32", [2]]]}


def pooled(case: Case, pools: dict, counts: dict) -> Case:
    case.pools = pools
    for r in case.rooms:
        r["pool_items"] = counts
    return case


TOPOS = [Topo(P=2, D=1, H=4), Topo(P=1, D=2, H=4), Topo(P=2, D=2, H=4), Topo(P=4, D=2, H=2)]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_pools_move_bit_exact_with_the_kv(backend):
    cases = []
    for topo in TOPOS:
        for staging in (True, False):
            rooms = random_rooms(31, 6, 16, base=5000)
            heads = 8 if topo.H >= 4 else 2       # P4 over 2 KV heads: the pool replicates like the KV
            pools, counts = {"aux": AUX, "mamba": mamba(heads)}, {"aux": 1, "mamba": 1}
            if topo.H >= 4:                        # blocks split like the KV only where it is not replicated
                pools, counts = {**pools, "conv": CONV}, {**counts, "conv": 1}
            cases.append(
                pooled(
                    Case(topo=topo, page_size=16, dtype="bfloat16", staging=staging, backend=backend, rooms=rooms),
                    pools,
                    counts,
                )
            )
    results, codes, logs, _ = run_cases(cases, timeout=240)
    bad = problems(results, codes, logs)
    assert not bad, "\n".join(bad[:10])
    for c in cases:
        one_write_per_pair_and_chunk(c, results[c.name])


def others_exact_when_one_room_mismatches(cases: list[Case], results: dict, index: int):
    """Room `index` of every case names other pool items on its decode side: it failed on both
    sides as "pool items differ". Every other room succeeded, bit-exact; each is yielded as
    (case, side, record) for more checks."""
    for c, side, res in each_rank(cases, results):
        for rec in res["rooms"]:
            if rec["room"] == c.rooms[index]["room"]:
                assert rec["state"] == "Failed" and "pool items differ" in rec["failure"], (c.name, rec)
                continue
            assert rec["state"] == "Success" and rec["verified"] is (True if side == "decode" else None), (c.name, rec)
            yield c, side, rec


def one_write_per_pair_and_chunk(c: Case, sides: dict, extra_on_last: int = 0) -> None:
    """The pool items ride in the writes the KV makes anyway: each decode rank sees one write per
    writer per chunk (these requests fit one staged piece per chunk), plus `extra_on_last` on the
    last chunk (direct writes split by memory region: one per replicated pool with writes of its
    own, which one writer of each decode rank carries)."""
    mapping = compute_assignments(c.topo.P, c.topo.D, c.topo.H, c.topo.mla)
    for res in sides["decode"]:
        writers = len(mapping.writers_of(int(res["name"].rsplit("/", 1)[1])))
        for r in c.rooms:
            rec = next(x for x in res["rooms"] if x["room"] == r["room"])
            want = writers * len(r["chunks"]) + extra_on_last
            assert rec["metrics"]["backend_writes"] == want, (c.name, r, rec["metrics"])


@pytest.mark.timeout(400)
@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_a_pool_in_a_region_of_its_own_moves_bit_exact(backend):
    """A pool with `own_writes` is moved as a host pool beside a device cache is on a GPU server:
    its own registration, its own backend writes on the direct path (one more on the last chunk,
    from the one writer that carries a replicated pool), and the bounce copies in and out of the staging buffer on the staged path (still
    one write per rank pair per chunk)."""
    own = {**AUX, "own_writes": True}
    cases = []
    for topo in (Topo(P=2, D=1, H=4), Topo(P=1, D=2, H=4), Topo(P=2, D=2, H=4)):
        for staging in (True, False):
            rooms = random_rooms(37, 4, 16, base=6000)
            cases.append(
                pooled(
                    Case(topo=topo, page_size=16, dtype="bfloat16", staging=staging, backend=backend, rooms=rooms),
                    {"aux": own, "mamba": mamba(8)},
                    {"aux": 1, "mamba": 1},
                )
            )
    results, codes, logs, _ = run_cases(cases, timeout=240)
    bad = problems(results, codes, logs)
    assert not bad, "\n".join(bad[:10])
    for c in cases:
        staged = c.staging and c.topo.P != c.topo.D
        one_write_per_pair_and_chunk(c, results[c.name], extra_on_last=0 if staged else 1)


BIG_SSM = {"sharding": "heads", "heads": 4, "items": 6, "tensors": [["float32", [64, 128]], ["float32", [64, 128]]]}


@pytest.mark.timeout(400)
def test_mla_with_a_replicated_pool_and_states_of_hundreds_of_kib():
    """MLA (one latent head, every decode rank written by one prefill rank) with an aux pool;
    then Mamba-like states of 128 KiB per item per layer on each writer, P>D and P<D."""
    cases = []
    for backend in ("nixl", "mooncake"):
        rooms = random_rooms(41, 4, 16, base=7000)
        cases.append(
            pooled(
                Case(
                    topo=Topo(P=2, D=4, H=1, mla=True),
                    page_size=16,
                    dtype="bfloat16",
                    staging=False,
                    backend=backend,
                    rooms=rooms,
                ),
                {"aux": AUX},
                {"aux": 1},
            )
        )
        for topo in (Topo(P=2, D=1, H=4), Topo(P=1, D=2, H=4)):
            for staging in (True, False):
                rooms = random_rooms(43, 3, 16, base=7100)
                cases.append(
                    pooled(
                        Case(topo=topo, page_size=16, dtype="bfloat16", staging=staging, backend=backend, rooms=rooms),
                        {"ssm": BIG_SSM},
                        {"ssm": 1},
                    )
                )
    results, codes, logs, _ = run_cases(cases, timeout=240)
    bad = problems(results, codes, logs)
    assert not bad, "\n".join(bad[:10])


@pytest.mark.timeout(300)
def test_pool_items_that_disagree_fail_the_request_on_both_sides():
    """The decode side names two aux rows, the prefill side one: that request fails on both sides
    with the reason; the others succeed, bit-exact."""
    cases = []
    for backend in ("nixl", "mooncake"):
        for staging in (True, False):
            rooms = random_rooms(51, 4, 16, base=8000)
            case = pooled(
                Case(
                    topo=Topo(P=2, D=1, H=4),
                    page_size=16,
                    dtype="bfloat16",
                    staging=staging,
                    backend=backend,
                    rooms=rooms,
                ),
                {"aux": AUX},
                {"aux": 1},
            )
            rooms[1]["pool_items_decode"] = {"aux": 2}
            cases.append(case)
    results, codes, logs, _ = run_cases(cases, timeout=200)
    assert not any(codes), codes
    assert list(others_exact_when_one_room_mismatches(cases, results, 1))   # every other room is there, exact


@pytest.mark.timeout(300)
def test_a_pool_registered_on_one_side_only_refuses_the_connection():
    cases = []
    for backend in ("nixl", "mooncake"):
        rooms = random_rooms(61, 2, 16, base=9000)
        case = Case(
            topo=Topo(P=1, D=1, H=4), page_size=16, dtype="bfloat16", staging=False, backend=backend, rooms=rooms
        )
        case.rank_extra = {("decode", 0): {"geometry": {**case.geometry(), "pools": {"aux": AUX}}}}
        cases.append(case)
    results, codes, logs, _ = run_cases(cases, timeout=120)
    assert not any(codes), codes
    for c, side, res in each_rank(cases, results):
        for rec in res["rooms"]:
            assert rec["state"] == "Failed", (c.name, side, rec)
            if side == "decode":
                assert (
                    "pool 'aux': registered at the peer only" in rec["failure"]
                    or "pool 'aux': registered here only" in rec["failure"]
                ), rec


@pytest.mark.timeout(400)
@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_pool_items_with_the_last_send_stream_the_kv_chunk_by_chunk(backend):
    """A serving engine that names a request's state only with its last send (SGLang's hybrid
    models) still streams: the first write leaves before the last send, the items arrive with
    it, bit-exact, staged and direct, hetero TP both ways; a request whose decode side expects
    other items fails on both sides, named, once the last send showed the mismatch."""
    cases = []
    for topo, staging in ((Topo(P=2, D=1, H=4), True), (Topo(P=1, D=2, H=4), True), (Topo(P=2, D=2, H=4), False)):
        rooms = random_rooms(61, 5, 16, base=8100)
        for r in rooms:
            r.update(pool_items_with_last=True)
        rooms[0].update(pages=6, tokens=96, chunks=[2, 2, 2], chunk_delay_s=0.4,   # the last send comes late
                        send_after_metadata=True)
        rooms[2]["pool_items_decode"] = {"aux": 2, "mamba": 1}
        cases.append(pooled(Case(topo=topo, page_size=16, dtype="bfloat16", staging=staging, backend=backend,
                                 rooms=rooms), {"aux": AUX, "mamba": mamba(8)}, {"aux": 1, "mamba": 1}))
    results, codes, logs, _ = run_cases(cases, timeout=240)
    assert not any(codes), codes
    for c, side, rec in others_exact_when_one_room_mismatches(cases, results, 2):
        if side == "prefill" and rec["room"] == c.rooms[0]["room"]:
            first = rec["metrics"]["timeline"]["first_write"]
            assert first is not None and first < rec["last_send_at"], (c.name, rec)   # written while streaming
