"""Every metric a rank exports, as data: its name, type, where its number comes from in
`KVManager.stats()`, the label its breakdown becomes, and the roles that have it.

Counters and gauges are read from `stats()` at scrape time (one source of truth: what the
exporter shows is what `stats()` says); histograms are fed by the control thread as writes and
requests end. docs/operations.md lists the same metrics (a unit test keeps the two in step).
"""

from __future__ import annotations

from dataclasses import dataclass

BOTH = ("prefill", "decode")
PATHS = ("staged", "direct")
# every series of a rank carries these (histograms add `path`)
RANK_LABELS = ("role", "engine", "rank", "backend")


@dataclass(frozen=True)
class Metric:
    name: str                   # the exposed name (counters end in _total)
    kind: str                   # "counter", "gauge" or "histogram"
    help: str
    source: str = ""            # the stats() key; "" for histograms
    label: str | None = None    # the stats() group's keys become this label; None: one number
    roles: tuple[str, ...] = BOTH
    always: tuple[str, ...] = ()   # label values exposed (as 0) before they are first counted


STATS_METRICS = (
    Metric("kvstage_sent_bytes_total", "counter", "KV bytes of backend writes completed (prefill)",
           "bytes_sent_by_path", "path", ("prefill",), PATHS),
    Metric("kvstage_received_bytes_total", "counter", "KV bytes of writes landed and accepted (decode)",
           "bytes_received_by_path", "path", ("decode",), PATHS),
    Metric("kvstage_backend_writes_total", "counter", "backend write requests posted (prefill)",
           "write_requests_by_path", "path", ("prefill",), PATHS),
    Metric("kvstage_descriptors_total", "counter", "memory ranges (descriptors) in the backend writes posted (prefill)",
           "descriptors_by_path", "path", ("prefill",), PATHS),
    Metric("kvstage_write_failures_total", "counter", "backend writes that completed with a failure (prefill)",
           "write_failures", None, ("prefill",)),
    Metric("kvstage_requests_total", "counter", "requests ended, by outcome",
           "rooms", "outcome", BOTH, ("success", "failed")),
    Metric("kvstage_request_failures_total", "counter", "failed requests by failure kind (docs/operations.md)",
           "rooms_failed_by_kind", "kind"),
    Metric("kvstage_watermark_stalls_total", "counter",
           "staged pieces that waited for the decode ring's watermark to free their region (prefill)",
           "watermark_waits", None, ("prefill",)),
    Metric("kvstage_watermark_stall_seconds_total", "counter", "seconds staged pieces waited for ring space (prefill)",
           "watermark_wait_s", None, ("prefill",)),
    Metric("kvstage_gather_seconds_total", "counter", "seconds transfer workers spent gathering into staging buffers "
           "(prefill, staged)", "gather_s", None, ("prefill",)),
    Metric("kvstage_scatter_seconds_total", "counter", "seconds spent scattering the staging ring into the KV cache "
           "(decode, staged)", "scatter_s", None, ("decode",)),
    Metric("kvstage_peers_lost_total", "counter", "peers declared lost, by the state their connection was in",
           "peers_lost", "state"),
    Metric("kvstage_dropped_messages_total", "counter", "control messages dropped, by reason", "dropped_messages",
           "reason"),
    Metric("kvstage_dropped_tags_total", "counter", "write notifications dropped, by reason", "dropped_tags", "reason"),
    Metric("kvstage_internal_errors_total", "counter", "exceptions caught in the control thread, by where",
           "internal_errors", "where"),
    Metric("kvstage_thread_wakeups_total", "counter", "times each kvstage thread woke up (ctrl: rounds of the "
           "control loop; xfer-N, scatter, metrics)", "thread_wakeups", "thread"),
    Metric("kvstage_thread_cpu_seconds_total", "counter", "CPU seconds each kvstage thread used", "thread_cpu_s",
           "thread"),
    Metric("kvstage_backend_steps_total", "counter", "backend steps of the control thread, by what was in flight "
           "(writes, expected, draining: polling; quiet: ticks and other wake-ups)", "backend_steps", "activity"),
    Metric("kvstage_tags_by_arrival_total", "counter", "decode: write notifications read after their WritePosted "
           "announcement (expected) or without one, found by a tick (unannounced)", "tags_by_arrival", "arrival",
           ("decode",), ("expected", "unannounced")),
    Metric("kvstage_requests_active", "gauge", "requests the control thread holds now", "rooms_active"),
    Metric("kvstage_peers_connected", "gauge", "peer ranks connected now", "peers_connected"),
    Metric("kvstage_staging_ring_size_bytes", "gauge", "size of this rank's staging ring (decode, staging on)",
           "ring_bytes", None, ("decode",)),
    Metric("kvstage_staging_ring_occupied_bytes", "gauge", "staging ring bytes allocated now (decode)",
           "ring_occupied_bytes", None, ("decode",)),
    Metric("kvstage_staging_ring_high_water_bytes", "gauge", "most staging ring bytes ever allocated at once (decode)",
           "ring_high_water_bytes", None, ("decode",)),
    Metric("kvstage_staged_pieces_waiting", "gauge", "staged pieces waiting for ring space now (prefill)",
           "staged_pieces_waiting", None, ("prefill",)),
    Metric("kvstage_quarantined_bytes", "gauge", "memory held back because a write may still land in it (decode: "
           "failed requests' ring regions and pages; prefill: sources of writes the backend may still read)",
           "quarantined_bytes"),
)

# buckets in seconds: from a one-page request on shared memory to a long request over TCP
SECONDS_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0,
                   120.0, 300.0)
COUNT_BUCKETS = tuple(float(4 ** i) for i in range(12))   # 1 .. 4 Mi: writes or descriptors per request

HISTOGRAMS = (
    Metric("kvstage_transfer_seconds", "histogram", "successful requests: seconds from init() to Success"),
    Metric("kvstage_write_seconds", "histogram", "one backend write: seconds from the backend taking it to its "
           "completion (prefill)", roles=("prefill",)),
    Metric("kvstage_request_backend_writes", "histogram", "backend writes per successful request (prefill: posted, "
           "decode: landed)"),
    Metric("kvstage_request_descriptors", "histogram", "descriptors per successful request (prefill)",
           roles=("prefill",)),
)

ALL = STATS_METRICS + HISTOGRAMS


def for_role(role: str, metrics: tuple[Metric, ...] = ALL) -> tuple[Metric, ...]:
    return tuple(m for m in metrics if role in m.roles)


def samples(metric: Metric, stats: dict) -> list[tuple[str | None, float]] | None:
    """(label value, number) pairs of a counter or gauge in a stats() snapshot; None when the
    snapshot lacks it (a gauge whose part this rank does not have, e.g. no staging ring).
    A group read as one number is its sum."""
    value = stats.get(metric.source)
    if metric.label is None:
        if value is None:
            return [(None, 0.0)] if metric.kind == "counter" else None
        return [(None, float(sum(value.values()) if isinstance(value, dict) else value))]
    group = dict.fromkeys(metric.always, 0)
    group.update(value or {})
    return [(str(k), float(v)) for k, v in sorted(group.items(), key=lambda kv: str(kv[0]))]
