"""The SGLang scheduler-class tests with CUDA KV caches (collected only where torch sees a CUDA
device: conftest.py; `make gpu-check` runs them where SGLang is installed, examples/gpu_check.py).

The same harness and checks as test_scheduler_classes.py and test_deferred_release.py, whose test
functions these call with `device="cuda"`: every rank's KV (and state, and draft) tensors on GPU
0, SGLang's MetadataBuffers (aux rows) in host memory beside them (the harness checks both
devices in every rank's report), over real NIXL between separate processes. A representative
subset: heterogeneous TP staged and direct, the overlap schedule's early send waiting on a real
CUDA event (recorded on a side stream behind a sleeping kernel, still pending when SGLang sends),
Mamba and SWA state pools, a draft model's KV, and SGLang's deferred decode KV release. Mooncake
on VRAM is test_cuda_mooncake_scheduler_classes.py.
"""

from __future__ import annotations

import pytest
import test_deferred_release as deferred_release
import test_scheduler_classes as classes

CUDA = "cuda"


@pytest.mark.parametrize("prefill_tp,decode_tp,staging", [(2, 1, False), (2, 1, True), (1, 2, True)],
                         ids=["P2-D1-direct", "P2-D1-staged", "P1-D2-staged"])
def test_cuda_chunked_requests_with_an_early_event(tmp_path, model_dir, bootstrap_server, prefill_tp, decode_tp,
                                                   staging):
    classes.test_chunked_requests_with_a_prefix_hit(tmp_path, model_dir, bootstrap_server, prefill_tp, decode_tp,
                                                    staging, device=CUDA)


@pytest.mark.parametrize("prefill_tp,decode_tp,staging", [(2, 1, True), (1, 2, False)],
                         ids=["P2-D1-staged", "P1-D2-direct"])
def test_cuda_state_components(tmp_path, model_dir, bootstrap_server, prefill_tp, decode_tp, staging):
    classes.test_state_components(tmp_path, model_dir, bootstrap_server, prefill_tp, decode_tp, staging, "hybrid",
                                  device=CUDA)


def test_cuda_speculative_decoding_draft_kv(tmp_path, model_dir, bootstrap_server):
    classes.test_speculative_decoding_draft_kv(tmp_path, model_dir, bootstrap_server, 2, 1, True, False,
                                               classes.EAGLE, device=CUDA)


@pytest.mark.parametrize("deferred", [True, False], ids=["deferred-release", "immediate-release"])
def test_cuda_late_write_lands_only_in_held_pages(tmp_path, model_dir, bootstrap_server, deferred):
    deferred_release.test_late_write_lands_only_in_held_pages(tmp_path, model_dir, bootstrap_server, deferred,
                                                              device=CUDA)
