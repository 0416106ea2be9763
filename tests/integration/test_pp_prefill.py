"""A prefill with pipeline parallelism (KVLayout pp_size/pp_rank/stage) between real processes
over real NIXL and Mooncake: each stage's ranks hold and send only their own layers, the decode
rank (no PP) expects writers per (stage, head range), and every byte lands bit-exact: 2 stages
-> decode TP 1 (direct), 2 stages x TP 2 -> decode TP 1 (staged and direct), with layer-wise
sends, state pools (they move with the last stage's last write) and prefix hits. Stages whose
layers do not tile the model fail the rooms on both sides with a reason that says so."""

from __future__ import annotations

import pytest
from engine_cases import TEST_TIMEOUTS, Case, Topo, each_rank, layered_case, problems, run_cases

pytestmark = pytest.mark.integration

LAYERS = 6


def pp_case(topo: Topo, staging: bool, backend: str, seed: int, *, layer_sends: list | None = None,
            pools: bool = False, prefix: bool = False, layer_pools: bool = False) -> Case:
    return layered_case(topo, staging, backend, seed=seed, base=7500 + 10 * seed, label=f"pp{seed}", layers=LAYERS,
                        layer_sends=layer_sends, pools=pools, prefix=prefix, layer_pools=layer_pools)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_pp_prefill_moves_bit_exact(backend):
    per_layer = [[i, i + 1] for i in range(LAYERS)]
    cases = [
        pp_case(Topo(P=1, D=1, H=4, pp=2), False, backend, 1, pools=True, prefix=True),
        pp_case(Topo(P=2, D=1, H=4, pp=2), True, backend, 2, pools=True),
        pp_case(Topo(P=2, D=1, H=4, pp=2), True, backend, 3, layer_sends=per_layer, prefix=True),
        pp_case(Topo(P=2, D=1, H=4, pp=2), False, backend, 4, layer_sends=[[3, 6], [0, 3]], pools=True),
    ]
    results, codes, logs, _ = run_cases(cases, timeout=300)
    bad = problems(results, codes, logs)
    assert not bad, "\n".join(bad[:10])
    for c in cases:
        assert len(results[c.name]["prefill"]) == c.topo.P * c.topo.pp
    for c, side, res in each_rank(cases[:2], results):
        # whole chunks: one write per (writer, chunk), and every TP rank of BOTH stages writes
        for r in c.rooms if side == "decode" else ():
            rec = next(x for x in res["rooms"] if x["room"] == r["room"])
            sent = len(r["chunks"]) - sum(1 for i in range(len(r["chunks"]))
                                          if sum(r["chunks"][:i + 1]) <= r.get("prefix_pages", 0))
            assert rec["metrics"]["backend_writes"] == c.topo.P * c.topo.pp * sent, (c.name, r, rec["metrics"])


@pytest.mark.timeout(400)
@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_each_stage_moves_the_state_pools_of_its_own_layers(backend):
    """A hybrid model's per-layer state (a pool per layer, `StatePool(layer=...)`, registered only
    by the stage holding that layer) beside an aux row of no layer: each stage writes its layers'
    pools with the last page of its last layer, the last stage the aux row too, and the decode
    rank (no PP) checks every byte of every pool; direct and staged, with prefix hits."""
    cases = [
        pp_case(Topo(P=1, D=1, H=4, pp=2), False, backend, 6, layer_pools=True, prefix=True),
        pp_case(Topo(P=2, D=1, H=4, pp=2), True, backend, 7, layer_pools=True),
        pp_case(Topo(P=1, D=2, H=4, pp=2), False, backend, 8, layer_pools=True, layer_sends=[[3, 6], [0, 3]]),
    ]
    results, codes, logs, _ = run_cases(cases, timeout=300)
    bad = problems(results, codes, logs)
    assert not bad, "\n".join(bad[:10])
    for c, side, res in each_rank(cases, results):
        assert len(res["rooms"]) == 6 and all(rec["state"] == "Success" for rec in res["rooms"]), (c.name, side, res)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["nixl"])
def test_pp_stages_that_do_not_tile_the_model_fail_with_a_reason(backend):
    case = pp_case(Topo(P=1, D=1, H=4, pp=2), False, backend, 5)
    case.rooms = case.rooms[:2]
    case.prefill_extra = {**case.prefill_extra, "stage_layers": [[0, 2], [3, 6]],
                          "timeouts": {**TEST_TIMEOUTS, "metadata": 3.0}}
    results, codes, logs, _ = run_cases([case], timeout=200)
    bad = problems(results, codes, logs, expect_success=False)
    assert not bad, "\n".join(bad[:10])
    for c, side, res in each_rank([case], results):
        for rec in res["rooms"]:
            assert rec["state"] == "Failed", (side, rec)
            # both sides say why, the prefill ranks told by the decode rank long before their
            # 3 s metadata deadline would have failed the rooms as "no room metadata"
            assert "do not tile the model's 6 layers" in rec["failure"], (side, rec)
