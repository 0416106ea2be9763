"""examples/bench_compare.py (support/bench_compare.py): medians, ratios and spreads of before/after benchmark runs."""

from kvstage.support import bench_compare


def run(gbps: float, p50: float) -> dict:
    return {"lengths": [{"transport": "nixl", "path": "staged", "tokens": 2048, "gbps": gbps}],
            "inflight": [{"transport": "nixl", "path": "direct", "inflight": 16, "gbps": 1.0}],
            "latency": {"nixl": {"p50_ms": p50, "p99_ms": 2 * p50}}}


def test_medians_ratios_and_spreads():
    lines = bench_compare.compare([run(2.0, 1.0), run(4.0, 3.0), run(3.0, 2.0)],
                                  [run(3.3, 2.0), run(3.0, 2.2), run(2.7, 1.8)])
    by_name = {line[:44].strip(): line[44:].split() for line in lines[1:]}
    assert by_name["nixl staged 2048 (GB/s)"] == ["3.000", "3.000", "1.00x", "2.00x", "1.22x"]
    assert by_name["nixl one page 1 (p50 ms)"] == ["2.000", "2.000", "1.00x", "3.00x", "1.22x"]
    assert by_name["nixl direct 16 (GB/s in flight)"][2] == "1.00x"
    assert len(lines) == 1 + 4


def test_only_figures_every_run_has_are_compared():
    short = run(1.0, 1.0)
    short["lengths"] = []
    lines = bench_compare.compare([run(1.0, 1.0)], [short])
    assert not any("2048" in line for line in lines)
