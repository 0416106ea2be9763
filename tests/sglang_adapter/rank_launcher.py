"""Starts the harness's rank processes (rank.py) forked from a process that has SGLang imported.

Importing SGLang's transfer classes costs a rank about 11 s of CPU (torch, transformers and
SGLang's layers, `python -X importtime`), which on CI's 2 cores was most of the scheduler-class
tests' time. A multiprocessing forkserver imports them once per test session (`PRELOAD`); every
rank is a fork of it that then runs rank.py as `__main__` with its own argv, environment and log
file, so each rank is still its own process, with its own pid, sockets and exit status (-9 when
it kills itself as the harness's `die_at_room` asks).

What a rank reads from its environment is read after the fork (SGLang's `envs`, kvstage's
configuration, the adapter's plugin flags); what is read at import time is the forkserver's, so
conftest.py sets those (HF_HUB_OFFLINE) before the first launch. Nothing here is kvstage's: the
ranks drive kvstage exactly as before.

A rank with a CUDA KV cache (`fresh=True`) is spawned instead: a fresh interpreter that imports
everything itself. CUDA cannot be used in a process forked after CUDA was initialised, and
SGLang's modules ask torch about CUDA devices when they are imported (which initialises it on a
machine that has one), so a fork of the preloaded server would hold a CUDA it cannot use.
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RANK = HERE / "rank.py"
PRELOAD = ["torch", "numpy", "sglang.srt.disaggregation.utils", "sglang.srt.server_args",
           "sglang.srt.runtime_context", "sglang.srt.disaggregation.base.conn", "sglang.srt.plugins",
           "decode_queue", "pp_stage", "state_harness"]

_ctx = multiprocessing.get_context("forkserver")
_ctx.set_forkserver_preload(PRELOAD)
_fresh_ctx = multiprocessing.get_context("spawn")


def _run_rank(argv: list[str], env: dict[str, str], log: str) -> None:
    """The forked child: rank.py's main with this rank's argv, environment and log."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [str(RANK), *argv]
    try:
        runpy.run_path(str(RANK), run_name="__main__")
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


class RankProcess:
    """One rank, forked from the preloaded server (or spawned afresh with `fresh`, for CUDA):
    `wait`, `poll`, `kill` and `returncode` as a subprocess.Popen has them."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path, *, fresh: bool = False) -> None:
        ctx = _fresh_ctx if fresh else _ctx
        self._proc = ctx.Process(target=_run_rank, args=(argv, dict(env), str(log)), daemon=False)
        self._proc.start()
        self.pid = self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        start = time.monotonic()
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise TimeoutError(f"rank {self.pid} still running after {time.monotonic() - start:.0f} s")
        return self._proc.exitcode

    def kill(self) -> None:
        self._proc.kill()
