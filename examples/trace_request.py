"""The critical path of one request across both processes: every hop with its time.

    PYTHONPATH=.. .venv/bin/python examples/trace_request.py                  # staged, NIXL
    .venv/bin/python examples/trace_request.py --path direct --backend mooncake
    .venv/bin/python examples/trace_request.py --save docs/bench/trace-one-page

The code is kvstage.support.trace_request (support/trace_request.py),
shared with the tests and the other examples; this script is what one runs.
"""

import sys

from kvstage.support.trace_request import main

if __name__ == "__main__":
    sys.exit(main())
