"""kvstage against its alternatives, measured side by side in one run on the same geometry.

    make bench                                   # everything, ~30 min on 2 cores
    .venv/bin/python examples/bench.py --sections phases --transports nixl   # only the phase breakdown
    .venv/bin/python examples/bench.py --quick   # a smaller sweep
    .venv/bin/python examples/bench.py --transports nixl --lengths 2048 --json out.json

The code is kvstage.support.bench (support/bench.py),
shared with the tests and the other examples; this script is what one runs.
"""

import sys

from kvstage.support.bench import main

if __name__ == "__main__":
    sys.exit(main())
