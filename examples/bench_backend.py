"""Backend write bandwidth, side by side in one run: one large range vs the same bytes as many
small ranges, for NIXL (UCX default transports), NIXL with UCX_TLS=tcp and Mooncake tcp.

    .venv/bin/python examples/bench_backend.py                  # all configurations
    .venv/bin/python examples/bench_backend.py --json out.json  # also write the results
    .venv/bin/python examples/bench_backend.py --faults         # also: frozen and killed peers

The code is kvstage.support.bench_backend (support/bench_backend.py),
shared with the tests and the other examples; this script is what one runs.
"""

import sys

from kvstage.support.bench_backend import main

if __name__ == "__main__":
    sys.exit(main())
