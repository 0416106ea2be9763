"""DP attention (DeepSeek-style deployments): each DP rank of a prefill or decode instance is its
own attention-TP group (here attention TP 1, so each rank holds every KV head), and a request is
served by one prefill DP rank, named to the decode side as `prefill_dp_rank`. kvstage's decode
receiver looks the prefill engine up by the instance's rendezvous address plus that DP rank
(`sglang-prefill@HOST:PORT/dpR`).

Each prefill DP rank plays only the requests the "router" sent to it; each decode rank
`init(prefill_dp_rank)`s its own. Every byte is checked on decode (the KV pattern is per room),
every other page keeps its sentinel, and the engine each receiver bound to is the request's
prefill DP rank. Requests go to prefill DP rank `room % dp_size`, as SGLang's router sends them by
default (SGLang's own sender refuses another rank unless
SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK=1).
"""

from __future__ import annotations

import pytest
from scenario import requests_for, run


@pytest.mark.parametrize("decode_dp", [1, 2], ids=["P-DP2-D-DP1", "P-DP2-D-DP2"])
def test_requests_reach_their_prefill_dp_rank(tmp_path, model_dir, bootstrap_server, decode_dp):
    reqs = requests_for(23, 6, prefix={3: 1})
    for i, q in enumerate(reqs):
        q["dp_rank"] = q["room"] % 2      # SGLang's routing by default (follow_bootstrap_room)
        q["decode_dp"] = i % decode_dp
    results = run(tmp_path, model_dir, bootstrap_server, 2, decode_dp, reqs, prefill_dp=2, decode_dp=decode_dp)
    for (role, rank), rep in results.items():
        assert rep["errors"] == [], f"{role}{rank}: {rep['errors'][:5]}"
        mine = [q for q in reqs if (q["dp_rank"] if role == "prefill" else q["decode_dp"]) == rank]
        assert sorted(rep["rooms"]) == sorted(str(q["room"]) for q in mine), (role, rank)
        for q in mine:
            row = rep["rooms"][str(q["room"])]
            assert row.get("result") == "Success", (role, rank, row)
            if role == "decode":
                assert row["aux_room"] == q["room"] and row["aux_ids_ok"], row
                assert row["prefill_engine"].endswith(f"#dp{q['dp_rank']}"), row
            else:
                assert row["prefix_seen"] == q["prefix"], row
    assert {q["dp_rank"] for q in reqs} == {0, 1}
