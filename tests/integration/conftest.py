"""examples/ on sys.path before any test module here is imported: the integration tests drive the
example ranks and clusters (cluster.py, pd_rank.py, pool_pattern.py) as libraries, whatever the
order of their imports."""

import sys
from pathlib import Path

EXAMPLES = str(Path(__file__).resolve().parents[2] / "examples")
if EXAMPLES not in sys.path:
    sys.path.insert(0, EXAMPLES)
