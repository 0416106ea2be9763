"""KV cache sharding through SGLang's real transfer classes (scheduler-class harness): a prefill
of an MLA model with SGLang's --enable-kv-cache-sharding over its attention TP 2 (logical page l
on rank l % 2 at local page l // 2; SGLang resolves it for the fa3 attention backend, which the
harness names and never runs), to a decode of attention TP 2. Every prefill rank gets the same
logical page ids, as from SGLang's scheduler, and writes only the pages it owns; each decode rank
checks every page and the aux row, and that no other page was written. Some requests have a
decode prefix. Both backends. With PP each stage's attention TP group shards its own layers'
pages."""

from __future__ import annotations

import pytest
from scenario import expect, requests_for, run

PAGE_BYTES = 2 * 4 * 8 * 2   # a page of the harness's MLA model: 2 layers x 4 tokens x one latent head of 8 bf16


@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_a_sharded_mla_prefill_sends_each_page_from_the_rank_that_owns_it(tmp_path, mla_model_dir, bootstrap_server,
                                                                          backend):
    reqs = requests_for(61, 6, prefix={1: 1, 4: 2})
    results = run(tmp_path, mla_model_dir, bootstrap_server, 2, 2, reqs, backend=backend, mla=True, kv_shard=True)
    expect(results, reqs, lambda i: "Success")
    aux = set()
    for q in reqs:
        room, suffix = str(q["room"]), q["pages"] - q["prefix"]
        got = {results[("decode", r)]["rooms"][room]["bytes"] - suffix * PAGE_BYTES for r in range(2)}
        assert len(got) == 1, (q, got)    # both decode ranks got every page of the suffix, and the aux row
        aux |= got
        # each prefill rank wrote its own pages to both decode ranks, and one of them the aux row too
        rows = [results[("prefill", r)]["rooms"][room] for r in range(2)]
        assert sum(row["owned"] for row in rows) == suffix, (q, rows)
        rest = sorted(row["bytes"] - 2 * row["owned"] * PAGE_BYTES for row in rows)
        assert rest == [0, 2 * next(iter(got))], (q, rows)
    assert len(aux) == 1 and aux.pop() > 0


@pytest.mark.parametrize("backend,decode_pp", [("nixl", 1), ("mooncake", 2)], ids=["PP2-D1", "PP2-DPP2-mooncake"])
def test_each_pp_stage_of_a_sharded_prefill_sends_its_layers_pages(tmp_path, mla_model_dir, bootstrap_server,
                                                                   backend, decode_pp):
    """The same sharding on a PP 2 prefill (SGLang's PP process groups and bootstrap consensus,
    pp_stage.py): each stage's attention TP ranks shard its one layer's pages; the decode (no PP,
    or PP 2) gets every page of every layer, from the rank that owns it in the stage holding it."""
    reqs = requests_for(67, 5, prefix={1: 1, 3: 2})
    results = run(tmp_path, mla_model_dir, bootstrap_server, 2, 2, reqs, backend=backend, mla=True, kv_shard=True,
                  prefill_pp=2, decode_pp=decode_pp)
    expect(results, reqs, lambda i: "Success")
    aux = set()
    for q in reqs:
        room, suffix = str(q["room"]), q["pages"] - q["prefix"]
        sent = [results[("prefill", r)]["rooms"][room]["bytes"] for r in range(4)]
        assert all(sent), (q, sent)   # every rank of both stages owns and writes pages of every request
        got = [results[("decode", r)]["rooms"][room]["bytes"] for r in range(2 * decode_pp)]
        assert sum(got) == sum(sent), (q, sent, got)
        # each decode rank got every page of its stage's layers (2 without PP, 1 with) and an aux row
        aux |= {n - suffix * PAGE_BYTES // 2 * (2 // decode_pp) for n in got}
    assert len(aux) == 1 and aux.pop() > 0
