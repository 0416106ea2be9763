"""Compare runs of examples/bench.py made before and after a change, side by side.

    python examples/bench_compare.py --before b1.json b2.json b3.json --after a1.json a2.json a3.json

The code is kvstage.support.bench_compare (support/bench_compare.py),
shared with the tests and the other examples; this script is what one runs.
"""

import sys

from kvstage.support.bench_compare import main

if __name__ == "__main__":
    sys.exit(main())
