"""Everything kvstage does only on a GPU, in one command, with one verdict line at the end.

    make gpu-check        # or: .venv/bin/python examples/gpu_check.py [--json out.json]

The code is kvstage.support.gpu_check (support/gpu_check.py),
shared with the tests and the other examples; this script is what one runs.
"""

import sys

from kvstage.support.gpu_check import main

if __name__ == "__main__":
    sys.exit(main())
