"""examples/probe_nixl_completion.py, the probe behind docs/backends.md's "a write completes
when the target polls", in its smallest configuration so it cannot rot: a real NIXL writer and a
real target process. No timing is checked: every write must complete (the probe exits non-zero
otherwise) and every tag must reach the target."""

from __future__ import annotations

import re

from example_runs import run_example


def test_the_probe_runs_and_every_tag_lands():
    res = run_example("probe_nixl_completion.py", ["--target-poll-ms", "0.1,5", "--ranges", "4", "--range-kib", "4",
                                                   "--writes", "3"], timeout=120)
    stdout = res.stdout
    assert res.returncode == 0, stdout[-4000:]
    rows = re.findall(r"^ +([\d.]+) ms \|.*\| +(\d+) of (\d+) +\| (\d+)$", stdout, re.M)
    assert [r[0] for r in rows] == ["0.1", "5.0"], stdout
    assert all(int(r[3]) == int(r[2]) + 3 for r in rows), stdout   # the 3 warm-up writes' tags too
