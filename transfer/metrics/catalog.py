"""Every metric a rank exports, as data: its name, type, where its number comes from in
`KVManager.stats()`, the label its breakdown becomes, and the roles that have it.

Counters and gauges are read from `stats()` at scrape time (one source of truth: what the
exporter shows is what `stats()` says); histograms are fed by the control thread as writes and
requests end. docs/operations.md lists the same metrics (a unit test keeps the two in step).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

BOTH = ("prefill", "decode")
PATHS = ("staged", "direct")
# every series of a rank carries these (histograms add `path`)
RANK_LABELS = ("role", "engine", "rank", "backend")


@dataclass(frozen=True, kw_only=True)
class Metric:
    name: str                   # the exposed name (counters end in _total)
    kind: str                   # "counter", "gauge" or "histogram"
    help: str
    source: str = ""            # the stats() key; "" for histograms
    label: str | None = None    # the stats() group's keys become this label; None: one number
    roles: tuple[str, ...] = BOTH
    always: tuple[str, ...] = ()   # label values exposed (as 0) before they are first counted


STATS_METRICS = (
    Metric(
        name="kvstage_sent_bytes_total",
        kind="counter",
        help="KV bytes of backend writes completed (prefill)",
        source="bytes_sent_by_path",
        label="path",
        roles=("prefill",),
        always=PATHS,
    ),
    Metric(
        name="kvstage_received_bytes_total",
        kind="counter",
        help="KV bytes of writes landed and accepted (decode)",
        source="bytes_received_by_path",
        label="path",
        roles=("decode",),
        always=PATHS,
    ),
    Metric(
        name="kvstage_backend_writes_total",
        kind="counter",
        help="backend write requests posted (prefill)",
        source="write_requests_by_path",
        label="path",
        roles=("prefill",),
        always=PATHS,
    ),
    Metric(
        name="kvstage_descriptors_total",
        kind="counter",
        help="memory ranges (descriptors) in the backend writes posted (prefill)",
        source="descriptors_by_path",
        label="path",
        roles=("prefill",),
        always=PATHS,
    ),
    Metric(
        name="kvstage_write_failures_total",
        kind="counter",
        help="backend writes that completed with a failure (prefill)",
        source="write_failures",
        label=None,
        roles=("prefill",),
    ),
    Metric(
        name="kvstage_requests_total",
        kind="counter",
        help="requests ended, by outcome",
        source="rooms",
        label="outcome",
        roles=BOTH,
        always=("success", "failed"),
    ),
    Metric(
        name="kvstage_request_failures_total",
        kind="counter",
        help="failed requests by failure kind (docs/operations.md)",
        source="rooms_failed_by_kind",
        label="kind",
    ),
    Metric(
        name="kvstage_path_choices_total",
        kind="counter",
        help="requests that succeeded by the path the choice took (decode, docs/path_choice.md)",
        source="path_choices",
        label="path",
        roles=("decode",),
        always=PATHS,
    ),
    Metric(
        name="kvstage_path_reasons_total",
        kind="counter",
        help="why the path choice took its path: forced, predicted, cannot_stage, fixed_rule (decode)",
        source="path_reasons",
        label="reason",
        roles=("decode",),
    ),
    Metric(
        name="kvstage_path_predicted_seconds_total",
        kind="counter",
        help="the path choice's predicted seconds of the requests it predicted, by path (decode)",
        source="path_predicted_s",
        label="path",
        roles=("decode",),
        always=PATHS,
    ),
    Metric(
        name="kvstage_path_actual_seconds_total",
        kind="counter",
        help="init() to Success of the same requests, by path: a wrong choice shows as a ratio far from 1 (decode)",
        source="path_actual_s",
        label="path",
        roles=("decode",),
        always=PATHS,
    ),
    Metric(
        name="kvstage_watermark_stalls_total",
        kind="counter",
        help="staged pieces that waited for the decode ring's watermark to free their region (prefill)",
        source="watermark_waits",
        label=None,
        roles=("prefill",),
    ),
    Metric(
        name="kvstage_watermark_stall_seconds_total",
        kind="counter",
        help="seconds staged pieces waited for ring space (prefill)",
        source="watermark_wait_s",
        label=None,
        roles=("prefill",),
    ),
    Metric(
        name="kvstage_gather_seconds_total",
        kind="counter",
        help="seconds transfer workers spent gathering into staging buffers (prefill, staged)",
        source="gather_s",
        label=None,
        roles=("prefill",),
    ),
    Metric(
        name="kvstage_scatter_seconds_total",
        kind="counter",
        help="seconds spent scattering the staging ring into the KV cache (decode, staged)",
        source="scatter_s",
        label=None,
        roles=("decode",),
    ),
    Metric(
        name="kvstage_peers_lost_total",
        kind="counter",
        help="peers declared lost, by the state their connection was in",
        source="peers_lost",
        label="state",
    ),
    Metric(
        name="kvstage_dropped_messages_total",
        kind="counter",
        help="control messages dropped, by reason",
        source="dropped_messages",
        label="reason",
    ),
    Metric(
        name="kvstage_dropped_tags_total",
        kind="counter",
        help="write notifications dropped, by reason",
        source="dropped_tags",
        label="reason",
    ),
    Metric(
        name="kvstage_internal_errors_total",
        kind="counter",
        help="exceptions caught in the control thread, by where",
        source="internal_errors",
        label="where",
    ),
    Metric(
        name="kvstage_thread_wakeups_total",
        kind="counter",
        help="times each kvstage thread woke up (ctrl: rounds of the control loop; xfer-N, scatter, metrics)",
        source="thread_wakeups",
        label="thread",
    ),
    Metric(
        name="kvstage_thread_cpu_seconds_total",
        kind="counter",
        help="CPU seconds each kvstage thread used",
        source="thread_cpu_s",
        label="thread",
    ),
    Metric(
        name="kvstage_backend_steps_total",
        kind="counter",
        help="backend steps of the control thread, by what was in flight "
        "(writes, expected, draining: polling; quiet: ticks and other wake-ups)",
        source="backend_steps",
        label="activity",
    ),
    Metric(
        name="kvstage_tags_by_arrival_total",
        kind="counter",
        help="decode: write notifications read after their WritePosted "
        "announcement (expected) or without one, found by a tick (unannounced)",
        source="tags_by_arrival",
        label="arrival",
        roles=("decode",),
        always=("expected", "unannounced"),
    ),
    Metric(
        name="kvstage_tags_again_total",
        kind="counter",
        help="decode: write tags a writer's WriterDone repeated: recovered (its notification was "
        "lost or not read yet), already_in, other_room",
        source="tags_again",
        label="outcome",
        roles=("decode",),
        always=("recovered", "already_in"),
    ),
    Metric(
        name="kvstage_requests_active",
        kind="gauge",
        help="requests the control thread holds now",
        source="rooms_active",
    ),
    Metric(name="kvstage_peers_connected", kind="gauge", help="peer ranks connected now", source="peers_connected"),
    Metric(
        name="kvstage_staging_ring_size_bytes",
        kind="gauge",
        help="size of this rank's staging ring (decode, staging on)",
        source="ring_bytes",
        label=None,
        roles=("decode",),
    ),
    Metric(
        name="kvstage_staging_ring_occupied_bytes",
        kind="gauge",
        help="staging ring bytes allocated now (decode)",
        source="ring_occupied_bytes",
        label=None,
        roles=("decode",),
    ),
    Metric(
        name="kvstage_staging_ring_high_water_bytes",
        kind="gauge",
        help="most staging ring bytes ever allocated at once (decode)",
        source="ring_high_water_bytes",
        label=None,
        roles=("decode",),
    ),
    Metric(
        name="kvstage_staged_pieces_waiting",
        kind="gauge",
        help="staged pieces waiting for ring space now (prefill)",
        source="staged_pieces_waiting",
        label=None,
        roles=("prefill",),
    ),
    Metric(
        name="kvstage_quarantined_bytes",
        kind="gauge",
        help="memory held back because a write may still land in it (decode: "
        "failed requests' ring regions and pages; prefill: sources of writes the backend may still read)",
        source="quarantined_bytes",
    ),
)

# buckets in seconds: from a one-page request on shared memory to a long request over TCP
SECONDS_BUCKETS = (
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
    0.2,
    0.5,
    1.0,
    2.0,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)
COUNT_BUCKETS = tuple(float(4**i) for i in range(12))  # 1 .. 4 Mi: writes or descriptors per request

HISTOGRAMS = (
    Metric(
        name="kvstage_transfer_seconds", kind="histogram", help="successful requests: seconds from init() to Success"
    ),
    Metric(
        name="kvstage_write_seconds",
        kind="histogram",
        help="one backend write: seconds from the backend taking it to its completion (prefill)",
        roles=("prefill",),
    ),
    Metric(
        name="kvstage_request_backend_writes",
        kind="histogram",
        help="backend writes per successful request (prefill: posted, decode: landed)",
    ),
    Metric(
        name="kvstage_request_descriptors",
        kind="histogram",
        help="descriptors per successful request (prefill)",
        roles=("prefill",),
    ),
)

ALL = STATS_METRICS + HISTOGRAMS


def for_role(role: str, metrics: tuple[Metric, ...] = ALL) -> tuple[Metric, ...]:
    return tuple(m for m in metrics if role in m.roles)


def samples(metric: Metric, stats: Mapping[str, Any]) -> list[tuple[str | None, float]] | None:
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
