"""kvstage's per-worker counters in vLLM's own connector stats (docs/vllm.md).

Each worker reports what ended since its last step (`get_kv_connector_stats`); vLLM sums the
workers' objects (`aggregate`), sends the sum to its front end as `data`, rebuilds it there
(`KvstageConnector.build_kv_connector_stats`), sums it again over its log interval and logs
`reduce()` as "KV Transfer metrics: ...", and feeds every step's sum to `KvstagePromMetrics`,
whose counters appear on the server's own /metrics as `vllm:kvstage_*`. A request is counted
once per TP rank that moved it (a TP 2 decode counts each request twice).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

#: the counters, as WorkerSide.counts names them
KEYS = ("succeeded", "failed", "bytes", "seconds", "staged", "direct")

#: Prometheus counter (without vLLM's "vllm:" prefix and the client's "_total") per key
PROM = {
    "succeeded": ("kvstage_transfers_succeeded", "Transfers kvstage ended successfully, per TP rank"),
    "failed": ("kvstage_transfers_failed", "Transfers kvstage failed or aborted, per TP rank"),
    "bytes": ("kvstage_transfer_bytes", "KV bytes kvstage moved in successful transfers"),
    "seconds": ("kvstage_transfer_seconds", "Seconds of successful kvstage transfers (first write to last)"),
    "staged": ("kvstage_staged_transfers", "Successful transfers by the staged path"),
    "direct": ("kvstage_direct_transfers", "Successful transfers by the direct path"),
}


@dataclass
class KvstageConnectorStats(KVConnectorStats):
    """Sums of kvstage's counters over an interval; `data` maps each of KEYS to a number."""

    def __post_init__(self):
        self.data = {k: self.data.get(k, 0) for k in KEYS}

    def reset(self):
        self.data = dict.fromkeys(KEYS, 0)

    def aggregate(self, other: KVConnectorStats) -> KvstageConnectorStats:
        for k in KEYS:
            self.data[k] += other.data.get(k, 0)
        return self

    def is_empty(self) -> bool:
        return not (self.data["succeeded"] or self.data["failed"])

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        mb, seconds = d["bytes"] / 2 ** 20, d["seconds"]
        return {
            "Num successful transfers": int(d["succeeded"]),
            "Num failed transfers": int(d["failed"]),
            "Staged": int(d["staged"]),
            "Direct": int(d["direct"]),
            "MB": round(mb, 3),
            "Avg xfer time (ms)": round(1000 * seconds / d["succeeded"], 3) if d["succeeded"] else 0,
            "Throughput (MB/s)": round(mb / seconds, 3) if seconds > 0 else 0,
        }


class KvstagePromMetrics(KVConnectorPromMetrics):
    """vllm:kvstage_* counters on the server's /metrics, one child per engine."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {
            k: create_metric_per_engine(self._counter_cls(name=f"vllm:{name}", documentation=doc,
                                                          labelnames=labelnames), per_engine_labelvalues)
            for k, (name, doc) in PROM.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        for k, per_engine in self.counters.items():
            value = transfer_stats_data.get(k, 0)
            if value:
                per_engine[engine_idx].inc(value)


def interval(counts: dict[str, float], reported: dict[str, float]) -> KvstageConnectorStats | None:
    """What `counts` gained since `reported` (which it then becomes), or None if nothing ended."""
    delta = {k: counts[k] - reported.get(k, 0) for k in KEYS}
    reported.update({k: counts[k] for k in KEYS})
    stats = KvstageConnectorStats(data=delta)
    return None if stats.is_empty() else stats
