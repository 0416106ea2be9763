"""Everything kvstage does only on a GPU, in one command, with one verdict line at the end.

    make gpu-check        # or: .venv/bin/python examples/gpu_check.py [--json out.json]

1. The Triton gather/scatter kernel tests, compiled for the device (TRITON_INTERPRET=0), not
   under the CPU interpreter CI uses.
2. Two-process transfers with a VRAM KV cache and a host aux pool, staged and direct, bit-exact
   over real NIXL (tests/gpu/test_gpu_path.py); the path choice on VRAM, equal TP staged
   (tests/gpu/test_gpu_path_choice.py); Mooncake on VRAM where its CUDA build
   (mooncake-transfer-engine-cuda13) is installed (tests/gpu/test_gpu_mooncake.py), else the
   verdict line says it was not run.
3. The kernel benchmark (examples/bench_gpu_kernels.py), its figures printed and saved.
4. A short transfer benchmark with VRAM KV caches (examples/bench.py --device cuda, NIXL, one
   process per rank on GPU 0): staged, direct and equal TP (the path chosen from measured
   costs, docs/path_choice.md) at 2048 tokens, and the one-page latency; its table printed.

Without a CUDA device it says so and exits 2: nothing was validated (docs/backends.md says
whether this has ever been run).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def step(name: str, cmd: list[str], env: dict) -> tuple[str, bool, float]:
    print(f"gpu-check: {name}: {' '.join(cmd)}", flush=True)
    t0 = time.monotonic()
    ok = subprocess.run(cmd, cwd=ROOT, env=env).returncode == 0
    return name, ok, time.monotonic() - t0


MOONCAKE_CUDA = "mooncake-transfer-engine-cuda13"


def mooncake_cuda() -> bool:
    """Whether Mooncake's CUDA build (the one that registers VRAM) is installed."""
    from importlib import metadata
    try:
        metadata.version(MOONCAKE_CUDA)
        return True
    except metadata.PackageNotFoundError:
        return False


def bench_command(py: str, json_path: str) -> list[str]:
    """The short transfer benchmark of step 4 (a few minutes on one GPU)."""
    return [py, "examples/bench.py", "--device", "cuda", "--transports", "nixl", "--sections", "lengths,latency",
            "--lengths", "2048", "--latency-requests", "40", "--json", json_path,
            "--plots", str(Path(json_path).parent / "gpu_plots")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default="docs/bench/gpu_kernels.json", help="where the kernel benchmark saves")
    ap.add_argument("--bench-json", default="docs/bench/gpu_bench.json", help="where the transfer benchmark saves")
    ap.add_argument("--no-bench", action="store_true", help="skip the transfer benchmark (step 4)")
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
    device = torch.cuda.get_device_name(0)
    for name, ok, took in results:
        print(f"gpu-check: {name}: {'ok' if ok else 'FAILED'} ({took:.0f} s)")
    verdict = "PASS" if all(ok for _, ok, _ in results) else "FAIL"
    print(f"gpu-check: {verdict} on {device}: " + ", ".join(f"{n} {'ok' if ok else 'failed'}" for n, ok, _ in results)
          + ("" if mooncake else f"; Mooncake on VRAM not run ({MOONCAKE_CUDA} not installed)"))
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
