"""A decode engine with pipeline parallelism (KVLayout pp_size/pp_rank/stage on the decode
side) between real processes over real NIXL and Mooncake: each decode stage's ranks hold only
their stage's layers and get them from the prefill stages that hold them, whatever the PP size
on either side (1 -> 2, 2 -> 2, 2 -> 3, whose stage bounds differ), staged and direct, with
layer-wise sends, prefix hits and state pools (they move with the model's last layer, so only
the last decode stage holds them); every byte lands bit-exact. Decode stages that do not tile
the model fail each room on both sides with a reason naming both layouts."""

from __future__ import annotations

import pytest
from engine_cases import TEST_TIMEOUTS, Case, Topo, each_rank, layered_case, problems, run_cases

pytestmark = pytest.mark.integration

LAYERS = 6


def dpp_case(topo: Topo, staging: bool, backend: str, seed: int, *, layer_sends: list | None = None,
             pools: bool = False, prefix: bool = False, forced: bool = False, layer_pools: bool = False) -> Case:
    """`forced`: the staged path at equal TP too (EngineConfig.path "staged": whole pages), so
    that a case needs no more rank processes than the others."""
    case = layered_case(topo, staging, backend, seed=seed, base=8500 + 10 * seed, label=f"dpp{seed}", layers=LAYERS,
                        layer_sends=layer_sends, pools=pools, prefix=prefix, layer_pools=layer_pools)
    if forced:
        case.extra = {"path": "staged"}
    return case


def check(cases: list[Case], results: dict) -> None:
    for c in cases:
        assert len(results[c.name]["prefill"]) == c.topo.prefill_ranks, c.name
        assert len(results[c.name]["decode"]) == c.topo.decode_ranks, c.name
    for c, side, res in each_rank(cases, results):
        staged = c.staging and (c.topo.P != c.topo.D or c.extra.get("path") == "staged")
        for rec in res["rooms"]:
            assert rec["state"] == "Success", (c.name, side, rec)
            if side == "decode":   # the path the fixed rule gives (staged iff TP sizes differ)
                assert rec["metrics"]["path"] == ("staged" if staged else "direct"), (c.name, rec["metrics"])


def unpairable_case() -> Case:
    """Decode stages [0, 2) and [3, 6) of 6 layers: layer 2 belongs to no decode stage."""
    case = dpp_case(Topo(P=1, D=1, H=4, dpp=2), False, "nixl", 9)
    case.rooms = case.rooms[:2]
    case.decode_extra = {"stage_layers": [[0, 2], [3, 6]], "timeouts": {**TEST_TIMEOUTS, "metadata": 3.0}}
    case.prefill_extra = {**case.prefill_extra, "timeouts": {**TEST_TIMEOUTS, "metadata": 3.0}}
    return case


@pytest.mark.timeout(300)
def test_decode_pp_moves_bit_exact_and_decode_stages_that_do_not_tile_fail_both_sides():
    """One cluster for every case (each rank process hosts one rank of each: 2 prefill and 3
    decode processes): NIXL staged and direct for PP 1 -> 2 (staged across TP sizes), 2 -> 2 and
    2 -> 3 (with end-to-end digests), Mooncake for one, and the unpairable stages."""
    per_layer = [[i, i + 1] for i in range(LAYERS)]
    cases = [
        dpp_case(Topo(P=1, D=1, H=4, dpp=2), False, "nixl", 1, pools=True, prefix=True),          # PP 1 -> 2
        dpp_case(Topo(P=2, D=1, H=4, dpp=2), True, "nixl", 2, layer_sends=per_layer, pools=True),  # PP 1 -> 2, staged
        dpp_case(Topo(P=1, D=1, H=4, pp=2, dpp=2), False, "nixl", 3, pools=True, prefix=True),     # PP 2 -> 2
        dpp_case(Topo(P=1, D=1, H=4, pp=2, dpp=2), True, "nixl", 4, pools=True, forced=True),      # PP 2 -> 2, staged
        dpp_case(Topo(P=1, D=1, H=4, pp=2, dpp=3), False, "nixl", 5, layer_sends=[[3, 6], [0, 3]],
                 pools=True),                                                                       # PP 2 -> 3
        dpp_case(Topo(P=1, D=1, H=4, pp=2, dpp=3), True, "nixl", 6, prefix=True, forced=True),    # PP 2 -> 3, staged
        dpp_case(Topo(P=1, D=1, H=4, pp=2, dpp=3), True, "mooncake", 7, pools=True, prefix=True,
                 forced=True),                                                                      # PP 2 -> 3, Mooncake
    ]
    for c in cases[4:6]:   # PP 2 -> 3 with end-to-end digests too (EngineConfig.verify): checked where they land
        c.extra = {**c.extra, "verify": True}
    bad_case = unpairable_case()
    results, codes, logs, _ = run_cases(cases + [bad_case], timeout=200)
    good = {name: sides for name, sides in results.items() if name != bad_case.name}
    bad = problems(good, codes, logs)
    assert not bad, "\n".join(bad[:10])
    check(cases, results)
    for c, side, res in each_rank([bad_case], results):
        assert res["rooms"], (side, res)
        for rec in res["rooms"]:
            assert rec["state"] == "Failed", (side, rec)
            # the prefill rank saw both decode stages' metadata: it names its own layout and
            # theirs, and tells every decode rank, long before the 3 s metadata deadline
            why = rec["failure"]
            assert "cannot pair with the decode engine's stages" in why, (side, rec)
            assert "prefill rank 0 (no PP, 6 layers)" in why, (side, rec)
            assert "leave layers [2, 3) to no stage" in why and "decode PP stage 1 of 2 [3, 6)" in why, (side, rec)


@pytest.mark.timeout(300)
def test_each_decode_stage_gets_the_state_pools_of_its_layers_from_the_stages_holding_them():
    """A hybrid model's per-layer state (a pool per layer, `StatePool(layer=...)`) beside an aux
    row of no layer, into decode stages: each decode stage registers and receives the pools of
    its own layers, each from the prefill stage that holds the layer (with the last page of the
    last layer that stage writes there), and the aux row comes to the last decode stage; PP
    1 -> 2 staged, 2 -> 2 direct, and 2 -> 3 (stage bounds that differ) staged with end-to-end
    digests and over Mooncake direct; every pool byte checked on the decode."""
    cases = [
        dpp_case(Topo(P=2, D=1, H=4, dpp=2), True, "nixl", 11, layer_pools=True),                  # PP 1 -> 2, staged
        dpp_case(Topo(P=1, D=1, H=4, pp=2, dpp=2), False, "nixl", 12, layer_pools=True, prefix=True),   # PP 2 -> 2
        dpp_case(Topo(P=1, D=1, H=4, pp=2, dpp=3), True, "nixl", 13, layer_pools=True, forced=True),    # PP 2 -> 3
        dpp_case(Topo(P=1, D=1, H=4, pp=2, dpp=3), False, "mooncake", 14, layer_pools=True, prefix=True,
                 layer_sends=[[3, 6], [0, 3]]),                                                     # PP 2 -> 3, Mooncake
    ]
    cases[2].extra = {**cases[2].extra, "verify": True}
    results, codes, logs, _ = run_cases(cases, timeout=200)
    bad = problems(results, codes, logs)
    assert not bad, "\n".join(bad[:10])
    check(cases, results)
