"""examples/bench.py refuses bad arguments with a usage error (exit 2) before it starts anything;
--inflight 0 used to run (and hang) for good."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "examples" / "bench.py"


def run_bench(*args: str, timeout: float = 20.0) -> subprocess.CompletedProcess:
    """bench.py in its own process group, killed with everything it started on timeout."""
    proc = subprocess.Popen([sys.executable, str(BENCH), "--json", "", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"bench.py {' '.join(args)} still ran after {timeout} s")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.parametrize("args, option", [
    (["--inflight", "0"], "--inflight"), (["--inflight", "1,-4"], "--inflight"), (["--inflight", "1,x"], "--inflight"),
    (["--lengths", "0"], "--lengths"), (["--lengths", ""], "--lengths"), (["--layers", "0"], "--layers"),
    (["--heads", "-1"], "--heads"), (["--page-size", "1.5"], "--page-size"), (["--chunk-tokens", "-1"], "--chunk-tokens"),
    (["--latency-requests", "0"], "--latency-requests"), (["--inflight-tokens", "0"], "--inflight-tokens"),
    (["--ring-mb", "0"], "--ring-mb"), (["--buffer-mb", "nan"], "--buffer-mb"), (["--transports", "ucx"], "--transports"),
])
def test_bad_argument_is_a_usage_error(args, option):
    res = run_bench("--transports", "nixl", *args)
    assert res.returncode == 2 and option in res.stderr, (res.returncode, res.stderr[-2000:])
