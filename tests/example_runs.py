"""Running an example script as a test's subprocess: in its own process group, killed with
everything it started when it overruns, so a hung script fails its test instead of the run.
(tests/ is on sys.path: pytest puts a conftest's folder there.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run_example(name: str, args: list[str], timeout: float, *, merge_stderr: bool = True) -> subprocess.CompletedProcess:
    """examples/`name` run with `args`; its stderr goes into stdout unless `merge_stderr` is False."""
    proc = subprocess.Popen([sys.executable, str(EXAMPLES / name), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"{name} {' '.join(args)} still ran after {timeout:g} s")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
