"""The README's embedding example, run as it stands (issue 54): the real bootstrap server, one
prefill and one decode rank process on loopback, each running the README's blocks; the request's
KV rows and its aux row arrive bit-exact. A change to the public API that breaks the README's
example fails here."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvstage.support.cluster import rank_env, scratch_dir, start_bootstrap

pytestmark = pytest.mark.integration

RANK = Path(__file__).resolve().parents[1] / "readme_rank.py"


def test_the_readme_example_moves_its_request_bit_exact():
    server = start_bootstrap()
    work = Path(scratch_dir("kvstage-readme-"))
    procs = {role: subprocess.Popen([sys.executable, str(RANK), role, server.addr, str(work / f"{role}.npz")],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    env=rank_env(), start_new_session=True)
             for role in ("decode", "prefill")}
    try:
        logs = {}
        for role, proc in procs.items():
            try:
                logs[role], _ = proc.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                pytest.fail(f"the README example's {role} rank still ran after 120 s")
        for role, proc in procs.items():
            assert proc.returncode == 0, f"{role} rank exited {proc.returncode}:\n{logs[role][-3000:]}"
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        server.stop()
    sent = np.load(work / "prefill.npz", allow_pickle=False)
    got = np.load(work / "decode.npz", allow_pickle=False)
    assert sent["kv"].any(), "the prefill's pages hold nothing to compare"
    np.testing.assert_array_equal(got["kv"], sent["kv"])
    first = int(got["first_token"][0])
    assert first != 0 and first in sent["aux"].ravel().tolist(), (first, sent["aux"].ravel())
