"""A prefill with attention context parallelism through SGLang's real transfer classes
(scheduler-class harness): SGLang's --enable-prefill-cp with CP 2, each CP rank holding the whole
KV of its attention TP rank's heads. As SGLang's default (no rank sends a part of the pages), CP
rank 0 moves every request's KV as a CP-1 prefill of its attention TP size, and the other CP
ranks are dummy senders (SGLang's `is_dummy_cp_rank`) that run no kvstage engine and succeed at
their last send. The decode checks every byte and the aux row of every request, and that no page
outside a successful request was written. With SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER (SGLang's
split of the sending over the CP ranks, each of which still holds the whole KV) the same: CP rank
0 moves it all."""

from __future__ import annotations

import pytest
from scenario import expect, requests_for, run


@pytest.mark.parametrize("attn_tp,decode_tp,backend,all_ranks", [(1, 1, "nixl", False), (2, 1, "mooncake", False),
                                                             (2, 1, "nixl", True)],
                         ids=["CP2xTP1-D1-nixl", "CP2xTP2-D1-mooncake", "CP2xTP2-D1-nixl-all-cp-ranks-variable"])
def test_prefill_cp_moves_the_kv_from_cp_rank_0(tmp_path, model_dir, bootstrap_server, attn_tp, decode_tp, backend,
                                                all_ranks):
    reqs = requests_for(23, 5)
    env = {"SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER": "1"} if all_ranks else None
    results = run(tmp_path, model_dir, bootstrap_server, 2 * attn_tp, decode_tp, reqs, backend=backend, prefill_cp=2,
                  extra_env=env)
    assert set(results) == {("prefill", rank) for rank in range(2 * attn_tp)} | {("decode", 0)}
    expect(results, reqs, lambda i: "Success")
    for q in reqs:   # world rank = CP rank x attention TP + attention TP rank: CP rank 0's ranks wrote it all
        sent = [results[("prefill", rank)]["rooms"][str(q["room"])]["bytes"] for rank in range(2 * attn_tp)]
        assert all(sent[:attn_tp]) and sent[attn_tp:] == [None] * attn_tp, (q, sent)   # a dummy moved nothing
        assert results[("decode", 0)]["rooms"][str(q["room"])]["bytes"] == sum(sent[:attn_tp]), (q, sent)
