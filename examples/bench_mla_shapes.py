"""What decode context parallel and KV page sharding cost against a plain MLA request, in
alternated rounds.

    python examples/bench_mla_shapes.py --tokens 4096 --rounds 3 --requests 4 --json F

The code is kvstage.support.bench_mla_shapes (support/bench_mla_shapes.py); this script is what
one runs.
"""

import sys

from kvstage.support.bench_mla_shapes import main

if __name__ == "__main__":
    sys.exit(main())
