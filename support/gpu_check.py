"""Everything kvstage does only on a GPU, in one command, with one verdict line at the end.

    make gpu-check        # or: .venv/bin/python examples/gpu_check.py [--json out.json]

1. The Triton gather/scatter kernel tests, compiled for the device (TRITON_INTERPRET=0), not
   under the CPU interpreter CI uses.
2. Two-process transfers with a VRAM KV cache and a host aux pool, staged and direct, bit-exact
   over real NIXL (tests/gpu/test_gpu_path.py); decode context parallel on VRAM, as token runs
   and relayouted through a VRAM staging buffer (tests/gpu/test_gpu_dcp.py); the path choice on VRAM, equal TP staged
   (tests/gpu/test_gpu_path_choice.py); Mooncake on VRAM where its CUDA build
   (mooncake-transfer-engine-cuda13) is installed (tests/gpu/test_gpu_mooncake.py), else the
   verdict line says it was not run.
3. The kernel benchmark (examples/bench_gpu_kernels.py), its figures printed and saved.
4. A short transfer benchmark with VRAM KV caches (examples/bench.py --device cuda, NIXL, one
   process per rank on GPU 0): staged, direct and equal TP (the path chosen from measured
   costs, docs/path_choice.md) at 2048 and 8192 tokens, and the one-page latency; its table
   printed, with issue 47's GPU goals (256 MiB staged <= 2 ms, 1 GiB >= 200 GB/s) checked.
5. The SGLang adapter on the GPU: the scheduler-class tests with CUDA KV caches
   (tests/sglang_adapter/test_cuda_*.py; host aux rows, the overlap schedule's early send on a
   real CUDA event, state pools, draft KV, deferred release; Mooncake where its CUDA build is
   installed), run by a Python that has SGLang and a CUDA torch: this one, the SGLang venv
   (.venv-sglang) or `--sglang-python`. Where none has, the step says NOT RUN and why, and the
   other steps' verdict stands (it fails nothing, as Mooncake's absence does not).

Without a CUDA device it says so and exits 2: nothing was validated (docs/backends.md says
whether this has ever been run).
"""

from __future__ import annotations

import argparse
import enum
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MOONCAKE_CUDA = "mooncake-transfer-engine-cuda13"


class Outcome(enum.Enum):
    OK = "ok"
    FAILED = "FAILED"
    NOT_RUN = "NOT RUN"


@dataclass(frozen=True)
class StepResult:
    """One step's outcome; `why`: the reason a step was not run."""

    name: str
    outcome: Outcome
    seconds: float = 0.0
    why: str = ""


def step(name: str, cmd: list[str], env: dict) -> StepResult:
    print(f"gpu-check: {name}: {' '.join(cmd)}", flush=True)
    t0 = time.monotonic()
    ok = subprocess.run(cmd, cwd=ROOT, env=env).returncode == 0
    return StepResult(name, Outcome.OK if ok else Outcome.FAILED, time.monotonic() - t0)


def verdict(results: list[StepResult]) -> str:
    """PASS unless a step that ran failed: a step not run (its software is not installed) is
    named in the verdict line, never a failure, and never a pass of what it would have checked."""
    return "FAIL" if any(r.outcome is Outcome.FAILED for r in results) else "PASS"


def step_line(r: StepResult) -> str:
    if r.outcome is Outcome.NOT_RUN:
        return f"gpu-check: {r.name}: NOT RUN: {r.why}"
    return f"gpu-check: {r.name}: {r.outcome.value} ({r.seconds:.0f} s)"


def verdict_line(device: str, results: list[StepResult], notes: list[str]) -> str:
    words = {Outcome.OK: "ok", Outcome.FAILED: "failed", Outcome.NOT_RUN: "NOT RUN"}
    parts = [f"{r.name} {words[r.outcome]}" + (f" ({r.why})" if r.outcome is Outcome.NOT_RUN else "") for r in results]
    return f"gpu-check: {verdict(results)} on {device}: " + ", ".join(parts) + "".join(f"; {n}" for n in notes)


# -- step 5: the SGLang adapter's scheduler-class tests with CUDA KV caches ---------------------

SGLANG_SHIMS = "tests/sglang_adapter/shims"
SGLANG_VENV_PYTHON = ROOT / ".venv-sglang" / "bin" / "python"
SGLANG_CUDA_TESTS = "tests/sglang_adapter/test_cuda_scheduler_classes.py"
SGLANG_MOONCAKE_TESTS = "tests/sglang_adapter/test_cuda_mooncake_scheduler_classes.py"
# prints SGLang's version, whether torch there sees a CUDA device and whether Mooncake's CUDA
# build is installed ("- False False" without SGLang; torch is not imported then)
_PROBE = ("from importlib import metadata\n"
          "def version(name):\n    try:\n        return metadata.version(name)\n"
          "    except metadata.PackageNotFoundError:\n        return ''\n"
          f"v, m = version('sglang'), bool(version({MOONCAKE_CUDA!r}))\n"
          "if v:\n    import torch\n    print(v, torch.cuda.is_available(), m)\nelse:\n    print('-', False, m)")


@dataclass(frozen=True)
class SGLangProbe:
    """What one Python offers step 5: SGLang's version ('' when not installed), whether its torch
    sees a CUDA device, and whether Mooncake's CUDA build is installed there."""

    python: str
    sglang: str
    cuda: bool
    mooncake_cuda: bool = False


def probe_sglang(python: str) -> SGLangProbe:
    """Asks `python` (a subprocess: SGLang need not be importable here). A Python that cannot
    answer (missing, broken) offers nothing."""
    try:
        out = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return SGLangProbe(python, "", False)
    words = out.stdout.split() if out.returncode == 0 else []
    if len(words) != 3:
        return SGLangProbe(python, "", False)
    return SGLangProbe(python, "" if words[0] == "-" else words[0], words[1] == "True", words[2] == "True")


def sglang_pythons(explicit: str | None, current: str, venv: Path = SGLANG_VENV_PYTHON) -> list[str]:
    """The Pythons step 5 may use, in order: `--sglang-python` alone when given; else this one,
    then the SGLang venv's where it exists."""
    if explicit:
        return [explicit]
    return [current] + ([str(venv)] if venv.exists() and str(venv) != current else [])


def choose_sglang(probes: list[SGLangProbe]) -> SGLangProbe | str:
    """The first Python with SGLang and a CUDA torch, or why step 5 is not run."""
    for p in probes:
        if p.sglang and p.cuda:
            return p
    with_sglang = [p for p in probes if p.sglang]
    if with_sglang:
        p = with_sglang[0]
        return f"SGLang {p.sglang} at {p.python} has a torch without CUDA (its tests need SGLang beside a CUDA torch)"
    return "SGLang not installed (tried " + ", ".join(p.python for p in probes) + ")"


def sglang_command(chosen: SGLangProbe) -> list[str]:
    """Step 5's pytest, the CUDA test modules named (a module named on the command line is
    collected whatever the folder's conftest says): Mooncake's only where its CUDA build is."""
    tests = [SGLANG_CUDA_TESTS] + ([SGLANG_MOONCAKE_TESTS] if chosen.mooncake_cuda else [])
    return [chosen.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests]


def sglang_step(explicit: str | None, env: dict) -> StepResult:
    name = "sglang adapter"
    chosen = choose_sglang([probe_sglang(py) for py in sglang_pythons(explicit, sys.executable)])
    if isinstance(chosen, str):
        result = StepResult(name, Outcome.NOT_RUN, why=chosen)
        print(step_line(result), flush=True)
        return result
    path = os.pathsep.join(p for p in (SGLANG_SHIMS, env.get("PYTHONPATH", "")) if p)
    return step(name, sglang_command(chosen), {**env, "PYTHONPATH": path})


def mooncake_cuda() -> bool:
    """Whether Mooncake's CUDA build (the one that registers VRAM) is installed."""
    from importlib import metadata
    try:
        metadata.version(MOONCAKE_CUDA)
        return True
    except metadata.PackageNotFoundError:
        return False


def bench_command(py: str, json_path: str) -> list[str]:
    """The short transfer benchmark of step 4 (a few minutes on one GPU): 2048 and 8192 tokens
    (256 MiB and 1 GiB, issue 47's GPU goals, which its report checks) and the one-page latency."""
    return [py, "examples/bench.py", "--device", "cuda", "--transports", "nixl", "--sections", "lengths,latency",
            "--lengths", "2048,8192", "--latency-requests", "40", "--json", json_path,
            "--plots", str(Path(json_path).parent / "gpu_plots")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default="docs/bench/gpu_kernels.json", help="where the kernel benchmark saves")
    ap.add_argument("--bench-json", default="docs/bench/gpu_bench.json", help="where the transfer benchmark saves")
    ap.add_argument("--no-bench", action="store_true", help="skip the transfer benchmark (step 4)")
    ap.add_argument("--sglang-python", default=None,
                    help="the Python (with SGLang and a CUDA torch) that runs step 5; default: this one, then .venv-sglang")
    args = ap.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("gpu-check: NOT RUN: no CUDA device on this machine (nothing was validated)")
        return 2
    mooncake = mooncake_cuda()
    env = {**os.environ, "TRITON_INTERPRET": "0", "KVSTAGE_GPU_CHECK": "1", "KVSTAGE_GPU_MOONCAKE": "1" if mooncake else "0"}
    py = sys.executable
    results = [
        step("kernels", [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/unit/test_triton_kernels.py"], env),
        step("transfer", [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/gpu"], env),
        step("kernel benchmark", [py, "examples/bench_gpu_kernels.py", "--json", args.json], env),
    ]
    if not args.no_bench:
        results.append(step("transfer benchmark", bench_command(py, args.bench_json), env))
    results.append(sglang_step(args.sglang_python, env))
    device = torch.cuda.get_device_name(0)
    for r in results:
        print(step_line(r))
    notes = [] if mooncake else [f"Mooncake on VRAM not run ({MOONCAKE_CUDA} not installed)"]
    print(verdict_line(device, results, notes))
    return 0 if verdict(results) == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
