"""SGLang's real decode transfer queue in a harness rank (rank.py, scenario "queue").

`DecodeTransferQueue.pop_transferred()` and `resolve_deferred_releases()` are SGLang's own: the
poll, the metadata gate, the failure path (failure_exception, ensure_abort_notified(force_arm)),
the decision to hold a failed request's pages, the all-reduce over the attention-TP gloo group
and the release once `kv_mgr.is_abort_release_safe()` says so. The harness replaces only what
touches a scheduler's Req, radix tree and allocator: releasing a request's pages
(`_release_request`, SGLang's release_kv_cache) and committing a transferred request
(`_commit_transfer_to_req`, which reads the aux row into the Req).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from types import SimpleNamespace

import torch
import torch.distributed as dist


def init_gloo(tp: int, rank: int, store_file: str) -> None:
    """The attention-TP CPU group SGLang's queue all-reduces its poll and hold flags over."""
    from sglang.srt.runtime_context import get_parallel
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{store_file}", world_size=tp, rank=rank)
    get_parallel().attn_tp_group.cpu_group = dist.group.WORLD


def make_queue(meta, on_release: Callable, on_commit: Callable):
    from sglang.srt.disaggregation.decode import DecodeTransferQueue
    from sglang.srt.disaggregation.utils import ReqToMetadataIdxAllocator

    class HarnessQueue(DecodeTransferQueue):
        def _release_request(self, decode_req) -> None:
            on_release(decode_req)

        def _commit_transfer_to_req(self, decode_req) -> None:
            on_commit(decode_req)
            decode_req.kv_receiver.clear()
            decode_req.kv_receiver = None

    scheduler = SimpleNamespace(
        output_streamer=SimpleNamespace(stream_output=lambda *a, **k: None), enable_decode_hicache=False,
        enable_hisparse=False, metrics_reporter=SimpleNamespace(enable_metrics=False), kv_checksum_computer=None,
        spec_algorithm=SimpleNamespace(is_none=lambda: True), disagg_decode_prealloc_queue=None)
    tree_cache = SimpleNamespace(unlock=lambda lock: None)
    allocator = ReqToMetadataIdxAllocator(meta.bootstrap_room.shape[0])
    return HarnessQueue(allocator, meta, scheduler, tree_cache)


def decode_request(room: int, receiver, row: int):
    from sglang.srt.disaggregation.decode import DecodeRequest
    req = SimpleNamespace(rid=f"r{room}", bootstrap_room=room, bootstrap_host="127.0.0.1", return_logprob=False,
                          finished_reason=None)
    return DecodeRequest(req=req, kv_receiver=receiver, metadata_buffer_index=row)


def deferred_release_on() -> bool:
    return os.environ.get("SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE", "1").lower() not in ("0", "false")


def pages_hold(bufs, pages, ps: int, value: int) -> bool:
    """Whether every element of `pages` in every buffer equals `value` (int16 view)."""
    return all(bool((t.view(torch.int16)[p * ps:(p + 1) * ps] == value).all()) for t in bufs for p in pages)
