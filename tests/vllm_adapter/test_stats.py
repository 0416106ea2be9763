"""kvstage's counters through vLLM's own connector-stats classes (adapters/vllm/stats.py): the
object a worker reports, vLLM's aggregation of two workers (KVOutputAggregator), the front end's
rebuild from the payload, its log line (KVConnectorLogging) and its Prometheus counters
(KVConnectorProm), all vLLM's real classes resolving the connector by its module path."""

from __future__ import annotations

import functools

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging, KVConnectorProm
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

from kvstage.adapters.vllm.connector import KvstageConnector
from kvstage.adapters.vllm.stats import KEYS, KvstageConnectorStats, interval

CONFIG = KVTransferConfig(kv_connector="KvstageConnector", kv_connector_module_path="kvstage.adapters.vllm.connector",
                          kv_role="kv_consumer", kv_connector_extra_config={"rendezvous_port": 1})


def counts(**kw) -> dict:
    return {k: kw.get(k, 0) for k in KEYS}


def test_interval_reports_what_ended_since_the_last_report():
    reported: dict = {}
    c = counts(succeeded=2, bytes=4096, seconds=0.5, staged=2)
    first = interval(c, reported)
    assert first.data == c
    assert interval(c, reported) is None          # nothing new: nothing reported
    c["failed"] += 1
    assert interval(c, reported).data == counts(failed=1)


def test_two_workers_aggregate_and_reduce():
    def output(stats):
        return ModelRunnerOutput(req_ids=[], req_id_to_index={},
                                 kv_connector_output=KVConnectorOutput(kv_connector_stats=stats))
    a = KvstageConnectorStats(data=counts(succeeded=3, bytes=3 * 2 ** 20, seconds=0.3, direct=3))
    b = KvstageConnectorStats(data=counts(succeeded=1, failed=1, bytes=2 ** 20, seconds=0.1, direct=1))
    merged = KVOutputAggregator(expected_finished_count=2).aggregate([output(a), output(b)])
    stats = merged.kv_connector_output.kv_connector_stats
    assert stats.data == counts(succeeded=4, failed=1, bytes=4 * 2 ** 20, seconds=0.4, direct=4)
    # what vLLM sends to its front end, and rebuilds there through the connector class
    rebuilt = KvstageConnector.build_kv_connector_stats(stats.to_dict())
    assert isinstance(rebuilt, KvstageConnectorStats) and rebuilt.data == stats.data
    reduced = rebuilt.reduce()
    assert reduced["Num successful transfers"] == 4 and reduced["Num failed transfers"] == 1
    assert reduced["Direct"] == 4 and reduced["Staged"] == 0 and reduced["MB"] == 4
    assert reduced["Avg xfer time (ms)"] == 100 and reduced["Throughput (MB/s)"] == 10


def test_front_end_logs_and_exports_them():
    logging = KVConnectorLogging(CONFIG)
    logging.observe(counts(succeeded=2, bytes=2 ** 21, seconds=0.2, staged=2))
    logging.observe(counts(failed=1))
    lines = []
    logging.log(lambda fmt, *args: lines.append(fmt % args))
    assert lines == ["KV Transfer metrics: Num successful transfers=2, Num failed transfers=1, Staged=2, "
                     "Direct=0, MB=2.0, Avg xfer time (ms)=100.0, Throughput (MB/s)=10.0"]

    registry = CollectorRegistry()

    class Prom(KVConnectorProm):
        _gauge_cls = functools.partial(Gauge, registry=registry)
        _counter_cls = functools.partial(Counter, registry=registry)
        _histogram_cls = functools.partial(Histogram, registry=registry)

    class Config:
        kv_transfer_config = CONFIG
    prom = Prom(Config(), ["model_name", "engine"], {0: ["m", "0"]})
    prom.observe(counts(succeeded=2, bytes=2 ** 21, seconds=0.2, staged=2), 0)
    prom.observe(counts(succeeded=1, bytes=100, seconds=0.1, direct=1, failed=1), 0)

    def value(name):
        return registry.get_sample_value(f"vllm:kvstage_{name}_total", {"model_name": "m", "engine": "0"})
    assert value("transfers_succeeded") == 3 and value("transfers_failed") == 1
    assert value("transfer_bytes") == 2 ** 21 + 100 and value("staged_transfers") == 2
    assert value("direct_transfers") == 1 and abs(value("transfer_seconds") - 0.3) < 1e-9
