"""Two or more trees of kvstage measured side by side, in alternated rounds.

    python examples/bench_ab.py --rev 11ead45 --rev HEAD --rounds 4 --measure staged-latency,staged-lengths

The code is kvstage.support.bench_ab (support/bench_ab.py),
shared with the tests and the other examples; this script is what one runs.
"""

import sys

from kvstage.support.bench_ab import main

if __name__ == "__main__":
    sys.exit(main())
