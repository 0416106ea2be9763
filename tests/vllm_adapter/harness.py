"""vLLM's real scheduler and kvstage's connector without servers: one `Engine` per instance
drives vLLM's `Scheduler` (which builds the connector's SCHEDULER side itself, through vLLM's
connector factory), hands each step's connector metadata to its TP workers (harness_worker.py,
one process each, with the connector's WORKER side over real kvstage on small CPU caches in the
CPU backend's layout), sums their outputs with vLLM's `KVOutputAggregator` and feeds them back
through `Scheduler.update_from_output`, as vLLM's engine core does; the model's forward is
replaced by each worker writing a request's KV as a pattern (harness_worker.kv_page). Workers
fork from a forkserver that has vLLM imported (WORKER_PRELOAD).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

BLOCK = 32
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 32
NUM_BLOCKS = 24
MODULE = "kvstage.adapters.vllm.connector"
STEP_S = 60          # one worker's answer to one step
READY_S = 240        # a worker's start (imports vLLM and torch; minutes on a loaded 2-core machine)
# what each worker would import on its own (about 10 s of CPU each): the workers fork from a
# forkserver that imported it once per test session; what a worker reads from its environment
# (kvstage's configuration, vLLM's envs) it reads after the fork
WORKER_PRELOAD = ["torch", "harness", "harness_worker", "vllm.config", "vllm.distributed.parallel_state",
                  "vllm.distributed.kv_transfer.kv_connector.v1.base", "vllm.v1.outputs"]


def write_model(path: Path) -> str:
    """A tiny Llama's config only: the scheduler and the connector read the model's shape; no
    weights are loaded (the forward is the harness's pattern)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM, "num_hidden_layers": LAYERS, "vocab_size": 512,
        "max_position_embeddings": 1024, "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": "float32", "tie_word_embeddings": False}))
    return str(path)


def make_config(model: str, *, producer: bool, tp: int, rendezvous_port: int,
                failure_policy: str = "fail", chunk: int = 2048, layerwise: bool = True) -> VllmConfig:
    """Prefix caching on the decode only: a page a prefill request shares with an earlier one then
    holds this request's own pattern, so a prefill that sent a page the decode already holds
    would overwrite the decode's copy visibly. `chunk`: tokens per step (chunked prefill; a
    chunk may end inside a page)."""
    mc = ModelConfig(model=model, dtype="float32", skip_tokenizer_init=True, max_model_len=1024,
                     enforce_eager=True)
    kv = KVTransferConfig(kv_connector="KvstageConnector", kv_connector_module_path=MODULE,
                          kv_role="kv_producer" if producer else "kv_consumer",
                          kv_connector_extra_config={"rendezvous_port": rendezvous_port, "host": "127.0.0.1",
                                                     "layerwise": layerwise},
                          kv_load_failure_policy=failure_policy)
    config = VllmConfig(model_config=mc, cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=not producer),
                        scheduler_config=SchedulerConfig(max_model_len=1024, is_encoder_decoder=False,
                                                         max_num_batched_tokens=chunk, max_num_seqs=16,
                                                         enable_chunked_prefill=True),
                        parallel_config=ParallelConfig(tensor_parallel_size=tp), device_config=DeviceConfig("cpu"),
                        kv_transfer_config=kv)
    config.cache_config.num_gpu_blocks = NUM_BLOCKS    # what vLLM's engine sets after profiling
    return config


def kv_cache_config(tp: int) -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS // tp, head_size=HEAD_DIM,
                             dtype=torch.float32)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, spec)])


@dataclass
class Finished:
    """What vLLM's scheduler said about one request when it finished."""

    reason: str
    tokens: list[int]
    kv_transfer_params: dict | None


@dataclass
class Engine:
    """One instance: vLLM's Scheduler in this process, `tp` worker processes."""

    name: str
    model: str
    producer: bool
    tp: int
    rendezvous_port: int
    failure_policy: str = "fail"
    chunk: int = 2048                                               # tokens per step
    layerwise: bool = True                                          # the connector's `layerwise`
    env: dict[str, str] = field(default_factory=dict)               # the workers' environment (kvstage's)
    finished: dict[str, Finished] = field(default_factory=dict)
    tokens: dict[str, list[int]] = field(default_factory=dict)
    first_scheduled: dict[str, int] = field(default_factory=dict)   # tokens in each request's first step
    stats: list[dict] = field(default_factory=list)                 # scheduler stats' kv_connector_stats

    def __post_init__(self):
        from harness_worker import serve
        self.config = make_config(self.model, producer=self.producer, tp=self.tp,
                                  rendezvous_port=self.rendezvous_port, failure_policy=self.failure_policy,
                                  chunk=self.chunk, layerwise=self.layerwise)
        ctx = mp.get_context("forkserver")   # workers fork from one process with vLLM imported
        ctx.set_forkserver_preload(WORKER_PRELOAD)
        self.pipes, self.procs = [], []
        for rank in range(self.tp):
            ours, theirs = ctx.Pipe()
            p = ctx.Process(target=serve, name=f"{self.name}-rank{rank}", daemon=True,
                            args=(theirs, self.model, self.producer, self.tp, rank, self.rendezvous_port,
                                  self.failure_policy, self.chunk, self.layerwise, self.env))
            p.start()
            self.pipes.append(ours)
            self.procs.append(p)
        for rank in range(self.tp):
            self._answer(rank, "ready")
        self.scheduler = Scheduler(vllm_config=self.config, kv_cache_config=kv_cache_config(self.tp),
                                   structured_output_manager=StructuredOutputManager(self.config),
                                   block_size=BLOCK, log_stats=True)
        self.aggregator = KVOutputAggregator(expected_finished_count=self.tp)
        hash_fn = get_hash_fn_by_name(self.config.cache_config.prefix_caching_hash_algo)   # as EngineCore
        init_none_hash(hash_fn)
        self.block_hasher = get_request_block_hasher(BLOCK, hash_fn)

    def _answer(self, rank: int, what: str):
        limit = READY_S if what == "ready" else STEP_S
        if not self.pipes[rank].poll(limit):
            raise TimeoutError(f"{self.name} rank {rank}: no answer to {what} in {limit} s "
                               f"(alive: {self.procs[rank].is_alive()})")
        kind, value = self.pipes[rank].recv()
        if kind == "error":
            raise RuntimeError(f"{self.name} rank {rank}: {what}: {value}")
        return value

    def add(self, req_id: str, prompt: list[int], max_tokens: int, kv_transfer_params: dict | None) -> None:
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        sp.extra_args = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
        req = Request(request_id=req_id, prompt_token_ids=list(prompt), sampling_params=sp, pooling_params=None,
                      block_hasher=self.block_hasher)
        self.scheduler.add_request(req)

    def step(self) -> bool:
        """One engine step: schedule, the workers' forward and connector calls, update. True
        when it computed tokens."""
        so = self.scheduler.schedule()
        for new in so.scheduled_new_reqs:
            self.first_scheduled.setdefault(new.req_id, so.num_scheduled_tokens[new.req_id])
        before = {new.req_id: new.num_computed_tokens for new in so.scheduled_new_reqs}
        before.update(zip(so.scheduled_cached_reqs.req_ids, so.scheduled_cached_reqs.num_computed_tokens))
        writes = []
        if self.producer:   # the forward writes the KV of the prompt tokens this step computes
            for req_id, lo in before.items():
                prompt = self.scheduler.requests[req_id].num_prompt_tokens
                hi = min(lo + so.num_scheduled_tokens[req_id], prompt)
                if lo < hi:
                    writes.append((req_id, self.block_ids(req_id), lo, hi, prompt))
        order = list(so.num_scheduled_tokens)
        for rank in range(self.tp):
            self.pipes[rank].send(("step", (so.kv_connector_metadata, set(so.finished_req_ids), writes)))
        outputs = []
        for rank in range(self.tp):
            kv_out = self._answer(rank, "step")
            sampled = [[self._next_token(r, so)] if self._samples(r, so) else [] for r in order]
            outputs.append(ModelRunnerOutput(req_ids=order, req_id_to_index={r: i for i, r in enumerate(order)},
                                             sampled_token_ids=sampled, kv_connector_output=kv_out))
        merged = self.aggregator.aggregate(outputs)
        for eco in self.scheduler.update_from_output(so, merged).values():
            for out in eco.outputs:
                self.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.finish_reason is not None:
                    self.finished[out.request_id] = Finished(reason=str(out.finish_reason),
                                                             tokens=self.tokens[out.request_id],
                                                             kv_transfer_params=out.kv_transfer_params)
            if eco.scheduler_stats is not None and eco.scheduler_stats.kv_connector_stats:
                self.stats.append(eco.scheduler_stats.kv_connector_stats)
        return so.total_num_scheduled_tokens > 0

    def _samples(self, req_id: str, so) -> bool:
        """A request samples when this step reaches the end of what it has to compute (a chunk
        of a longer prompt does not); schedule() already counted this step's tokens as computed."""
        req = self.scheduler.requests[req_id]
        return req.num_computed_tokens >= req.num_tokens

    def _next_token(self, req_id: str, so) -> int:
        return 100 + len(self.tokens.get(req_id, ()))

    def run_until(self, done, what: str, timeout: float = 120) -> None:
        """Step until done(); a step that scheduled nothing first waits up to 20 ms on rank 0's
        pipe (the transfers run on kvstage's threads), so an idle engine does not spin."""
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: {what} not reached in {timeout} s")
            if not self.step():
                self.pipes[0].poll(0.02)

    def events(self, rank: int) -> list[tuple]:
        """The worker's log since the last call: ("save", layer) before each save_kv_layer,
        ("send", room, layers, pages) for each KVSender.send, ("wait",) before wait_for_save."""
        self.pipes[rank].send(("events", None))
        return self._answer(rank, "events")

    def read(self, rank: int, block_ids: list[int]) -> torch.Tensor:
        self.pipes[rank].send(("read", block_ids))
        return self._answer(rank, "read")

    def block_ids(self, req_id: str) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[0])

    def used_blocks(self) -> int:
        pool = self.scheduler.kv_cache_manager.block_pool
        return pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()

    def close(self) -> None:
        for rank, p in enumerate(self.procs):
            if p.is_alive():
                try:
                    self.pipes[rank].send(("close", None))
                except OSError:
                    pass
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
