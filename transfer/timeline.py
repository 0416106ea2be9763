"""When each phase of one request happened on one rank: the answer to "where did the time between
prefill-done and decode-start go?".

Stamps are `time.monotonic()` seconds of the rank's process (one clock for every process of a
Linux host, not comparable across hosts). The caller's thread stamps `created` and `init`; the
control thread stamps the rest as it sees them; `ended` is the moment the request's outcome was
published. A phase that did not happen on that side is None. Nothing is stamped once the
request ended, so a late completion of a failed request never moves a phase past its end.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, fields

# In time order for a request that goes the usual way; see docs/operations.md for each side.
PHASES = ("created", "metadata", "init", "first_write", "last_write", "scattered", "ended")
# phases that keep their last stamp (every write or scatter moves them), the others their first
LATEST = frozenset({"last_write", "scattered"})


@dataclass(frozen=True, kw_only=True)
class Timeline:
    """The phases of one request on one rank. Prefill: `metadata` = every decode rank's metadata
    received; `first_write` = first backend write posted; `last_write` = last write completed;
    `scattered` None. Decode: `metadata` = the room's metadata sent to the prefill ranks (their
    ranks looked up and connected, and init() given); `first_write`/`last_write` = first and last
    write landed (tag accepted); `scattered` = last staged piece copied into the cache (None on
    the direct path). `ended` = Success or Failed published."""

    created: float | None = None
    metadata: float | None = None
    init: float | None = None
    first_write: float | None = None
    last_write: float | None = None
    scattered: float | None = None
    ended: float | None = None

    def stamps(self) -> list[tuple[str, float]]:
        """The phases that happened, in time order (ties keep PHASES order)."""
        got = [(f.name, getattr(self, f.name)) for f in fields(self)]
        return sorted(((n, t) for n, t in got if t is not None), key=lambda p: (p[1], PHASES.index(p[0])))

    def segments(self) -> list[tuple[str, float]]:
        """(phase, seconds since the phase before it) in time order: the breakdown of the request.
        The first phase that happened gets 0."""
        out, prev = [], None
        for name, t in self.stamps():
            out.append((name, 0.0 if prev is None else t - prev))
            prev = t
        return out

    def between(self, start: str, end: str) -> float | None:
        """Seconds from phase `start` to phase `end`, None unless both happened."""
        a, b = getattr(self, start), getattr(self, end)
        return None if a is None or b is None else b - a


class TimelineRecorder:
    """The stamps of one request while it runs; any thread may stamp. Frozen at `ended`."""

    def __init__(self, created: float):
        self._lock = threading.Lock()
        self._t: dict[str, float] = {"created": created}

    def stamp(self, phase: str, now: float) -> None:
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}")
        with self._lock:
            if "ended" in self._t or (phase in self._t and phase not in LATEST):
                return
            self._t[phase] = now

    def get(self, phase: str) -> float | None:
        with self._lock:
            return self._t.get(phase)

    def timeline(self) -> Timeline:
        with self._lock:
            return Timeline(**self._t)
