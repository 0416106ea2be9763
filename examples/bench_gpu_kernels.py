"""The fused Triton gather/scatter kernels against a plain device-to-device copy, on a CUDA GPU.

    .venv/bin/python examples/bench_gpu_kernels.py --json docs/bench/gpu_kernels.json
    .venv/bin/python examples/bench_gpu_kernels.py --smoke     # CPU, Triton interpreter (CI)
    .venv/bin/python examples/bench_gpu_kernels.py --host-only # CPU: host work per call, no kernel run

The code is kvstage.support.bench_gpu_kernels (support/bench_gpu_kernels.py),
shared with the tests and the other examples; this script is what one runs.
"""

from kvstage.support.bench_gpu_kernels import main

if __name__ == "__main__":
    main()
