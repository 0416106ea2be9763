"""A pipeline-parallel prefill through SGLang's real transfer classes (scheduler-class harness).

The prefill's stage processes form a real gloo world on which SGLang's parallel_state builds its
process groups, so SGLang's PPConsensusStore (CommonKVManager under PP) and SGLang's PP
bootstrap consensus (`poll_and_all_reduce_prefill_pp`: PP rank 0's polls, passed down the
stages) run as in a server (pp_stage.py). The model has 3 layers, split 1 + 2 by SGLang's
`get_pp_indices`; each stage's KVArgs list only its layers with `prefill_start_layer` at the
first. The decode (TP 1, no PP) checks every byte of every layer, the aux row (written by the
last stage only) and that no page outside a successful request was written. A speculative
decoding draft lives on the last stage (SGLang runs the draft worker there): its KVArgs list the
draft's entries after its layers, and they move from there.
"""

from __future__ import annotations

import pytest
from scenario import expect, requests_for, run
from test_scheduler_classes import EAGLE, draft_model_dir

LAYERS = 3   # the model_3_layers fixture's (conftest.py)


@pytest.mark.parametrize("tp,staging,backend", [(1, False, "nixl"), (2, True, "nixl"), (2, True, "mooncake")],
                         ids=["PP2xTP1-D1-direct", "PP2xTP2-D1-staged", "PP2xTP2-D1-mooncake-staged"])
def test_pp_prefill(tmp_path, model_3_layers, bootstrap_server, tp, staging, backend):
    reqs = requests_for(19, 5, prefix={1: 1, 3: 1})
    results = run(tmp_path, model_3_layers, bootstrap_server, tp, 1, reqs, backend=backend, staging=staging,
                  prefill_pp=2, layers=LAYERS)
    assert set(results) == {("prefill", rank) for rank in range(2 * tp)} | {("decode", 0)}
    expect(results, reqs, lambda i: "Success")
    rooms = results[("decode", 0)]["rooms"]
    assert {row["path"] for row in rooms.values()} == {"staged" if staging else "direct"}
    for rank in range(tp):   # PP rank 0 bootstraps on its own polls: it learned each decode prefix
        seen = results[("prefill", rank)]["rooms"]
        assert [seen[str(q["room"])]["prefix_seen"] for q in reqs] == [q["prefix"] for q in reqs]
    page_layer = 2 * 4 * 4 * 8 * 2   # K and V of one page of one layer: 4 tokens x 4 heads x 8 bf16
    for q in reqs:   # stage 0 (world ranks below tp) wrote its one layer and no aux row
        sent = [results[("prefill", rank)]["rooms"][str(q["room"])]["bytes"] for rank in range(2 * tp)]
        assert sum(sent[:tp]) == (q["pages"] - q["prefix"]) * page_layer, (q, sent)
        assert rooms[str(q["room"])]["bytes"] == sum(sent), (q, sent, rooms[str(q["room"])])


@pytest.mark.parametrize("tp,backend", [(1, "nixl"), (2, "mooncake")], ids=["PP2xTP1-D1-nixl", "PP2xTP2-D1-mooncake"])
def test_pp_prefill_moves_each_stages_dsa_pages(tmp_path, model_3_layers, bootstrap_server, tp, backend):
    reqs = requests_for(31, 5, prefix={1: 1, 3: 1})
    results = run(tmp_path, model_3_layers, bootstrap_server, tp, 1, reqs, backend=backend, prefill_pp=2,
                  layers=LAYERS, mla=True, state={"slots": 12, "swa_pages": 99, "dsa": True})
    expect(results, reqs, lambda i: "Success")
    rooms = results[("decode", 0)]["rooms"]
    assert all(rooms[str(q["room"])]["state_bad"] == [] for q in reqs), rooms
    index_page = 4 * 3 * 2   # one DSA page of one layer: 4 tokens x 3 int16
    for q in reqs:   # stage 0 wrote its one layer's KV and indexer pages, stage 1 its two layers' and the aux row
        sent = [results[("prefill", rank)]["rooms"][str(q["room"])]["bytes"] for rank in range(2 * tp)]
        latent = (q["pages"] - q["prefix"]) * 4 * 8 * 2   # one layer's latent: 4 tokens x 8 bf16
        assert sum(sent[:tp]) == (q["pages"] - q["prefix"]) * index_page + latent, (q, sent)


@pytest.mark.parametrize("tp,staging,backend,draft", [
    (1, False, "nixl", EAGLE), (2, True, "mooncake", {"layers": 2, "heads": 2, "head_dim": 8})],
    ids=["PP2xTP1-D1-nixl-eagle", "PP2xTP2-D1-mooncake-staged-own-geometry"])
def test_pp_prefill_moves_the_draft_from_its_last_stage(tmp_path, model_3_layers, bootstrap_server, tp, staging,
                                                        backend, draft):
    """The draft's KV, EAGLE-style (the target's geometry: more layers after the model's last) or
    a draft model of its own geometry (moved with each request's last piece), from the last
    stage; the decode checks every byte of both and the draft's hidden states in the aux row."""
    if draft is not EAGLE:
        draft = dict(draft, model=draft_model_dir(tmp_path, draft["heads"]))
    reqs = requests_for(43, 5, prefix={1: 1, 3: 1})
    results = run(tmp_path, model_3_layers, bootstrap_server, tp, 1, reqs, backend=backend, staging=staging,
                  prefill_pp=2, layers=LAYERS, draft=draft)
    expect(results, reqs, lambda i: "Success")
    rooms = results[("decode", 0)]["rooms"]
    assert all(rooms[str(q["room"])]["aux_spec_ok"] for q in reqs), rooms
    page_layer = 2 * 4 * 4 * 8 * 2   # K and V of one page of one layer: 4 tokens x 4 heads x 8 bf16
    for q in reqs:   # stage 0 wrote its one layer and nothing of the draft
        sent = [results[("prefill", rank)]["rooms"][str(q["room"])]["bytes"] for rank in range(2 * tp)]
        assert sum(sent[:tp]) == (q["pages"] - q["prefix"]) * page_layer, (q, sent)
        assert rooms[str(q["room"])]["bytes"] == sum(sent), (q, sent, rooms[str(q["room"])])
