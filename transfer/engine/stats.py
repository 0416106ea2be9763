"""Counters that any engine thread may bump; `snapshot()` is what `KVManager.stats()` returns."""

from __future__ import annotations

import threading
from collections import OrderedDict, defaultdict

MAX_TRACKED_PIECES = 100_000


class Stats:
    def __init__(self):
        self._lock = threading.Lock()
        self._n: dict[str, float] = defaultdict(float)
        self._groups: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self._piece_writes: OrderedDict[tuple, int] = OrderedDict()
        self._piece_hist: dict[int, int] = defaultdict(int)

    def add(self, key: str, value: float = 1) -> None:
        with self._lock:
            self._n[key] += value

    def maximum(self, key: str, value: float) -> None:
        with self._lock:
            self._n[key] = max(self._n[key], value)

    def set(self, key: str, value: float) -> None:
        with self._lock:
            self._n[key] = value

    def count(self, group: str, kind: str, value: int = 1) -> None:
        """Bump a named counter inside a group (failures by kind, dropped messages by reason)."""
        with self._lock:
            self._groups[group][kind] += value

    def sum_in(self, group: str, kind: str, value: float) -> None:
        """Add seconds (or any float) to a named sum inside a group (predicted times by path)."""
        with self._lock:
            self._groups[group][kind] += value  # type: ignore[assignment]

    def staged_write(self, key: tuple) -> None:
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

    def snapshot(self) -> dict:
        with self._lock:
            out: dict = {k: (int(v) if float(v).is_integer() else v) for k, v in self._n.items()}
            for g, kinds in self._groups.items():
                out[g] = dict(kinds)
            out["staged_writes_per_piece"] = {n: c for n, c in self._piece_hist.items() if c}
            return out


def meter_stats(meters: list) -> dict:
    """The stats() entries of some threads (staging/thread_meter.py): wake-ups and CPU seconds,
    by thread name."""
    return {"thread_wakeups": {m.name: m.wakeups for m in meters},
            "thread_cpu_s": {m.name: round(m.cpu_seconds(), 6) for m in meters}}
