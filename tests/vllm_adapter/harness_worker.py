"""One vLLM TP worker for harness.py, in its own process: vLLM's tensor-parallel group (gloo,
as vLLM's CPU workers set it up), the kvstage connector's WORKER side on CPU KV tensors in the
CPU attention backend's layout, and per step the calls vLLM's model runner makes on a connector
(bind metadata, start_load_kv, wait_for_save, get_transfer_results, load errors, stats, clear).
The model's forward is replaced by `kv_page`: the KV a prefill writes for a request's page, which
the decode must then hold bit for bit.
"""

from __future__ import annotations

import traceback
import zlib

import torch


def kv_page(req_id: str, page: int, layer: int, total_heads: int, block: int, head_dim: int) -> torch.Tensor:
    """The KV of page `page` of request `req_id` in one layer, all heads: [heads, block, 2 * head_dim]."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{req_id}/{page}/{layer}".encode()))
    return torch.randn(total_heads, block, 2 * head_dim, generator=g)


def serve(conn, model: str, producer: bool, tp: int, rank: int, rendezvous_port: int, failure_policy: str) -> None:
    try:
        connector, caches = _start(model, producer, tp, rank, rendezvous_port, failure_policy)
        conn.send(("ok", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    from harness import BLOCK, HEAD_DIM, KV_HEADS
    from vllm.v1.outputs import KVConnectorOutput
    local = KV_HEADS // tp
    try:
        while True:
            kind, arg = conn.recv()
            try:
                if kind == "close":
                    break
                if kind == "read":
                    conn.send(("ok", torch.stack([t[arg].clone() for t in caches.values()])))
                    continue
                meta, finished_req_ids, writes = arg
                for req_id, blocks, cached in writes:      # pages past the locally cached prefix
                    for page, b in list(enumerate(blocks))[cached:]:
                        for layer, t in enumerate(caches.values()):
                            full = kv_page(req_id, page, layer, KV_HEADS, BLOCK, HEAD_DIM)
                            t[b] = full[rank * local:(rank + 1) * local]
                if meta is not None:
                    connector.bind_connector_metadata(meta)
                connector.start_load_kv(None)
                connector.wait_for_save()
                results = connector.get_transfer_results(finished_req_ids)
                out = KVConnectorOutput(finished_sending=results.finished_sending or None,
                                        finished_recving=results.finished_recving or None,
                                        failed_recving=results.failed_recving,
                                        invalid_block_ids=connector.get_block_ids_with_load_errors(),
                                        kv_connector_stats=connector.get_kv_connector_stats())
                if meta is not None:
                    connector.clear_connector_metadata()
                conn.send(("ok", out))
            except BaseException:
                conn.send(("error", traceback.format_exc()))
    finally:
        connector.shutdown()


def _start(model, producer, tp, rank, rendezvous_port, failure_policy):
    from harness import BLOCK, HEAD_DIM, KV_HEADS, NUM_BLOCKS, kv_cache_config, make_config
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.parallel_state import ensure_model_parallel_initialized, init_distributed_environment

    from kvstage.adapters.vllm.connector import KvstageConnector

    config = make_config(model, producer=producer, tp=tp, rendezvous_port=rendezvous_port,
                         failure_policy=failure_policy)
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=tp, rank=rank, local_rank=rank, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{rendezvous_port + 1}")
        ensure_model_parallel_initialized(tp, 1)
        connector = KvstageConnector(config, KVConnectorRole.WORKER, kv_cache_config(tp))
        caches = {f"model.layers.{i}.self_attn.attn":
                  torch.zeros(NUM_BLOCKS, KV_HEADS // tp, BLOCK, 2 * HEAD_DIM) for i in range(2)}
        connector.register_kv_caches(caches)
    return connector, caches
