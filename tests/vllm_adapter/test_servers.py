"""kvstage's connector inside real vLLM servers on CPU: prefill and decode api_servers with
`--kv-transfer-config` naming kvstage.adapters.vllm.connector, the two-step PD proxy
(proxy.py), a tiny random Llama in float32. Greedy output through PD equals the prefill server's
own answer as a single server, token for token, and kvstage's Prometheus counters on the decode
ranks show the KV arrived by the expected path (so a decode that recomputed the prompt itself
would fail); the prefill's writes show it went layer by layer (one write per layer and rank). P1 -> D1 is direct; P1 -> D2 (decode TP 2, 1 KV head per rank) is staged."""

from __future__ import annotations

import os
import time

import pytest

from kvstage.support.cluster import free_port
from kvstage.support.vllm_proxy import pd_complete
from kvstage.support.vllm_servers import (
    Proc,
    build_tiny_model,
    complete,
    env_for,
    kvstage_config,
    metric,
    server_argv,
    token_ids,
    wait_healthy,
)

MAX_NEW = 12
PROMPTS = [list(range(5, 11)), list(range(3, 36)), list(range(40, 97)), [7] * 5 + list(range(100, 170))]
# a decode prefix-cache hit: the decode holds the first pages of PROMPTS[2] after its PD run
EXTENDED = PROMPTS[2] + list(range(200, 230))
ENV = {"KVSTAGE_RING_MB": "16", "KVSTAGE_STAGING_BUFFER_MB": "8",
       # layer-wise sending (the connector's default) with a write per layer even for these short
       # prompts (kvstage's defaults group 4 layers, send prompts under 512 tokens per chunk, and
       # merge the direct path's ready layers while a write is in flight)
       "KVSTAGE_LAYER_GROUP": "1", "KVSTAGE_LAYERWISE_MIN_TOKENS": "0", "KVSTAGE_LAYER_BATCHING": "0"}
LAYERS = 2                  # build_tiny_model's
# vLLM's CPU workers pin themselves (and so kvstage's threads in them) to their cores, where
# vLLM's worker loop spins waiting for the next step; with three pinned servers on 2 cores,
# kvstage's heartbeats starved for over 30 s and the TP 2 decode's rooms failed (peer lost).
# Unpinned, the kernel shares the cores (docs/vllm.md)
BIND = "nobind"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


class Pair:
    def __init__(self, model: str, logs, decode_tp: int):
        self.pp, self.dp = free_port(), free_port()
        self.pm, self.dm = free_port(), free_port()
        p_kv = kvstage_config("kv_producer", free_port(), metrics_port=self.pm)
        d_kv = kvstage_config("kv_consumer", free_port(), metrics_port=self.dm)
        self.prefill = Proc("prefill", server_argv(model, self.pp, "--served-model-name", "m", kv=p_kv),
                            logs / "prefill.log", env_for(BIND, **ENV))
        self.decode = Proc(f"decode-tp{decode_tp}", server_argv(model, self.dp, "--served-model-name", "m",
                                                               tp=decode_tp, kv=d_kv),
                           logs / "decode.log", env_for(BIND, **ENV))
        self.procs = [self.prefill, self.decode]
        self.p_url, self.d_url = f"http://127.0.0.1:{self.pp}", f"http://127.0.0.1:{self.dp}"

    def stop(self):
        for p in self.procs:
            p.stop()


def run_pd(pair: Pair, decode_tp: int, path: str):
    wait_healthy(pair.procs, [pair.p_url, pair.d_url])
    # each server's ZMQ sockets are in its own directory, which goes when it stops (support.server_process.ServerProcess)
    assert all(os.listdir(p.scratch) for p in pair.procs), [p.scratch for p in pair.procs]
    refs = [token_ids(complete(pair.p_url, ids, MAX_NEW, pair.procs)) for ids in PROMPTS + [EXTENDED]]
    for ids, ref in zip(PROMPTS + [EXTENDED], refs):
        got, params, _, _ = pd_complete(pair.p_url, pair.d_url, ids, MAX_NEW, pair.procs)
        assert len(ref) == MAX_NEW and got == ref, f"{len(ids)}-token prompt: PD {got} != single server {ref}"
        assert params["kvstage_tp_size"] == 1 and params["kvstage_engine"].startswith("vllm-prefill@")
    other = "staged" if path == "direct" else "direct"
    for rank in range(decode_tp):
        url = f"http://127.0.0.1:{pair.dm + rank}"
        assert metric(url, "kvstage_received_bytes_total", path=path) > 0, f"decode rank {rank}: no {path} bytes"
        assert metric(url, "kvstage_received_bytes_total", path=other) == 0
        assert metric(url, "kvstage_requests_total", outcome="success") == len(PROMPTS) + 1
        assert metric(url, "kvstage_requests_total", outcome="failed") == 0
    p_url = f"http://127.0.0.1:{pair.pm}"
    assert metric(p_url, "kvstage_requests_total", outcome="success") == len(PROMPTS) + 1
    assert metric(p_url, "kvstage_sent_bytes_total", path=path) > 0
    # layer-wise: at least one write per layer and decode rank (chunk-wise makes one per rank)
    writes = metric(p_url, "kvstage_backend_writes_total", path=path)
    assert writes >= LAYERS * decode_tp * (len(PROMPTS) + 1), f"{writes} backend writes: not layer by layer"
    assert metric(p_url, "kvstage_requests_active") == 0
    # the prefill held each request's blocks until its transfer ended, then freed them all
    deadline = time.monotonic() + 60
    while (usage := metric(pair.p_url, "vllm:kv_cache_usage_perc")) > 0:
        assert time.monotonic() < deadline, f"the prefill server still holds {usage:.1%} of its KV cache"
        time.sleep(0.5)
    # the same counts through vLLM's connector stats: each server's own /metrics and its log
    n = len(PROMPTS) + 1
    for url, proc, count in ((pair.p_url, pair.prefill, n), (pair.d_url, pair.decode, n * decode_tp)):
        wait_for(lambda: metric(url, "vllm:kvstage_transfers_succeeded_total") >= count, f"{proc.name}: vllm stats")
        assert metric(url, "vllm:kvstage_transfers_succeeded_total") == count
        assert metric(url, f"vllm:kvstage_{path}_transfers_total") == count
        assert metric(url, f"vllm:kvstage_{other}_transfers_total") == 0
        assert metric(url, "vllm:kvstage_transfers_failed_total") == 0
        assert metric(url, "vllm:kvstage_transfer_bytes_total") > 0
        wait_for(lambda: "KV Transfer metrics: Num successful transfers=" in proc.tail(10 ** 7),
                 f"{proc.name}: vLLM's KV transfer log line")


def wait_for(cond, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.5)


@pytest.mark.timeout(900)
def test_p1_to_d1_direct(model, tmp_path):
    pair = Pair(model, tmp_path, 1)
    try:
        run_pd(pair, 1, "direct")
    finally:
        pair.stop()


@pytest.mark.timeout(900)
def test_p1_to_d2_staged(model, tmp_path):
    pair = Pair(model, tmp_path, 2)
    try:
        run_pd(pair, 2, "staged")
    finally:
        pair.stop()
