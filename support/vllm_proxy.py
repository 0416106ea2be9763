"""The PD proxy of the tests and the benchmark, as two client calls (what vLLM's toy proxies do
over HTTP): the request goes to the prefill server with max_tokens 1 and `do_remote_decode`,
then to the decode server with the prefill response's `kv_transfer_params`, unchanged. This works
the same for kvstage's connector and vLLM's NixlConnector; nothing in it knows the connector."""

from __future__ import annotations

import time

from kvstage.support.vllm_servers import Proc, complete, token_ids


def pd_complete(prefill_url: str, decode_url: str, ids: list[int], max_tokens: int,
                procs: list[Proc]) -> tuple[list[int], dict, float, float]:
    """(output ids, the prefill's kv_transfer_params, prefill seconds, decode seconds)."""
    t0 = time.perf_counter()
    first = complete(prefill_url, ids, 1, procs, kv_transfer_params={"do_remote_decode": True})
    t1 = time.perf_counter()
    params = first.get("kv_transfer_params")
    assert params, f"the prefill server returned no kv_transfer_params: {first}"
    # the decode server is up by now: an error is this request's (its KV load failed), and the
    # same kv_transfer_params (a room that has ended) would fail again
    out = complete(decode_url, ids, max_tokens, procs, kv_transfer_params=params, retry_errors=False)
    return token_ids(out), params, t1 - t0, time.perf_counter() - t1
