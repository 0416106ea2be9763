"""A pipeline-parallel decode through SGLang's real transfer classes (scheduler-class harness).

Both instances run 2 PP stages (SGLang's decode accepts a decode PP size equal to the prefill's
or 1, `CommonKVManager._resolve_rank_mapping`), each side's stage processes a real gloo world on
which SGLang's parallel_state builds its process groups (pp_stage.py), so SGLang's
CommonKVManager runs under PP on both sides. The model has 3 layers, split 1 + 2 by SGLang's
`get_pp_indices`; a decode stage's KVArgs list only its layers and name no start layer (as
SGLang's decode builds them), so the adapter takes its stage from `get_pp_indices`. The prefill
stages bootstrap on SGLang's PP consensus; each decode stage drives its own receivers (the
harness does not run SGLang's decode PP event loop, whose poll consensus passes between
stages). Each decode stage checks every byte of its layers, its aux row (each prefill stage
writes its own row, which kvstage moves to the decode stage holding the same layers, as SGLang's
mooncake backend does) and that no page outside a successful request was written. An MLA
model's DSA indexer pages move stage to stage: each decode stage holds and checks its own
layers'. A speculative decoding draft lives on each side's last stage: the prefill's last stage
moves it to the decode's.
"""

from __future__ import annotations

import pytest
from scenario import expect, requests_for, run
from test_scheduler_classes import EAGLE

LAYERS = 3   # the model_3_layers fixture's (conftest.py)


@pytest.mark.parametrize("tp,staging", [(2, True)], ids=["PP2xTP2-D-PP2xTP1-staged"])
def test_pp_decode(tmp_path, model_3_layers, bootstrap_server, tp, staging):
    # room #1: the prefill stage past the first pops the decode prefix before its decode stage's
    # metadata came (it is told WaitingForInput by PP rank 0's poll), which then arrives before
    # init(): SGLang sends the prefix pages too, and kvstage must count them once (a CI failure)
    reqs = requests_for(23, 4, prefix={1: 1, 3: 1}, late_meta={1})
    results = run(tmp_path, model_3_layers, bootstrap_server, tp, 1, reqs, staging=staging, prefill_pp=2,
                  decode_pp=2, layers=LAYERS)
    assert set(results) == {("prefill", rank) for rank in range(2 * tp)} | {("decode", 0), ("decode", 1)}
    expect(results, reqs, lambda i: "Success")
    for rank in range(tp, 2 * tp):
        row = results[("prefill", rank)]["rooms"][str(reqs[1]["room"])]
        assert (row["prefix_seen"], row["prefix_after_pop"]) == (0, True), (rank, row)
    page_layer = 2 * 4 * 4 * 8 * 2   # K and V of one page of one layer: 4 tokens x 4 heads x 8 bf16
    for stage, layers in ((0, 1), (1, 2)):   # decode stage s got its own layers only, from prefill stage s
        rooms = results[("decode", stage)]["rooms"]
        assert {row["path"] for row in rooms.values()} == {"staged" if staging else "direct"}
        for q in reqs:
            sent = [results[("prefill", rank)]["rooms"][str(q["room"])]["bytes"] for rank in range(2 * tp)]
            assert rooms[str(q["room"])]["bytes"] == sum(sent[stage * tp:(stage + 1) * tp]), (q, sent)
            assert sum(sent[stage * tp:(stage + 1) * tp]) >= (q["pages"] - q["prefix"]) * page_layer * layers, (q, sent)


def test_pp_decode_gets_each_stages_dsa_pages(tmp_path, model_3_layers, bootstrap_server):
    """Room #1 (a decode prefix of a page) is made `late_meta`: the second prefill stage pops a
    prefix of 0 before its decode stage's metadata comes, and SGLang names the DSA pages of the
    whole request; the adapter leaves out those of the decode's prefix (a race CI met once)."""
    reqs = requests_for(37, 4, prefix={1: 1}, late_meta={1})
    results = run(tmp_path, model_3_layers, bootstrap_server, 1, 1, reqs, backend="nixl", prefill_pp=2, decode_pp=2,
                  layers=LAYERS, mla=True, state={"slots": 12, "swa_pages": 99, "dsa": True})
    expect(results, reqs, lambda i: "Success")
    for stage in (0, 1):
        rooms = results[("decode", stage)]["rooms"]
        assert all(rooms[str(q["room"])]["state_bad"] == [] for q in reqs), (stage, rooms)
    row = results[("prefill", 1)]["rooms"][str(reqs[1]["room"])]
    assert (row["prefix_seen"], row["prefix_after_pop"]) == (0, True), row   # the race, made to happen


def test_pp_decode_gets_the_draft_on_its_last_stage(tmp_path, model_3_layers, bootstrap_server):
    reqs = requests_for(47, 4, prefix={1: 1})
    results = run(tmp_path, model_3_layers, bootstrap_server, 1, 1, reqs, backend="nixl", prefill_pp=2, decode_pp=2,
                  layers=LAYERS, draft=EAGLE)
    expect(results, reqs, lambda i: "Success")
    page_layer = 2 * 4 * 4 * 8 * 2   # K and V of one page of one layer or draft entry
    rooms = [results[("decode", stage)]["rooms"] for stage in (0, 1)]
    for q in reqs:   # each stage gets an aux row of one size; the last its two layers and the draft's entry, stage
        got = [r[str(q["room"])]["bytes"] for r in rooms]   # 0 its one layer
        assert got[1] - got[0] == (q["pages"] - q["prefix"]) * page_layer * (3 - 1), (q, got)
    assert all(results[("decode", 1)]["rooms"][str(q["room"])]["aux_spec_ok"] for q in reqs)
