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


@pytest.mark.parametrize("attn_tp,backend,draft", [(1, "nixl", None), (2, "mooncake", {"layers": 1, "head_dim": 8})],
                         ids=["CP2xTP1-D1-nixl", "CP2xTP2-D1-mooncake-mtp"])
def test_dsa_cache_layer_split_moves_each_cp_ranks_layers(tmp_path, model_3_layers, bootstrap_server, attn_tp,
                                                          backend, draft):
    """SGLang's DSA cache layer split (--enable-dsa-cache-layer-split, GLM-5.2's DSA models): each
    CP rank holds a contiguous range of the layers (get_layer_shard_range: [0, 2) and [2, 3) of
    3), KV and DSA indexer pages, and lists only those in its KVArgs; kvstage serves the CP ranks
    as PP stages, each sending its layers, the last one the aux row and the draft's (MLA MTP)
    entry, as SGLang sends the draft from the last CP rank only. The decode checks every byte of
    every layer, the indexer pages and the aux row."""
    reqs = requests_for(53, 5, prefix={1: 1, 3: 1})
    results = run(tmp_path, model_3_layers, bootstrap_server, 2 * attn_tp, 1, reqs, backend=backend, prefill_cp=2,
                  layer_split=True, layers=3, mla=True, draft=draft, state={"slots": 12, "swa_pages": 99, "dsa": True})
    assert set(results) == {("prefill", rank) for rank in range(2 * attn_tp)} | {("decode", 0)}
    expect(results, reqs, lambda i: "Success")
    rooms = results[("decode", 0)]["rooms"]
    assert all(rooms[str(q["room"])]["state_bad"] == [] for q in reqs), rooms
    latent, index_page = 4 * 8 * 2, 4 * 3 * 2   # one page of one layer: 4 tokens x 8 bf16; 4 tokens x 3 int16
    for q in reqs:   # world rank = CP rank x attention TP + attention TP rank: CP rank 0's ranks wrote its two layers
        sent = [results[("prefill", rank)]["rooms"][str(q["room"])]["bytes"] for rank in range(2 * attn_tp)]
        assert sum(sent[:attn_tp]) == (q["pages"] - q["prefix"]) * 2 * (latent + index_page), (q, sent)
        assert rooms[str(q["room"])]["bytes"] == sum(sent), (q, sent, rooms[str(q["room"])])
