"""Real vLLM servers on CPU for the tests and the benchmark: a tiny random Llama built locally,
`python -m vllm.entrypoints.openai.api_server` processes (each in its own process group, stopped
by its PID), prefill/decode pairs over a KV connector (kvstage's or vLLM's NixlConnector), and
greedy completions through the small PD proxy in proxy.py.

Shared by test_servers.py and examples/bench_vllm.py so both start servers the same way. Every
wait polls a condition with a deadline.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import requests

from kvstage.support.server_process import ServerProcess, assert_serving, build_tiny_llama

START_S = 420          # one server start on a loaded 2-core machine (a TP 2 one takes ~3 min)
REQUEST_S = 180
BLOCK = 32
KVSTAGE = {"kv_connector": "KvstageConnector", "kv_connector_module_path": "kvstage.adapters.vllm.connector"}


def build_tiny_model(path: Path) -> str:
    """A 2-layer random Llama (4 heads, 2 KV heads of 32, vocabulary 512), float32, with a
    tokenizer-free config: the servers run with --skip-tokenizer-init and take token ids."""
    return build_tiny_llama(path, dtype="float32", head_dim=32)


class Proc(ServerProcess):
    """A server process in its own process group, stopped by PID (the group's id). Its ZMQ
    sockets (vLLM names them ipc://VLLM_RPC_BASE_PATH/<uuid>, in the temp directory by default)
    go to a directory of its own, removed when it stops: a killed server leaves none behind."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict):
        super().__init__(name, argv, log, env, scratch_var="VLLM_RPC_BASE_PATH", prefix="vllm-rpc-")


def wait_healthy(procs: list[Proc], urls: list[str]) -> None:
    """Every server answers /health, or an assertion naming the one that exited or hung."""
    deadline = time.monotonic() + START_S
    pending = dict(zip(urls, procs))
    while pending:
        for url, p in list(pending.items()):
            assert p.proc.poll() is None, f"{p.name} exited ({p.proc.returncode}):\n{p.tail()}"
            try:
                if requests.get(f"{url}/health", timeout=2).status_code == 200:
                    del pending[url]
            except requests.RequestException:
                pass
        assert time.monotonic() < deadline, "not healthy after %ds: %s" % (
            START_S, "\n".join(f"--- {p.name}\n{p.tail()}" for p in pending.values()))
        if pending:
            time.sleep(0.5)


def env_for(cores: str, **extra) -> dict:
    """A server's environment: offline, a small CPU KV cache, its core binding."""
    # OpenMP threads that spin between parallel regions starve everything else on 2 shared cores
    # (kvstage's heartbeats included): passive waits, and a longer lease than on a quiet host. The
    # CI VM is itself paused by its host now and then (its kernel logged a workqueue "stuck for
    # 53s" once): a pause longer than the lease runs every writer's fence out at once on resume, so
    # the lease is longer than that (docs/vllm.md)
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND=cores,
               OMP_WAIT_POLICY="PASSIVE", KMP_BLOCKTIME="0", KVSTAGE_TIMEOUT_LEASE="90",
               VLLM_HOST_IP="127.0.0.1",
               VLLM_ENABLE_V1_MULTIPROCESSING="1", **extra)
    return env


def server_argv(model: str, port: int, *extra: str, tp: int = 1, kv: dict | None = None) -> list[str]:
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
            "--port", str(port), "--skip-tokenizer-init", "--dtype", "float32", "--block-size", str(BLOCK),
            "--enforce-eager", "--max-model-len", "1024", "--tensor-parallel-size", str(tp),
            "--uvicorn-log-level", "warning", *extra]
    if kv is not None:
        argv += ["--kv-transfer-config", json.dumps(kv)]
    return argv


def kvstage_config(role: str, rendezvous_port: int, **extra) -> dict:
    return {**KVSTAGE, "kv_role": role,
            "kv_connector_extra_config": {"rendezvous_port": rendezvous_port, "host": "127.0.0.1", **extra}}


def nixl_config(role: str, connector: str = "NixlConnector") -> dict:
    """vLLM's own NIXL connector on CPU caches: NixlConnector (pull) or NixlPushConnector."""
    return {"kv_connector": connector, "kv_role": role, "kv_buffer_device": "cpu",
            "kv_connector_extra_config": {"use_host_buffer": False}}


def complete(url: str, ids: list[int], max_tokens: int, procs: list[Proc], kv_transfer_params: dict | None = None,
             timeout: float = REQUEST_S, retry_errors: bool = True) -> dict:
    """One greedy completion from token ids (the response JSON), retried until the deadline
    while the server is not ready (`retry_errors`: also on an HTTP 5xx; off, such an answer is an
    assertion at once, with the servers' logs); an assertion naming the server that exited."""
    body = {"model": "m", "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    deadline = time.monotonic() + timeout
    while True:
        try:
            r = requests.post(f"{url}/v1/completions", json=body, timeout=timeout)
            if r.status_code == 200:
                return r.json()
            error = f"HTTP {r.status_code}: {r.text[:500]}"
            if r.status_code < 500 and r.status_code != 404:
                raise AssertionError(f"{url}: {error}")
            if not retry_errors and r.status_code >= 500:
                assert_serving(procs, False, f"{url}: {error}")
        except requests.RequestException as exc:
            error = str(exc)
        assert_serving(procs, time.monotonic() < deadline, f"no answer from {url}: {error}")
        time.sleep(1)


def token_ids(response: dict) -> list[int]:
    choice = response["choices"][0]
    return list(choice.get("token_ids") or [])


def metric(url: str, name: str, **labels) -> float:
    """Sum of a Prometheus counter's series carrying `labels` at `url`/metrics."""
    text = requests.get(f"{url}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if not (line.startswith(name + "{") or line.startswith(name + " ")):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total
