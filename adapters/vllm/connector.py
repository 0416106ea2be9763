"""`KvstageConnector`: vLLM's v1 KV connector API over kvstage (docs/vllm.md).

    --kv-transfer-config '{"kv_connector": "KvstageConnector",
                           "kv_connector_module_path": "kvstage.adapters.vllm.connector",
                           "kv_role": "kv_producer" | "kv_consumer",
                           "kv_connector_extra_config": {"rendezvous_port": 18998}}'

vLLM builds one instance in its scheduler process (role SCHEDULER: plan.py decides) and one per
worker (role WORKER: worker.py moves the bytes); `KvstageMetadata` carries each step's orders
from the first to the second. A worker applies them at the first of save_kv_layer,
start_load_kv and wait_for_save (vLLM usually starts loads after the forward), sends each layer
of a prefill step's pages from save_kv_layer, and the layers it was not called for from
wait_for_save. Anything the connector does not support is refused here, at
start, naming it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole
from vllm.v1.request import RequestStatus

from .geometry import ModelGeometry, describe, engine_cache, unsupported_features
from .params import ConnectorSettings
from .plan import PrefillIdentity, Scheduled, SchedulerPlan, StepOrders
from .stats import KvstageConnectorStats, KvstagePromMetrics, interval
from .worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvstage.vllm")

COMPLETED = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


class KvstageMetadata(KVConnectorMetadata):
    """One step's orders from the scheduler side to every worker."""

    def __init__(self, orders: StepOrders):
        self.orders = orders


def _cuda_event():
    """Readiness of the layers the forward just wrote: an event on the current stream, which
    kvstage's own threads synchronize on before reading them (never vLLM's thread)."""
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream())
    return event


def _nothing_to_wait():
    """CPU caches: the forward wrote the layer before save_kv_layer was called."""
    return None


def _default_host() -> str:
    from vllm.utils.network_utils import get_ip
    return get_ip()


class KvstageConnector(KVConnectorBase_V1):
    """Push from prefill to decode through kvstage (staged for heterogeneous TP)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        kvc = vllm_config.kv_transfer_config
        par = vllm_config.parallel_config
        problems = unsupported_features(
            kv_cache_groups=getattr(kv_cache_config, "kv_cache_groups", None),
            pipeline_parallel=par.pipeline_parallel_size, data_parallel=par.data_parallel_size,
            kv_role=kvc.kv_role)
        if problems:
            raise NotImplementedError("the kvstage KV connector does not support " + "; ".join(problems))
        self.settings = ConnectorSettings.parse(kvc.kv_connector_extra_config, _default_host())
        self.is_prefill = kvc.kv_role == "kv_producer"
        self.block_size = vllm_config.cache_config.block_size
        self.engine_id = f"vllm-{'prefill' if self.is_prefill else 'decode'}@{self.settings.rendezvous}"
        self.plan: SchedulerPlan | None = None
        self.worker: WorkerSide | None = None
        self._reported: dict[str, float] = {}     # the worker's counts at its last stats report
        self._layer_index: dict[str, int] = {}    # vLLM's layer name -> kvstage's layer (register order)
        self._applied = True                      # this step's orders went to the worker
        if role == KVConnectorRole.SCHEDULER:
            ident = PrefillIdentity(rendezvous=self.settings.rendezvous, dp_rank=0, engine=self.engine_id,
                                    tp_size=par.tensor_parallel_size)
            self.plan = SchedulerPlan(is_prefill=self.is_prefill, block_size=self.block_size, identity=ident,
                                      layerwise=self.settings.layerwise)

    # -- scheduler side -----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.plan.matched_tokens(request.request_id, request.num_prompt_tokens, request.kv_transfer_params,
                                        num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        self.plan.allocated(request.request_id, request.num_prompt_tokens, request.kv_transfer_params,
                            list(blocks.get_block_ids()[0]), num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        plan, manager = self.plan, self._kv_cache_manager
        if plan.layerwise and manager is not None:
            so, scheduled = scheduler_output, {}
            for new in so.scheduled_new_reqs:
                if plan.streams(new.req_id):
                    scheduled[new.req_id] = Scheduled(computed=new.num_computed_tokens,
                                                      count=so.num_scheduled_tokens[new.req_id])
            cached = so.scheduled_cached_reqs
            for r, computed in zip(cached.req_ids, cached.num_computed_tokens):
                if plan.streams(r):
                    scheduled[r] = Scheduled(computed=computed, count=so.num_scheduled_tokens[r])
            plan.step(scheduled, lambda r: manager.get_block_ids(r)[0], so.preempted_req_ids or ())
        return KvstageMetadata(plan.take_orders())

    def update_connector_output(self, connector_output: KVConnectorOutput):
        self.plan.sent(connector_output.finished_sending)
        self.plan.received(connector_output.finished_recving)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.plan.finished(request.request_id, request.num_prompt_tokens, request.kv_transfer_params,
                                  list(block_ids), request.status in COMPLETED)

    def has_pending_push_work(self) -> bool:
        return self.plan is not None and self.plan.has_orders()

    # -- worker side --------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
        cfg = self._vllm_config
        model = cfg.model_config
        geo = ModelGeometry(num_layers=len(kv_caches), total_kv_heads=model.get_total_num_kv_heads(),
                            local_heads=model.get_num_kv_heads(cfg.parallel_config),
                            head_dim=model.get_head_size(), block_size=self.block_size,
                            tp_size=get_tensor_model_parallel_world_size(), tp_rank=get_tensor_model_parallel_rank(),
                            mla=bool(model.use_mla))
        eng, buffers = engine_cache(geo, kv_caches)
        layout = eng.kv_layout()
        self._layer_index = {name: i for i, name in enumerate(kv_caches)}   # engine_cache's order
        cuda = next(iter(kv_caches.values())).is_cuda
        self.worker = WorkerSide(settings=self.settings, is_prefill=self.is_prefill, tp_rank=geo.tp_rank,
                                 engine_id=self.engine_id, ready=_cuda_event if cuda else _nothing_to_wait)
        self.worker.start(layout, buffers)
        log.info("kvstage %s rank %d/%d ready: engine %s, %s, rendezvous %s, backend %s, staging %s",
                 "prefill" if self.is_prefill else "decode", geo.tp_rank, geo.tp_size, self.engine_id,
                 describe(layout), self.settings.rendezvous, self.settings.backend, self.settings.staging)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._applied = False

    def _apply(self) -> None:
        """This step's orders, once, at the first worker call of the step that can use them."""
        if self._applied or not self.has_connector_metadata():
            return
        self._applied = True
        meta = self._get_connector_metadata()
        if self.worker is not None and isinstance(meta, KvstageMetadata):
            self.worker.apply(meta.orders)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        self._apply()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        """The forward wrote `layer_name`'s KV of this step: send that layer of the pages it completed."""
        self._apply()
        layer = self._layer_index.get(layer_name)
        if self.worker is not None and layer is not None:
            self.worker.save_layer(layer)

    def wait_for_save(self):
        self._apply()
        if self.worker is not None:
            self.worker.end_step()

    def clear_connector_metadata(self) -> None:
        self.wait_for_save()      # idempotent: a step's pages never stay half sent
        super().clear_connector_metadata()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.worker is None:
            return None, None
        sending, recving = self.worker.finished(finished_req_ids)
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors() if self.worker is not None else set()

    # -- stats (stats.py) ----------------------------------------------------------------------
    def get_kv_connector_stats(self) -> KvstageConnectorStats | None:
        """This worker's transfers that ended since the last call (None: none did)."""
        return interval(self.worker.counts, self._reported) if self.worker is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvstageConnectorStats:
        return KvstageConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> KvstagePromMetrics:
        return KvstagePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self):
        if self.worker is not None:
            self.worker.close()

