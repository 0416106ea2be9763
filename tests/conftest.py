"""Test-session set-up that must happen before any test module is imported.

Triton decides at import time whether its kernels are compiled or interpreted. On a machine
without an NVIDIA GPU (CI here) the Triton gather/scatter kernels are tested under its CPU
interpreter, so TRITON_INTERPRET=1 is set here, in the root conftest, which pytest loads before
it collects (imports) any test module; tests/unit/test_triton_kernels.py fails if the kernels
still came out compiled. An explicit TRITON_INTERPRET (e.g. 0 on a GPU machine) is kept.

examples/ goes on sys.path here too, whatever the order of a module's imports: the tests drive
the example ranks and clusters (cluster.py, pd_rank.py, pool_pattern.py) as libraries, and the
adapter tests pick their servers' ports with cluster.free_port.

Ranks the tests start do not measure their path costs at start (KVSTAGE_CALIBRATE=0 unless set):
the measurement costs a staged rank 0.3 s over NIXL and 1.4 s over Mooncake, and the tests that
check it ask for it by name (tests/integration/test_path_choice.py, calibrate=True; the unit
tests of transfer/engine/calibration.py). Every other rank plans by the fixed rule.
"""

import os
import sys
from pathlib import Path

if "TRITON_INTERPRET" not in os.environ and not os.path.exists("/dev/nvidiactl"):
    os.environ["TRITON_INTERPRET"] = "1"

os.environ.setdefault("KVSTAGE_CALIBRATE", "0")

EXAMPLES = str(Path(__file__).resolve().parent.parent / "examples")
if EXAMPLES not in sys.path:
    sys.path.insert(0, EXAMPLES)
