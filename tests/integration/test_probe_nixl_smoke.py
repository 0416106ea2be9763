"""examples/probe_nixl_completion.py, the probe behind docs/backends.md's "a write completes
when the target polls", in its smallest configuration so it cannot rot: a real NIXL writer and a
real target process. No timing is checked: every write must complete (the probe exits non-zero
otherwise) and every tag must reach the target."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "probe_nixl_completion.py"


def test_the_probe_runs_and_every_tag_lands():
    argv = [sys.executable, str(SCRIPT), "--target-poll-ms", "0.1,5", "--ranges", "4", "--range-kib", "4",
            "--writes", "3"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        stdout, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("probe_nixl_completion.py still ran after 120 s")
    assert proc.returncode == 0, stdout[-4000:]
    rows = re.findall(r"^ +([\d.]+) ms \|.*\| +(\d+) of (\d+) +\| (\d+)$", stdout, re.M)
    assert [r[0] for r in rows] == ["0.1", "5.0"], stdout
    assert all(int(r[3]) == int(r[2]) + 3 for r in rows), stdout   # the 3 warm-up writes' tags too
