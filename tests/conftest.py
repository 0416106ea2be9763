"""Test-session set-up that must happen before any test module is imported.

Triton decides at import time whether its kernels are compiled or interpreted. On a machine
without an NVIDIA GPU (CI here) the Triton gather/scatter kernels are tested under its CPU
interpreter, so TRITON_INTERPRET=1 is set here, in the root conftest, which pytest loads before
it collects (imports) any test module; tests/unit/test_triton_kernels.py fails if the kernels
still came out compiled. An explicit TRITON_INTERPRET (e.g. 0 on a GPU machine) is kept.

The clusters, rank programs and servers the tests drive are the package kvstage.support
(support/), which the examples import too; no test imports a module of examples/ (that runs a
script as a process at most) and nothing here edits sys.path (tests/unit/test_support_boundaries.py).

Ranks the tests start do not measure their path costs at start (KVSTAGE_CALIBRATE=0 unless set):
the measurement costs a staged rank 0.3 s over NIXL and 1.4 s over Mooncake, and the tests that
check it ask for it by name (tests/integration/test_path_choice.py, calibrate=True; the unit
tests of transfer/engine/calibration.py). Every other rank plans by the fixed rule.
"""

import os

if "TRITON_INTERPRET" not in os.environ and not os.path.exists("/dev/nvidiactl"):
    os.environ["TRITON_INTERPRET"] = "1"

os.environ.setdefault("KVSTAGE_CALIBRATE", "0")
