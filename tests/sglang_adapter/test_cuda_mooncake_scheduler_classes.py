"""The SGLang scheduler classes over Mooncake with CUDA KV caches: collected only where torch sees
a CUDA device and Mooncake's CUDA build (mooncake-transfer-engine-cuda13, which registers VRAM)
is installed (conftest.py). The checks are test_scheduler_classes.py's."""

from __future__ import annotations

import test_scheduler_classes as classes


def test_cuda_mooncake_backend(tmp_path, model_dir, bootstrap_server):
    classes.test_mooncake_backend(tmp_path, model_dir, bootstrap_server, device="cuda")
