"""examples/bench_layerwise.py's pure parts: the simulated forward pass (layer deadlines, the
readiness object that stands for a CUDA event), chunking, the threshold verdict, and its usage
errors. The end-to-end smoke run is tests/integration/test_bench_layerwise_smoke.py."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvstage.support import bench_layerwise, layerwise_rank, layerwise_report

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_layers_of_each_chunk_finish_one_after_the_other():
    plan = layerwise_rank.layer_deadlines(10.0, [0.5, 0.25], 3)
    assert plan == [[10.5, 11.0, 11.5], [11.75, 12.0, 12.25]]


def test_layer_done_never_returns_before_its_deadline():
    gpu = layerwise_rank.SimulatedGPU()
    done = layerwise_rank.LayerDone(deadline=time.monotonic() + 0.05, gpu=gpu)
    done.synchronize()
    assert done.returned >= done.deadline and done.called < done.deadline
    assert done.threads == [threading.current_thread().name]


def test_stopping_the_gpu_ends_a_wait_with_an_error():
    """A kvstage thread blocked on a layer is let go when the rank shuts down (nothing hangs)."""
    gpu = layerwise_rank.SimulatedGPU()
    done = layerwise_rank.LayerDone(deadline=time.monotonic() + 3600, gpu=gpu)
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            done.synchronize()
        except RuntimeError as exc:
            errors.append(exc)
    t = threading.Thread(target=wait)
    t.start()
    gpu.stop()
    t.join(10)
    assert not t.is_alive() and len(errors) == 1 and done.returned is None


class Recorder:
    def __init__(self):
        self.sends = []

    def send(self, pages, last=None, *, layers=None, ready=None):
        self.sends.append((list(pages), last, layers, ready))


@pytest.mark.parametrize("mode, expected", [
    ("whole", [([0, 1, 2, 3, 4], True, None, (1, 2))]),
    ("chunk", [([0, 1, 2], False, None, (0, 2)), ([3, 4], True, None, (1, 2))]),
    ("layer", [([0, 1, 2], None, range(l, l + 1), (0, l)) for l in range(3)]
     + [([3, 4], None, range(l, l + 1), (1, l)) for l in range(3)]),
    ("group-2", [([0, 1, 2], None, range(0, 2), (0, 1)), ([0, 1, 2], None, range(2, 3), (0, 2)),
                 ([3, 4], None, range(0, 2), (1, 1)), ([3, 4], None, range(2, 3), (1, 2))]),
    ("group-1.2", [([0, 1, 2], None, range(0, 1), (0, 0)), ([0, 1, 2], None, range(1, 3), (0, 2)),
                   ([3, 4], None, range(0, 1), (1, 0)), ([3, 4], None, range(1, 3), (1, 2))]),
])
def test_each_mode_issues_its_sends_gated_by_the_right_layer(mode, expected):
    h = Recorder()
    done = [[(c, l) for l in range(3)] for c in range(2)]   # stand-ins: which (chunk, layer) gates a send
    layerwise_rank.issue_sends(h, mode, list(range(5)), [3, 2], done)
    assert h.sends == expected


def test_a_growing_schedule_repeats_its_last_size_and_the_last_send_takes_the_rest():
    ranges = layerwise_rank.schedule_ranges("1.2.4.5.6.7", 32)
    assert [len(r) for r in ranges] == [1, 2, 4, 5, 6, 7, 7]
    assert ranges[0].start == 0 and all(a.stop == b.start for a, b in zip(ranges, ranges[1:])) and ranges[-1].stop == 32
    assert [len(r) for r in layerwise_rank.schedule_ranges("4", 10)] == [4, 4, 2]
    for bad in ("0", "2.0", "a", ""):
        with pytest.raises(ValueError):
            layerwise_rank.schedule_ranges(bad, 8)


def test_chunking_follows_the_chunked_prefill_size():
    a = SimpleNamespace(page_size=16, chunk_tokens=8192)
    assert bench_layerwise.chunking(a, 256) == [16]
    assert bench_layerwise.chunking(a, 8192) == [512]
    assert bench_layerwise.chunking(a, 20000) == [512, 512, 226]


def _rows(ratios: dict[int, float]) -> dict:
    return {**{(t, "chunk"): {"total_ms": 100.0, "handover_ms": 10.0} for t in ratios},
            **{(t, "group-4"): {"total_ms": 100.0 * r, "handover_ms": 10.0} for t, r in ratios.items()}}


def test_threshold_is_where_layer_wise_pays_from_on():
    assert layerwise_report.supported_threshold(_rows({256: 1.02, 512: 0.9, 1024: 0.8}), "group-4").startswith("512 ")
    # a length that pays below one that does not is no threshold
    assert layerwise_report.supported_threshold(_rows({256: 0.9, 512: 1.0, 1024: 0.8}), "group-4").startswith("1024 ")
    assert layerwise_report.supported_threshold(_rows({256: 0.9, 512: 0.9}), "group-4").startswith("<= 256")
    assert layerwise_report.supported_threshold(_rows({256: 1.1, 512: 0.99}), "group-4").startswith("> 512")


def test_the_table_says_the_regime_the_run_measured():
    """c/t: the calibrated layer time over the per-chunk handover's share per layer."""
    assert layerwise_report.regime(1.2, 32.0, 32) == pytest.approx(1.2)
    assert layerwise_report.regime(1.0, 40.0, 32) == pytest.approx(0.8)
    row = {"chunks": 1, "layer_ms": 1.25, "forward_ms": 40.0, "issue_ms": 2.0, "handover_ms": 32.0, "total_ms": 70.0}
    rows = {(1024, m): dict(row) for m in ("whole", "chunk", "layer")}
    rows[(1024, "layer")]["handover_ms"] = 8.0
    lines: list[str] = []
    layerwise_report.table(SimpleNamespace(layers=32), rows, "nixl", "direct", lines.append)
    line = next(x for x in lines if x.strip().startswith("1024"))
    assert line.split()[4] == "1.25" and line.split("|")[1].split()[3] == "0.25", line


def _chunk_rows(handover_ms: dict[int, float], layer_ms: dict[int, float], chunks: int = 1) -> dict:
    return {(t, "chunk"): {"chunks": chunks, "layer_ms": layer_ms[t], "handover_ms": h} for t, h in handover_ms.items()}


def test_a_second_pass_takes_the_transfer_the_first_measured_where_c_t_strayed():
    """1024's layer time (2 ms) over its measured transfer (32 ms / 32 layers) is c/t 2: that
    size gets 1 ms, the measured transfer; 512 is 10 % off, inside 15 %, and keeps its own."""
    a = SimpleNamespace(layers=32, compute_ratio=1.0)
    cal = {512: 0.00055, 1024: 0.002}
    rows = _chunk_rows({512: 16.0, 1024: 32.0}, {512: 0.55, 1024: 2.0})
    assert layerwise_report.recalibration(a, rows, cal, 0.15) == {512: 0.00055, 1024: pytest.approx(0.001)}
    # the calibration is one layer's transfer: the compute ratio is applied later, not here
    a2 = SimpleNamespace(layers=32, compute_ratio=2.0)
    assert layerwise_report.recalibration(a2, rows, cal, 0.15) == {512: pytest.approx(0.0005), 1024: 0.002}


def test_no_second_pass_inside_the_tolerance_or_without_a_single_chunk_row():
    a = SimpleNamespace(layers=32, compute_ratio=1.0)
    cal = {512: 0.0005, 1024: 0.001}
    assert layerwise_report.recalibration(a, _chunk_rows({512: 18.0, 1024: 28.0}, {512: 0.5, 1024: 1.0}), cal,
                                          0.15) is None
    # a c/t of 0.5 judged by a multi-chunk row, or no row at all: not judged
    assert layerwise_report.recalibration(a, _chunk_rows({1024: 64.0}, {1024: 1.0}, chunks=2), cal, 0.15) is None
    assert layerwise_report.recalibration(a, {}, cal, 0.15) is None

@pytest.mark.parametrize("args, option", [
    (["--compute-ratio", "nan"], "--compute-ratio"), (["--layer-ms", "-1"], "--layer-ms"),
    (["--paths", "equal"], "--paths"),
])
def test_bad_argument_is_a_usage_error(args, option, capsys):
    """The parser `main` calls first, in this process; the script as a process exits 2 on the first."""
    with pytest.raises(SystemExit) as exit_:
        bench_layerwise.parse(args)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and option in err, (exit_.value.code, err[-2000:])
    if option == "--compute-ratio":
        res = subprocess.run([sys.executable, str(EXAMPLES / "bench_layerwise.py"), *args], capture_output=True,
                             text=True, timeout=60)
        assert res.returncode == 2 and option in res.stderr, (res.returncode, res.stderr[-2000:])
