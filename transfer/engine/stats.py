"""Counters that any engine thread may bump; `snapshot()` is what `KVManager.stats()` returns.

Every key is named here, as a type: `Number` for a single figure (`add`, `maximum`, `set`) and
`Group` for a family of counters by label (`count`, `sum_in`). A misspelt key is a type error
(mypy, in `make lint`) and fails tests/unit/test_stats_keys.py, which reads every call in the
engine and staging; it never silently becomes a new counter.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, defaultdict
from typing import TYPE_CHECKING, Any, Literal, get_args

if TYPE_CHECKING:
    from ...staging.thread_meter import ThreadMeter

MAX_TRACKED_PIECES = 100_000

Number = Literal[
    "bytes_posted", "bytes_received", "bytes_sent", "corrupted_rooms", "descriptors", "gather_s", "relayout_writes",
    "scatter_s", "staged_bytes", "staged_writes", "tags_received", "watermark_wait_s", "watermark_waits",
    "watermark_waits_started", "write_requests", "writes_announced",
    # maxima
    "backend_step_max_s", "ctrl_round_max_s", "ctrl_tick_late_max_s", "heard_gap_max_s",
    "ring_backlog_high_water_bytes", "ring_high_water_bytes", "silence_max_s",
    # set once or kept current
    "calibration_s", "kernel_warmup_s", "ring_live_bytes",
]
Group = Literal[
    "bytes_received_by_path", "bytes_sent_by_path", "credit_tags", "credits", "descriptors_by_path",
    "dropped_events", "dropped_messages", "dropped_tags", "failures_by_kind", "faults_injected", "gathers",
    "heartbeats_received", "heartbeats_sent", "sibling_lookups",
    "internal_errors", "path_choices", "path_reasons", "peers_lost", "rooms", "rooms_failed_by_kind", "scatters",
    "tags_again", "tags_by_arrival", "write_announcements", "write_failures", "write_requests_by_path",
    "writer_done_answers",
    # sums of seconds by label
    "path_actual_s", "path_predicted_s",
]
NUMBERS: frozenset[str] = frozenset(get_args(Number))
GROUPS: frozenset[str] = frozenset(get_args(Group))
PieceKey = tuple[int, int, int, int]   # a staged piece: (peer incarnation, room, chunk, piece)
# KVManager.stats(): figures by name, and groups of them (a dict by label) by name
Snapshot = dict[str, Any]


class Stats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._n: dict[str, float] = defaultdict(float)
        self._groups: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(int))
        self._piece_writes: OrderedDict[PieceKey, int] = OrderedDict()
        self._piece_hist: dict[int, int] = defaultdict(int)

    def add(self, key: Number, value: float = 1) -> None:
        with self._lock:
            self._n[key] += value

    def maximum(self, key: Number, value: float) -> None:
        with self._lock:
            self._n[key] = max(self._n[key], value)

    def set(self, key: Number, value: float) -> None:
        with self._lock:
            self._n[key] = value

    def count(self, group: Group, kind: str, value: int = 1) -> None:
        """Bump a named counter inside a group (failures by kind, dropped messages by reason)."""
        with self._lock:
            self._groups[group][kind] += value

    def sum_in(self, group: Group, kind: str, value: float) -> None:
        """Add seconds (or any float) to a named sum inside a group (predicted times by path)."""
        with self._lock:
            self._groups[group][kind] += value

    def staged_write(self, key: PieceKey) -> None:
        """Record one staged write request for (peer, room, chunk, piece): the histogram of
        writes per piece shows whether every piece took exactly one write."""
        with self._lock:
            old = self._piece_writes.pop(key, 0)
            if old:
                self._piece_hist[old] -= 1
            self._piece_writes[key] = old + 1
            self._piece_hist[old + 1] += 1
            while len(self._piece_writes) > MAX_TRACKED_PIECES:
                self._piece_writes.popitem(last=False)

    def snapshot(self) -> Snapshot:
        with self._lock:
            out: Snapshot = {k: (int(v) if float(v).is_integer() else v) for k, v in self._n.items()}
            for g, kinds in self._groups.items():
                out[g] = dict(kinds)
            out["staged_writes_per_piece"] = {n: c for n, c in self._piece_hist.items() if c}
            return out


def meter_stats(meters: list[ThreadMeter]) -> dict[str, dict[str, float]]:
    """The stats() entries of some threads (staging/thread_meter.py): wake-ups and CPU seconds,
    by thread name."""
    return {"thread_wakeups": {m.name: m.wakeups for m in meters},
            "thread_cpu_s": {m.name: round(m.cpu_seconds(), 6) for m in meters}}
