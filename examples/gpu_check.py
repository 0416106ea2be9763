"""Everything kvstage does only on a GPU, in one command, with one verdict line at the end.

    make gpu-check        # or: .venv/bin/python examples/gpu_check.py [--json out.json]

1. The Triton gather/scatter kernel tests, compiled for the device (TRITON_INTERPRET=0), not
   under the CPU interpreter CI uses.
2. Two-process transfers with a VRAM KV cache and a host aux pool, staged and direct, bit-exact
   over real NIXL (tests/gpu/test_gpu_path.py).
3. The kernel benchmark (examples/bench_gpu_kernels.py), its figures printed and saved.

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default="docs/bench/gpu_kernels.json", help="where the kernel benchmark saves")
    args = ap.parse_args()
    import torch
    if not torch.cuda.is_available():
        print("gpu-check: NOT RUN: no CUDA device on this machine (nothing was validated)")
        return 2
    env = {**os.environ, "TRITON_INTERPRET": "0", "KVSTAGE_GPU_CHECK": "1"}
    py = sys.executable
    results = [
        step("kernels", [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/unit/test_triton_kernels.py"], env),
        step("transfer", [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/gpu"], env),
        step("kernel benchmark", [py, "examples/bench_gpu_kernels.py", "--json", args.json], env),
    ]
    device = torch.cuda.get_device_name(0)
    for name, ok, took in results:
        print(f"gpu-check: {name}: {'ok' if ok else 'FAILED'} ({took:.0f} s)")
    verdict = "PASS" if all(ok for _, ok, _ in results) else "FAIL"
    print(f"gpu-check: {verdict} on {device}: " + ", ".join(f"{n} {'ok' if ok else 'failed'}" for n, ok, _ in results))
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
