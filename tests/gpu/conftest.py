"""GPU-only tests: collected only by `make gpu-check` (examples/gpu_check.py sets KVSTAGE_GPU_CHECK=1
on a machine with a CUDA device). Elsewhere they are not collected at all, rather than skipped:
there is no GPU to install, and a skip would read as a check that was made. The Mooncake test
is collected only where gpu_check.py found Mooncake's CUDA build (KVSTAGE_GPU_MOONCAKE=1); it
says so in its verdict line otherwise."""

import os
import sys

if os.environ.get("KVSTAGE_GPU_CHECK") != "1":
    collect_ignore_glob = ["test_*.py"]
else:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "integration"))
    if os.environ.get("KVSTAGE_GPU_MOONCAKE") != "1":   # the CUDA build of Mooncake is not installed
        collect_ignore_glob = ["test_gpu_mooncake.py"]
