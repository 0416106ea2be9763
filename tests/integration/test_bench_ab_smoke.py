"""examples/bench_ab.py in its smallest configuration, so it cannot rot: two trees (a commit in
a git worktree, and this tree as it is), one round, real rank processes over real NIXL. No
figure is checked; what is checked is that each tree was measured in its own process, the table
names both, and the worktree is gone afterwards."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from example_runs import run_example

REPO = Path(__file__).resolve().parents[2]


def test_two_trees_are_measured_in_alternated_rounds_and_the_worktree_removed(tmp_path):
    out = tmp_path / "ab.json"
    argv = ["--rev", "HEAD", "--tree", f"here={REPO}", "--rounds", "2", "--measure", "direct-latency",
            "--requests", "11", "--json", str(out)]
    res = run_example("bench_ab.py", argv, timeout=300)
    assert res.returncode == 0, res.stdout[-4000:]
    rounds = [line.split()[:3] for line in res.stdout.splitlines() if line.startswith("round ")]
    assert rounds == [["round", "0", "HEAD"], ["round", "0", "here"], ["round", "1", "here"], ["round", "1", "HEAD"]]
    samples = json.loads(out.read_text())["samples"]
    assert {label: sorted(per) for label, per in samples.items()} == {
        "HEAD": ["direct p50_ms", "direct p99_ms"], "here": ["direct p50_ms", "direct p99_ms"]}
    assert all(len(v) == 2 and all(x > 0 for x in v) for per in samples.values() for v in per.values())
    table = [line for line in res.stdout.splitlines() if line.startswith("direct p50_ms")]
    assert len(table) == 1 and "HEAD " in table[0] and "here " in table[0] and "x)" in table[0]
    worktrees = subprocess.run(["git", "-C", str(REPO), "worktree", "list"], capture_output=True, text=True).stdout
    assert "kvstage-ab-" not in worktrees
