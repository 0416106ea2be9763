"""examples/bench_layerwise.py in its smallest configuration, so it cannot rot: real rank
processes over real NIXL, staged (P2 -> D1) and direct (P1 -> D1), every mode
and the threshold sweep, warm-ups verified byte for byte (the run fails otherwise). No figure is
checked; what is checked is that the simulation is honest: every readiness object was waited on
by a kvstage thread, never by the caller, and the report names every configuration."""

from __future__ import annotations

import json

import pytest
from example_runs import run_example

MODES = {"main": {"whole", "chunk", "layer"}, "sweep": {"chunk", "group-1", "group-4"}}


# NIXL only, for the CI's time budget: layer-wise over Mooncake moves bit-exact in test_layerwise.py
# and test_pp_prefill.py, and the benchmark itself runs both backends
@pytest.mark.parametrize("backend", ["nixl"])
def test_smallest_configuration_runs_end_to_end(backend, tmp_path):
    out = tmp_path / "layerwise.json"
    # 64 tokens in chunks of 32 (so whole and per chunk differ) and 32 (one chunk, where c/t is
    # judged: a tolerance no run meets makes the second pass), 4 layers in groups of 2, every
    # request layer-wise (threshold 0), calibrated compute; the sweep with 1 and 4 layers per write
    argv = ["--backends", backend, "--lengths", "32,64", "--regime-tolerance", "1e-9",
            "--sweep-lengths", "32", "--sweep-groups", "1,4",
            "--rounds", "1", "--calibration-requests", "1", "--chunk-tokens", "32", "--layers", "4", "--heads", "2",
            "--head-dim", "64", "--layer-group", "2", "--min-tokens", "0", "--layer-batching", "on", "--ring-mb", "16",
            "--buffer-mb", "8", "--json", str(out)]
    res = run_example("bench_layerwise.py", argv, timeout=400)
    stdout = res.stdout
    assert res.returncode == 0, stdout[-4000:]
    res = json.loads(out.read_text())
    assert set(res["calibration"]) == {f"{backend}/staged", f"{backend}/direct"}
    seen = {(r["run"], r["path"], r["tokens"], r["mode"]) for r in res["rows"]}
    want = {(run, path, tokens, mode) for path in ("staged", "direct")
            for run, tokens in (("main", 32), ("main", 64), ("first-pass", 32), ("first-pass", 64), ("sweep", 32))
            for mode in MODES["sweep" if run == "sweep" else "main"]}
    assert seen == want
    for key in res["calibration"]:   # the second pass runs 32 tokens at the transfer the first measured
        first = next(r for r in res["rows"] if r["run"] == "first-pass" and r["tokens"] == 32 and r["mode"] == "chunk"
                     and f"{r['backend']}/{r['path']}" == key)
        assert res["calibration"][key]["32"] == pytest.approx(first["handover_ms"] / 4), key
        assert res["first_calibration"][key]["32"] != res["calibration"][key]["32"], key
        assert f"first pass {key}: c/t 32: " in stdout
    for r in res["rows"]:
        assert r["ready_threads"], r
        assert all(name.startswith("kvstage-") for name in r["ready_threads"]), r   # never the caller's thread
        assert len(r["handover_samples_ms"]) == 1 and len(r["total_samples_ms"]) == 1
    assert f"== {backend} staged" in stdout and f"== {backend} direct" in stdout
    assert "supported layerwise_min_tokens with G=" in stdout
    assert "layer_group 2, layerwise_min_tokens 0, layer_batching on (direct)" in stdout
