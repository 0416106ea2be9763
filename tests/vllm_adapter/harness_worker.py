"""One vLLM TP worker for harness.py, in its own process: vLLM's tensor-parallel group (gloo,
as vLLM's CPU workers set it up), the kvstage connector's WORKER side on CPU KV tensors in the
CPU attention backend's layout, and per step the calls vLLM's model runner makes on a connector,
in its order (bind metadata; the forward, layer by layer, each layer's save_kv_layer after its
KV is written; then start_load_kv, wait_for_save, get_transfer_results, load errors, stats,
clear). The model's forward is replaced by `kv_page`: the KV a prefill writes for a request's
page, which the decode must then hold bit for bit; a step writes only the prompt tokens it
computes (chunked prefill). Every KVSender.send is logged with the save_kv_layer calls around it.
"""

from __future__ import annotations

import traceback
import zlib

import torch


def kv_page(req_id: str, page: int, layer: int, total_heads: int, block: int, head_dim: int) -> torch.Tensor:
    """The KV of page `page` of request `req_id` in one layer, all heads: [heads, block, 2 * head_dim]."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{req_id}/{page}/{layer}".encode()))
    return torch.randn(total_heads, block, 2 * head_dim, generator=g)


def serve(conn, model: str, producer: bool, tp: int, rank: int, rendezvous_port: int, failure_policy: str,
          chunk: int, layerwise: bool, env: dict) -> None:
    import os
    os.environ.update(env)
    events: list[tuple] = []
    try:
        _log_sends(events)
        connector, caches = _start(model, producer, tp, rank, rendezvous_port, failure_policy, chunk,
                                    layerwise)
        conn.send(("ok", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    from harness import KV_HEADS
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
                if kind == "events":
                    conn.send(("ok", list(events)))
                    events.clear()
                    continue
                meta, finished_req_ids, writes = arg
                if meta is not None:
                    connector.bind_connector_metadata(meta)
                # the forward, layer by layer as vLLM's attention layers run: write this step's
                # tokens of every request, then save_kv_layer (vLLM starts async loads after it)
                for layer, (name, t) in enumerate(caches.items()):
                    for req_id, blocks, lo, hi, prompt in writes:
                        _write_tokens(t, req_id, blocks, layer, lo, hi, prompt, rank, local)
                    if meta is not None:
                        events.append(("save", layer))
                        connector.save_kv_layer(name, t, None)
                connector.start_load_kv(None)
                events.append(("wait",))
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


def _write_tokens(t, req_id, blocks, layer, lo, hi, prompt, rank, local) -> None:
    """Tokens [lo, hi) of a request's prompt into one layer's cache, as a forward computes them;
    the rest of the prompt's last page with them (so whole pages compare)."""
    from harness import BLOCK, HEAD_DIM, KV_HEADS
    if hi >= prompt:
        hi = -(-prompt // BLOCK) * BLOCK
    for page in range(lo // BLOCK, -(-hi // BLOCK)):
        r0, r1 = max(lo, page * BLOCK) - page * BLOCK, min(hi, (page + 1) * BLOCK) - page * BLOCK
        full = kv_page(req_id, page, layer, KV_HEADS, BLOCK, HEAD_DIM)[rank * local:(rank + 1) * local]
        t[blocks[page], :, r0:r1] = full[:, r0:r1]


def _log_sends(events: list) -> None:
    """Every KVSender.send of this process, in `events`, in call order."""
    from kvstage.transfer.engine.handles import KVSender
    send = KVSender.send

    def logged(self, pages, last=None, *, layers=None, ready=None, pool_items=None):
        events.append(("send", self.room, None if layers is None else (layers.start, layers.stop), len(pages)))
        return send(self, pages, last, layers=layers, ready=ready, pool_items=pool_items)
    KVSender.send = logged


def _start(model, producer, tp, rank, rendezvous_port, failure_policy, chunk, layerwise):
    from harness import BLOCK, HEAD_DIM, KV_HEADS, NUM_BLOCKS, kv_cache_config, make_config
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.parallel_state import ensure_model_parallel_initialized, init_distributed_environment

    from kvstage.adapters.vllm.connector import KvstageConnector

    config = make_config(model, producer=producer, tp=tp, rendezvous_port=rendezvous_port,
                         failure_policy=failure_policy, chunk=chunk, layerwise=layerwise)
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=tp, rank=rank, local_rank=rank, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{rendezvous_port + 1}")
        ensure_model_parallel_initialized(tp, 1)
        connector = KvstageConnector(config, KVConnectorRole.WORKER, kv_cache_config(tp))
        caches = {f"model.layers.{i}.self_attn.attn":
                  torch.zeros(NUM_BLOCKS, KV_HEADS // tp, BLOCK, 2 * HEAD_DIM) for i in range(2)}
        connector.register_kv_caches(caches)
    return connector, caches
