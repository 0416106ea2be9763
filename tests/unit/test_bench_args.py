"""examples/bench.py refuses bad arguments with a usage error (exit 2) before it starts anything;
--inflight 0 used to run (and hang) for good."""

from __future__ import annotations

import subprocess

import pytest
from example_runs import run_example


def run_bench(*args: str, timeout: float = 20.0) -> subprocess.CompletedProcess:
    return run_example("bench.py", ["--json", "", *args], timeout, merge_stderr=False)


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
