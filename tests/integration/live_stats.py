"""Waiting on what a rank says it has seen (pd_rank's live_stats files), never on the clock: a
control thread on a busy 2-CPU box can be seconds behind its socket."""

from __future__ import annotations

import json
import time
from pathlib import Path


def dropped(path: Path) -> dict[str, int] | None:
    """The rank's dropped_messages counters by reason, or None before its first live_stats file."""
    try:
        return json.loads(path.read_text()).get("dropped_messages", {})
    except (OSError, ValueError):
        return None


def wait_for_drops(paths: dict[str, Path], at_least: float, kinds: tuple[str, ...] | None = None,
                   timeout_s: float = 120) -> None:
    """Until every rank in `paths` counted at least `at_least` dropped messages (of `kinds`, when
    given); an AssertionError naming what each had counted at the deadline."""
    deadline = time.monotonic() + timeout_s
    counted: dict[str, float] = {}
    while True:
        for name, path in paths.items():
            d = dropped(path)
            if d is not None:
                counted[name] = sum(v for k, v in d.items() if kinds is None or k in kinds)
        if len(counted) == len(paths) and min(counted.values()) >= at_least:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"the ranks never counted {at_least} dropped messages {kinds or ''}: {counted}")
        time.sleep(0.2)


def wait_for_stat(path: Path, key: str, at_least: float = 1, timeout_s: float = 60) -> None:
    """Until the rank's live stats count at least `at_least` of `key` (say bytes_received: its
    transfers are under way; a counter by label, say peers_lost: its labels together); an
    AssertionError with the last value at the deadline."""
    deadline = time.monotonic() + timeout_s
    seen = None
    while True:
        try:
            seen = json.loads(Path(path).read_text()).get(key, 0)
            if isinstance(seen, dict):   # a counter by label: all of them
                seen = sum(seen.values())
        except (OSError, ValueError):
            pass
        if seen is not None and seen >= at_least:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{path}: {key} never reached {at_least} (last seen {seen})")
        time.sleep(0.05)
