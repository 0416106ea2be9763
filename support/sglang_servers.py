"""Real SGLang servers on CPU for the tests and the benchmark: a tiny random Llama built locally,
`python -m sglang.launch_server` processes (each in its own process group, stopped by its PID),
a PD pair behind `sglang_router --pd-disaggregation --mini-lb`, and greedy requests.

Shared by test_servers.py and examples/bench_sglang.py so both start servers the same way. Every
wait polls a condition with a deadline.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import requests

from kvstage.support.cluster import free_port
from kvstage.support.server_process import ServerProcess, assert_serving, build_tiny_llama

SHIMS = Path(__file__).resolve().parents[1] / "tests" / "sglang_adapter" / "shims"
START_S = 300          # one server start, on a loaded 2-core machine
REQUEST_S = 120


def build_tiny_model(path: Path) -> str:
    """A 2-layer random Llama (2 KV heads, vocabulary 512) saved with transformers."""
    return build_tiny_llama(path, dtype="bfloat16")


class Proc(ServerProcess):
    """A server process in its own process group, stopped by PID (the group's id). SGLang names
    its ZMQ sockets after temporary files it never removes (ipc://$TMPDIR/tmpXXXX): each server
    gets a temp directory of its own, removed when it stops, so a stopped server leaves none."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict):
        super().__init__(name, argv, log, env, scratch_var="TMPDIR", prefix=f"sglang-{name}-")


def wait_healthy(p: Proc, url: str) -> None:
    deadline = time.monotonic() + START_S
    while True:
        assert p.proc.poll() is None, f"{p.name} exited ({p.proc.returncode}):\n{p.tail()}"
        try:
            if requests.get(url, timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        assert time.monotonic() < deadline, f"{p.name} not healthy after {START_S}s:\n{p.tail()}"
        time.sleep(0.5)


def generate(url: str, ids: list[int], procs: list[Proc], max_new: int) -> list[int]:
    """Greedy output ids, retried until REQUEST_S (the router may answer before its workers)."""
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}}
    deadline = time.monotonic() + REQUEST_S
    while True:
        try:
            r = requests.post(f"{url}/generate", json=body, timeout=REQUEST_S)
            if r.status_code == 200:
                return r.json()["output_ids"]
            error = f"HTTP {r.status_code}: {r.text[:300]}"
        except requests.RequestException as exc:
            error = str(exc)
        assert_serving(procs, time.monotonic() < deadline, f"no answer from {url}: {error}")
        time.sleep(1)


def env_for(extra_path: tuple = (), **extra) -> dict:
    """The servers' environment: SGLang's CPU engine, offline, the test shims on PYTHONPATH."""
    paths = [str(SHIMS), *map(str, extra_path), os.environ.get("PYTHONPATH")]
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", HF_HUB_OFFLINE="1", SGLANG_HOST_IP="127.0.0.1",
               PYTHONPATH=os.pathsep.join(p for p in paths if p), **extra)
    for name in ("SGLANG_DISAGG_STAGING_BUFFER", "KVSTAGE_SGLANG_STAGING", "KVSTAGE_STAGING"):
        if name not in extra:   # the staging switch is what the test says, never inherited
            env.pop(name, None)
    return env


def server_argv(model: str, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--device", "cpu",
            "--max-total-tokens", "4096", "--skip-tokenizer-init", "--host", "127.0.0.1", "--port", str(port),
            "--chunked-prefill-size", "16", "--dtype", "float32", "--log-level", "warning", *extra]


def start_pd(model: str, logs: Path, env: dict, backend: str, decode_tp: int = 1,
             extra: tuple = ()) -> tuple[list[Proc], str, str]:
    """Prefill + decode servers over `backend`, then the mini-lb router once both are healthy.
    Returns (processes, router URL, prefill URL); the caller stops the processes (finally)."""
    pp, dp, bp = free_port(), free_port(), free_port()
    # SGLang's prefill overlap schedule records a torch.cuda.Event when it sends a cached prefix
    # early: there is no CUDA here, so the PD servers run without it
    common = ("--disaggregation-transfer-backend", backend, "--disable-overlap-schedule", *extra)
    procs: list[Proc] = []
    try:
        procs.append(Proc("prefill", server_argv(model, pp, *common, "--disaggregation-mode", "prefill",
                                                 "--disaggregation-bootstrap-port", str(bp)),
                          logs / "prefill.log", env))
        procs.append(Proc("decode", server_argv(model, dp, *common, "--disaggregation-mode", "decode",
                                                "--tp", str(decode_tp),
                                                "--disaggregation-decode-retraction-backup", "cpu_tensor"),
                          logs / "decode.log", env))
        for p, port in zip(procs, (pp, dp)):
            wait_healthy(p, f"http://127.0.0.1:{port}/health")
        router, url = start_router(f"http://127.0.0.1:{pp}", bp, f"http://127.0.0.1:{dp}", logs / "router.log", env)
        procs.append(router)
    except BaseException:
        for p in reversed(procs):
            p.stop()
        raise
    return procs, url, f"http://127.0.0.1:{pp}"


def start_router(prefill_url: str, bootstrap_port: int, decode_url: str, log: Path, env: dict) -> tuple[Proc, str]:
    """SGLang's mini-lb PD router in front of one prefill (with its bootstrap port) and one
    decode server; returns the process and its URL."""
    rp = free_port()
    router = Proc("router", [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation", "--mini-lb",
                             "--prefill", prefill_url, str(bootstrap_port), "--decode", decode_url,
                             "--host", "127.0.0.1", "--port", str(rp)], log, env)
    return router, f"http://127.0.0.1:{rp}"


def switch_role(server_url: str, new_role: str) -> dict:
    """SGLang's PD role switch of an idle server started with --enable-pd-role-switch
    (POST /pd_role_switch); its answer. On CPU no decode graph is captured: 0 GB asked for it."""
    r = requests.post(f"{server_url}/pd_role_switch", json={"new_role": new_role, "decode_cuda_graph_memory_gb": 0},
                      timeout=300)
    r.raise_for_status()
    return r.json()
