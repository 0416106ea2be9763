"""One rank process of examples/bench_layerwise.py: a prefill rank that simulates its forward
pass and sends while it "runs", or a decode rank that times each request's Success.

    python examples/layerwise_rank.py SPEC.json

The code is kvstage.support.layerwise_rank (support/layerwise_rank.py),
shared with the tests and the other examples; this script is what one runs.
"""

import sys

from kvstage.support.layerwise_rank import main

if __name__ == "__main__":
    sys.exit(main())
