"""What layer-wise sending buys: a simulated prefill forward pass, its KV sent whole, per chunk
or layer by layer, alternated in one run, over real NIXL / Mooncake between real processes.

    .venv/bin/python examples/bench_layerwise.py --quick            # 256, 1K, 4K tokens, ~9 min
    .venv/bin/python examples/bench_layerwise.py --json docs/bench/layerwise.json \\
        --plot docs/bench/layerwise.png --rounds 3                   # 256 .. 32K, docs/journal/benchmarks-2026-11.md

The code is kvstage.support.bench_layerwise (support/bench_layerwise.py),
shared with the tests and the other examples; this script is what one runs.
"""

import sys

from kvstage.support.bench_layerwise import main

if __name__ == "__main__":
    sys.exit(main())
