"""examples/bench_etcd_fleet.py at its smallest, so it cannot rot: a real three-member etcd, two
processes of 16 rendezvous clients and one of an engine's 8, lookups timed (all at once, then
paced), the engine's process killed and every client of the other two told of each of its ranks
once their leases ran out. No figure is checked
(times go to docs/scale.md); what is checked is that every rank registered, every lookup
completed, every death was heard and etcd's usage was read."""

from __future__ import annotations

import json

import pytest
from example_runs import run_example

pytestmark = pytest.mark.integration


def test_smallest_fleet_registers_looks_up_and_hears_every_death(tmp_path):
    out = tmp_path / "etcd.json"
    res = run_example("bench_etcd_fleet.py", ["--procs", "2", "--clients", "16", "--lookups", "2", "--ttl", "1",
                                              "--paced", "10", "--paced-s", "1", "--fleet-nice", "19",
                                              "--json", str(out)], timeout=120)
    assert out.exists(), res.stdout[-4000:]
    got = json.loads(out.read_text())
    assert got["fleet_nice"] == 19 and got["fleet_niceness_seen"] == [19]   # every worker lowered itself
    assert got["ranks"] == 32 + 8 and got["lookups"] == (32 + 8) * 2     # and the engine that dies
    assert got["paced"]["lookups"] == 10 and got["paced"]["lookup_ms"]["p50"] > 0
    assert got["paced"]["alone_lookup_ms"]["p50"] > 0
    assert got["watch"]["notices"] == got["watch"]["notices_expected"] == 32 * 8
    assert got["watch"]["delay_after_kill_s"]["min"] > 0          # heard after the kill, not before
    assert all(m["rss_mib"] > 0 for m in got["etcd"]["end"]) and len(got["etcd"]["end"]) == 3
    assert all(isinstance(m["leader_changes"], int) for m in got["etcd"]["end"])   # read from each /metrics
    assert isinstance(got["watch"]["leader_changes_since_lookups"], int)
