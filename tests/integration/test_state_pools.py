"""State pools (aux rows, Mamba-like states) move with each request's last page over real NIXL
and Mooncake, staged and direct, across hetero TP, bit-exact; bad pool input fails cleanly."""

from __future__ import annotations

import pytest

from engine_cases import Case, Topo, problems, random_rooms, run_cases

from kvstage.transfer.protocol.head_mapping import compute_assignments

AUX = {"sharding": "replicated", "items": 24, "tensors": [["float32", [5]], ["int32", [3]], ["bfloat16", [40]]]}


def mamba(heads: int) -> dict:
    return {"sharding": "heads", "heads": heads, "items": 12, "tensors": [["float32", [6, 4]], ["bfloat16", [3]]]}


def pooled(case: Case, pools: dict, counts: dict) -> Case:
    case.pools = pools
    for r in case.rooms:
        r["pool_items"] = counts
    return case


TOPOS = [Topo(2, 1, 4), Topo(1, 2, 4), Topo(2, 2, 4), Topo(4, 2, 2)]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_pools_move_bit_exact_with_the_kv(backend):
    cases = []
    for topo in TOPOS:
        for staging in (True, False):
            rooms = random_rooms(31, 6, 16, base=5000)
            heads = 8 if topo.H >= 4 else 2       # P4 over 2 KV heads: the pool replicates like the KV
            cases.append(pooled(Case(topo, 16, "bfloat16", staging, backend, rooms=rooms),
                                {"aux": AUX, "mamba": mamba(heads)}, {"aux": 1, "mamba": 1}))
    results, codes, logs, _ = run_cases(cases, timeout=240)
    bad = problems(results, codes, logs)
    assert not bad, "\n".join(bad[:10])
    for c in cases:
        one_write_per_pair_and_chunk(c, results[c.name])


def one_write_per_pair_and_chunk(c: Case, sides: dict) -> None:
    """The pool items ride in the writes the KV makes anyway: each decode rank sees one write per
    writer per chunk (these requests fit one staged piece per chunk)."""
    mapping = compute_assignments(c.topo.P, c.topo.D, c.topo.H, c.topo.mla)
    for res in sides["decode"]:
        writers = len(mapping.writers_of(int(res["name"].rsplit("/", 1)[1])))
        for r in c.rooms:
            rec = next(x for x in res["rooms"] if x["room"] == r["room"])
            assert rec["metrics"]["backend_writes"] == writers * len(r["chunks"]), (c.name, r, rec["metrics"])
