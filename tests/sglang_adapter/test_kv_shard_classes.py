"""KV cache sharding through SGLang's real transfer classes (scheduler-class harness): a prefill
of an MLA model with SGLang's --enable-kv-cache-sharding over its attention TP 2 (logical page l
on rank l % 2 at local page l // 2; SGLang resolves it for the fa3 attention backend, which the
harness names and never runs), to a decode of attention TP 2. Every prefill rank gets the same
logical page ids, as from SGLang's scheduler, and writes only the pages it owns; each decode rank
checks every page and the aux row, and that no other page was written. Some requests have a
decode prefix. Both backends."""

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
