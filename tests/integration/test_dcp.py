"""Decode context parallel between real processes (real NIXL or Mooncake, the real bootstrap
server): a pairing kvstage's engine cannot move fails every request on both sides, kind
`layout`, with the reason naming both layouts (token_mapping.engine_refusal), long before any
deadline, and nothing hangs. Direct and staged DCP transfers are not wired yet
(docs/protocol.md, "Decode context parallel")."""

import pytest
from engine_cases import Case, Topo, each_rank, random_rooms, run_cases

pytestmark = pytest.mark.integration


def refused_case(topo: Topo, backend: str, label: str, prefill_dcp: int, decode_dcp: int, base: int) -> Case:
    return Case(topo=topo, page_size=4, dtype="bfloat16", backend=backend, rooms=random_rooms(base, 3, 4, 60, base),
                layers=2, head_dim=16, pages=64, label=label,
                prefill_extra={"dcp": prefill_dcp}, decode_extra={"dcp": decode_dcp})


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_a_dcp_pairing_the_engine_cannot_move_fails_on_both_sides_naming_both_layouts(backend):
    """Prefill TP 2 DCP 2 -> decode TP 1 (DCP on the prefill side only: SGLang does not serve
    it) and prefill TP 1 -> decode TP 2 DCP 2 (served by the token mapping, not yet moved by the
    engine): every room of both ends Failed on every rank with its reason."""
    cases = [
        refused_case(Topo(P=2, D=1, H=1, mla=True), backend, "pside", 2, 1, 3100),
        refused_case(Topo(P=1, D=2, H=1, mla=True), backend, "split", 1, 2, 3200),
    ]
    words = {"pside": "DCP on the prefill side only is not served",
             "split": "decode context parallel is not wired into kvstage's engine yet"}
    layouts = {"pside": "prefill DCP 2 (page_size 4, MLA) -> decode DCP 1 (page_size 4, MLA)",
               "split": "prefill DCP 1 (page_size 4, MLA) -> decode DCP 2 (page_size 4, MLA)"}
    results, codes, _logs, _ = run_cases(cases, timeout=120)
    assert not any(codes), codes
    for c, side, res in each_rank(cases, results):
        assert len(res["rooms"]) == 3, (c.name, side, res)
        for rec in res["rooms"]:
            assert rec["state"] == "Failed", (c.name, side, rec)
            assert layouts[c.label] in rec["failure"] and words[c.label] in rec["failure"], (c.name, side, rec)
