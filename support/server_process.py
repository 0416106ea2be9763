"""A serving engine's real server process, for the adapter tests and benchmarks (SGLang's in
sglang_servers.py, vLLM's in vllm_servers.py): started in a process group of its own with a
scratch directory of its own for the IPC sockets the engine leaves behind, stopped by its group
(whatever children it forked go too), the scratch directory removed; and the tiny random Llama
both build locally."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path


class ServerProcess:
    """`scratch_var`: the environment variable naming where the engine puts its IPC sockets; it
    gets a directory of its own, removed when the server stops."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict, *, scratch_var: str, prefix: str):
        self.name, self.log = name, log
        self.scratch = tempfile.mkdtemp(prefix=prefix)
        self.proc = subprocess.Popen(argv, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                     env={**env, scratch_var: self.scratch}, start_new_session=True)

    def tail(self, n: int = 6000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        try:   # whatever of the group is left (the engine's scheduler, detokenizer, workers)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        shutil.rmtree(self.scratch, ignore_errors=True)


def assert_serving(procs: list[ServerProcess], in_time: bool, what: str) -> None:
    """Every server still runs, and `in_time` (its deadline not passed) holds; else an
    AssertionError with `what` and every server's log tail."""
    for p in procs:
        assert p.proc.poll() is None, f"{p.name} exited ({p.proc.returncode}):\n{p.tail()}"
    assert in_time, f"{what}\n" + "\n".join(f"--- {p.name}\n{p.tail()}" for p in procs)


def build_tiny_llama(path: Path, *, dtype: str, head_dim: int | None = None) -> str:
    """A 2-layer random Llama (hidden 64, 4 heads, 2 KV heads, vocabulary 512) saved with
    transformers in `dtype`; `head_dim` None: hidden / heads (16)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    extra = {"head_dim": head_dim} if head_dim is not None else {}
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=2, vocab_size=512, max_position_embeddings=1024, bos_token_id=1,
                      eos_token_id=2, tie_word_embeddings=False, **extra)
    LlamaForCausalLM(cfg).to(getattr(torch, dtype)).save_pretrained(path)
    return str(path)
