"""Real SGLang servers on CPU: `python -m sglang.launch_server` prefill and decode with
`--disaggregation-transfer-backend kvstage`, behind `sglang_router --pd-disaggregation --mini-lb`.
Greedy output through kvstage must equal a single (non-PD) server's, token for token, on the
direct path and on the staged path (prefill TP 1 -> decode TP 2), and before and after the two
servers switch roles (SGLang's --enable-pd-role-switch, POST /pd_role_switch), and with
SGLang's prefill_complete allocation policy. The model is a tiny random
Llama built here with transformers, served in float32 (a TP 2 decode's all-reduce rounds bf16
differently from one rank's sums, which can flip a greedy token after a dozen steps: that is
arithmetic, not transfer); no tokenizer (token ids in, token ids out). Server handling is in
servers.py (also used by examples/bench_sglang.py).
"""

from __future__ import annotations

import json
import os
import random

import pytest
import requests

from kvstage.support.cluster import free_port
from kvstage.support.sglang_servers import (
    Proc,
    build_tiny_model,
    env_for,
    generate,
    server_argv,
    start_pd,
    start_router,
    switch_role,
    wait_healthy,
)

MAX_NEW = 16
PROMPTS = [[random.Random(i).randrange(3, 512) for _ in range(n)] for i, n in enumerate((5, 23, 40, 57))]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def reference(tiny_model, tmp_path_factory) -> list[list[int]]:
    """Greedy output of one ordinary server."""
    logs = tmp_path_factory.mktemp("single")
    port = free_port()
    p = Proc("single", server_argv(tiny_model, port), logs / "single.log", env_for())
    try:
        wait_healthy(p, f"http://127.0.0.1:{port}/health")
        return [generate(f"http://127.0.0.1:{port}", ids, [p], MAX_NEW) for ids in PROMPTS]
    finally:
        p.stop()


@pytest.mark.timeout(1200)   # three server starts (and the reference server's, on first use)
@pytest.mark.parametrize("staged,decode_tp", [(False, 1), (True, 2)], ids=["direct-P1-D1", "staged-P1-D2"])
def test_pd_through_kvstage_equals_a_single_server(tiny_model, reference, tmp_path, staged, decode_tp):
    env = env_for(SGLANG_DISAGG_STAGING_BUFFER="1" if staged else "0",
                  # SGLang's CPU engine binds each TP rank's OpenMP threads to its own cores
                  SGLANG_CPU_OMP_THREADS_BIND="|".join(str(i % (os.cpu_count() or 1)) for i in range(decode_tp)))
    procs, url, _ = start_pd(tiny_model, tmp_path, env, "kvstage", decode_tp)
    try:
        got = [generate(url, ids, procs, MAX_NEW) for ids in PROMPTS]
        assert got == reference
        # each server's ZMQ sockets are in its own temp directory, which goes when it stops
        assert all(os.listdir(p.scratch) for p in procs[:2]), [p.scratch for p in procs]
        assert all(len(x) == MAX_NEW for x in got)
        text = (tmp_path / "prefill.log").read_text() + (tmp_path / "decode.log").read_text()
        assert "Traceback" not in text, text[-4000:]
    finally:
        for p in reversed(procs):
            p.stop()
    (tmp_path / "outputs.json").write_text(json.dumps({"reference": reference, "pd": got}))


@pytest.mark.timeout(1200)   # two server starts (and the reference server's, on first use)
def test_pd_with_prefill_complete_allocation_through_kvstage_equals_a_single_server(tiny_model, reference, tmp_path):
    """SGLang's --disaggregation-decode-allocation-policy prefill_complete on both servers: the
    decode reserves a request's pages only once the prefill computed it (the prefill's word comes
    over SGLang's status channel, kvstage's adapter reads it: prefill_complete.py); the KV then
    moves through kvstage as for any request."""
    env = env_for(SGLANG_DISAGG_STAGING_BUFFER="0", SGLANG_CPU_OMP_THREADS_BIND="0")
    procs, url, prefill_url = start_pd(tiny_model, tmp_path, env, "kvstage",
                                       extra=("--disaggregation-decode-allocation-policy", "prefill_complete"))
    try:
        assert [generate(url, ids, procs, MAX_NEW) for ids in PROMPTS] == reference
        info = requests.get(f"{prefill_url}/server_info", timeout=30).json()
        assert info["disaggregation_decode_allocation_policy"] == "prefill_complete", info
        text = (tmp_path / "prefill.log").read_text() + (tmp_path / "decode.log").read_text()
        assert "Traceback" not in text, text[-4000:]
    finally:
        for p in reversed(procs):
            p.stop()


@pytest.mark.timeout(1200)   # two server starts, two routers (and the reference server's, on first use)
def test_servers_switch_roles_and_serve_through_kvstage_both_ways(tiny_model, reference, tmp_path):
    """Server A starts as the prefill and B as the decode, both with --enable-pd-role-switch (each
    then runs a bootstrap server, on its own port); the prompts go A -> B, then SGLang switches A
    to decode and B to prefill (kvstage's managers torn down and built again in the other role
    over the same KV pool), and a router with the roles swapped sends the prompts B -> A."""
    env = env_for(SGLANG_DISAGG_STAGING_BUFFER="0", SGLANG_CPU_OMP_THREADS_BIND="0")
    common = ("--disaggregation-transfer-backend", "kvstage", "--disable-overlap-schedule", "--enable-pd-role-switch")
    (pa, ba), (pb, bb) = (free_port(), free_port()), (free_port(), free_port())
    a, b = f"http://127.0.0.1:{pa}", f"http://127.0.0.1:{pb}"
    procs = [Proc("A", server_argv(tiny_model, pa, *common, "--disaggregation-mode", "prefill",
                                   "--disaggregation-bootstrap-port", str(ba)), tmp_path / "A.log", env),
             Proc("B", server_argv(tiny_model, pb, *common, "--disaggregation-mode", "decode",
                                   "--disaggregation-bootstrap-port", str(bb),
                                   "--disaggregation-decode-retraction-backup", "cpu_tensor"), tmp_path / "B.log", env)]
    try:
        for p, url in zip(procs, (a, b)):
            wait_healthy(p, f"{url}/health")
        router, url = start_router(a, ba, b, tmp_path / "router-1.log", env)
        procs.append(router)
        assert [generate(url, ids, procs, MAX_NEW) for ids in PROMPTS] == reference
        router.stop()
        procs.remove(router)
        answers = [switch_role(a, "decode"), switch_role(b, "prefill")]
        assert [(x["success"], x["old_role"], x["new_role"]) for x in answers] == \
            [(True, "prefill", "decode"), (True, "decode", "prefill")], answers
        router, url = start_router(b, bb, a, tmp_path / "router-2.log", env)
        procs.append(router)
        assert [generate(url, ids, procs, MAX_NEW) for ids in PROMPTS] == reference
        text = (tmp_path / "A.log").read_text() + (tmp_path / "B.log").read_text()
        assert "Traceback" not in text, text[-4000:]
    finally:
        for p in reversed(procs):
            p.stop()
