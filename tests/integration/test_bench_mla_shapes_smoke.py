"""examples/bench_mla_shapes.py in its smallest configuration, so it cannot rot: the four MLA
shapes (plain, DCP 2 relayouted and as token runs, sharded prefill) in two alternated rounds of real rank processes over real
NIXL, each round's first request verified bit-exact on every decode rank (the run fails
otherwise). No figure is checked; what is checked is the rounds' order and that every shape has
a figure and a ratio to the plain one."""

from __future__ import annotations

import json

from example_runs import run_example


def test_the_shapes_run_in_alternated_rounds_and_each_gets_a_ratio_to_plain(tmp_path):
    out = tmp_path / "mla.json"
    res = run_example("bench_mla_shapes.py", ["--tokens", "96", "--layers", "2", "--rounds", "2", "--requests", "2",
                                              "--json", str(out)], timeout=300)
    assert res.returncode == 0, res.stdout[-4000:]
    rounds = [line.split()[:3] for line in res.stdout.splitlines() if line.startswith("round ")]
    assert rounds == [["round", "0", "plain"], ["round", "0", "dcp"], ["round", "0", "dcp-runs"],
                      ["round", "0", "sharded"], ["round", "1", "sharded"], ["round", "1", "dcp-runs"],
                      ["round", "1", "dcp"], ["round", "1", "plain"]]
    data = json.loads(out.read_text())
    assert sorted(data["summary"]) == ["dcp", "dcp-runs", "plain", "sharded"]
    # the dcp shape's three requests go through the staging buffers, two writes each (one per
    # decode rank); the token runs' shape, with staging off, gathers none
    assert {r["shape"]: r["relayout_writes"] for r in data["rounds"]} == {
        "plain": 0, "dcp": 6, "dcp-runs": 0, "sharded": 0}
    assert data["summary"]["plain"]["ratio_to_plain"] == 1.0
    assert all(len(s["round_ratios"]) == 2 and s["median_ms"] > 0 for s in data["summary"].values())
    assert all(len(r["seconds"]) == 2 for r in data["rounds"])
    assert "issue 55 goal, DCP relayout at 96 tokens" in res.stdout
