"""One rank process of the PD demo, the benchmark and the integration tests.

    python examples/pd_rank.py SPEC.json

The code is kvstage.support.pd_rank (support/pd_rank.py),
shared with the tests and the other examples; this script is what one runs.
"""

import sys

from kvstage.support.pd_rank import main

if __name__ == "__main__":
    sys.exit(main())
