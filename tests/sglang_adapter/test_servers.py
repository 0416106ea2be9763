"""Real SGLang servers on CPU: `python -m sglang.launch_server` prefill and decode with
`--disaggregation-transfer-backend kvstage`, behind `sglang_router --pd-disaggregation --mini-lb`.
Greedy output through kvstage must equal a single (non-PD) server's, token for token, on the
direct path and on the staged path (prefill TP 1 -> decode TP 2). The model is a tiny random
Llama built here with transformers, served in float32 (a TP 2 decode's all-reduce rounds bf16
differently from one rank's sums, which can flip a greedy token after a dozen steps: that is
arithmetic, not transfer); no tokenizer (token ids in, token ids out). Every server
runs in its own process group and is stopped by its PID; every wait polls a condition with a
deadline.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

HERE = Path(__file__).resolve().parent
START_S = 300          # one server start, on a loaded 2-core machine
REQUEST_S = 120
MAX_NEW = 16


def free_port() -> int:
    """A free port below Linux's ephemeral range: the servers open many sockets of their own on
    ephemeral ports, which could take one picked there before its server binds it."""
    rnd = random.Random()
    for _ in range(200):
        port = rnd.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise RuntimeError("no free port in 20000-32000")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=2, vocab_size=512, max_position_embeddings=1024, bos_token_id=1,
                      eos_token_id=2, tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return str(path)


PROMPTS = [[random.Random(i).randrange(3, 512) for _ in range(n)] for i, n in enumerate((5, 23, 40, 57))]


class Proc:
    """A server process in its own process group, stopped by PID (the group's id)."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict):
        self.name, self.log = name, log
        self.proc = subprocess.Popen(argv, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        try:   # whatever of the group is left (scheduler and detokenizer children)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


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


def generate(url: str, ids: list[int], procs: list[Proc]) -> list[int]:
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}}
    deadline = time.monotonic() + REQUEST_S
    while True:   # the router may answer before its workers do; retry until the deadline
        try:
            r = requests.post(f"{url}/generate", json=body, timeout=REQUEST_S)
            if r.status_code == 200:
                return r.json()["output_ids"]
            error = f"HTTP {r.status_code}: {r.text[:300]}"
        except requests.RequestException as exc:
            error = str(exc)
        for p in procs:
            assert p.proc.poll() is None, f"{p.name} exited ({p.proc.returncode}):\n{p.tail()}"
        assert time.monotonic() < deadline, f"no answer from {url}: {error}\n" + "\n".join(
            f"--- {p.name}\n{p.tail()}" for p in procs)
        time.sleep(1)


def env_for(**extra) -> dict:
    shims = str(HERE / "shims")
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", HF_HUB_OFFLINE="1", SGLANG_HOST_IP="127.0.0.1",
               PYTHONPATH=os.pathsep.join(p for p in (shims, os.environ.get("PYTHONPATH")) if p), **extra)
    env.pop("SGLANG_DISAGG_STAGING_BUFFER", None)
    return env


def server_argv(model: str, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--device", "cpu",
            "--max-total-tokens", "4096", "--skip-tokenizer-init", "--host", "127.0.0.1", "--port", str(port),
            "--chunked-prefill-size", "16", "--dtype", "float32", "--log-level", "warning", *extra]


@pytest.fixture(scope="module")
def reference(tiny_model, tmp_path_factory) -> list[list[int]]:
    """Greedy output of one ordinary server."""
    logs = tmp_path_factory.mktemp("single")
    port = free_port()
    p = Proc("single", server_argv(tiny_model, port), logs / "single.log", env_for())
    try:
        wait_healthy(p, f"http://127.0.0.1:{port}/health")
        return [generate(f"http://127.0.0.1:{port}", ids, [p]) for ids in PROMPTS]
    finally:
        p.stop()


@pytest.mark.timeout(1200)   # three server starts (and the reference server's, on first use)
@pytest.mark.parametrize("staged,decode_tp", [(False, 1), (True, 2)], ids=["direct-P1-D1", "staged-P1-D2"])
def test_pd_through_kvstage_equals_a_single_server(tiny_model, reference, tmp_path, staged, decode_tp):
    env = env_for(SGLANG_DISAGG_STAGING_BUFFER="1" if staged else "0",
                  # SGLang's CPU engine binds each TP rank's OpenMP threads to its own cores
                  SGLANG_CPU_OMP_THREADS_BIND="|".join(str(i % (os.cpu_count() or 1)) for i in range(decode_tp)))
    pp, dp, bp = free_port(), free_port(), free_port()
    # SGLang's prefill overlap schedule records a torch.cuda.Event when it sends a cached prefix
    # early: there is no CUDA here, so the PD servers run without it
    common = ("--disaggregation-transfer-backend", "kvstage", "--disable-overlap-schedule")
    procs: list[Proc] = []
    try:
        procs.append(Proc("prefill", server_argv(tiny_model, pp, *common, "--disaggregation-mode", "prefill",
                                                 "--disaggregation-bootstrap-port", str(bp)),
                          tmp_path / "prefill.log", env))
        procs.append(Proc("decode", server_argv(tiny_model, dp, *common, "--disaggregation-mode", "decode",
                                                "--tp", str(decode_tp),
                                                "--disaggregation-decode-retraction-backup", "cpu_tensor"),
                          tmp_path / "decode.log", env))
        for p, port in zip(procs, (pp, dp)):
            wait_healthy(p, f"http://127.0.0.1:{port}/health")
        rp = free_port()
        procs.append(Proc("router", [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
                                     "--mini-lb", "--prefill", f"http://127.0.0.1:{pp}", str(bp),
                                     "--decode", f"http://127.0.0.1:{dp}", "--host", "127.0.0.1",
                                     "--port", str(rp)], tmp_path / "router.log", env))
        got = [generate(f"http://127.0.0.1:{rp}", ids, procs) for ids in PROMPTS]
        assert got == reference
        assert all(len(x) == MAX_NEW for x in got)
        text = (tmp_path / "prefill.log").read_text() + (tmp_path / "decode.log").read_text()
        assert "Traceback" not in text, text[-4000:]
    finally:
        for p in reversed(procs):
            p.stop()
    (tmp_path / "outputs.json").write_text(json.dumps({"reference": reference, "pd": got}))
