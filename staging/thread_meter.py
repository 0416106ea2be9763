"""What one kvstage thread costs its process: how often it woke up and how much CPU it used.

kvstage runs inside the serving engine's scheduler process, so each of its threads is
accounted for (`KVManager.stats()["thread_wakeups"]` and `["thread_cpu_s"]`, see transfer/engine/stats.py). The thread
counts its own wake-ups (a plain int only it writes); its CPU time is read by whoever asks,
from the kernel's per-thread accounting, so the measured thread pays nothing for it.
"""

from __future__ import annotations

import os
import threading
import time

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def thread_cpu_seconds(native_id: int) -> float | None:
    """CPU seconds of a thread of this process: /proc's schedstat (ns), else stat (clock
    ticks); None when the thread is gone or /proc has neither."""
    base = f"/proc/self/task/{native_id}"
    try:
        with open(f"{base}/schedstat", "rb") as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(f"{base}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _CLK_TCK   # utime, stime
    except (OSError, ValueError, IndexError):
        return None


class ThreadMeter:
    def __init__(self, name: str):
        self.name = name
        self.wakeups = 0
        self._native_id: int | None = None
        self._final_cpu: float | None = None

    def started(self) -> None:
        """In the measured thread, first thing. The thread also takes its kvstage name in the
        kernel ("kvstage-ctrl", ...), so `top -H`, py-spy and examples/bench_sglang.py can tell
        kvstage's threads from the serving engine's."""
        self._native_id = threading.get_native_id()
        _name_thread(f"kvstage-{self.name}")

    def wake(self) -> None:
        """In the measured thread, each time it returns from blocking."""
        self.wakeups += 1

    def stopped(self) -> None:
        """In the measured thread, last thing: its CPU time stays readable once it is gone."""
        self._final_cpu = time.thread_time()

    def cpu_seconds(self) -> float:
        if self._final_cpu is not None:
            return self._final_cpu
        if self._native_id is None:
            return 0.0
        cpu = thread_cpu_seconds(self._native_id)
        return cpu if cpu is not None else 0.0



def _name_thread(name: str) -> None:
    """The calling thread's kernel name (Linux keeps 15 bytes); best effort elsewhere."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(15, name.encode()[:15], 0, 0, 0)   # PR_SET_NAME
    except (OSError, AttributeError):
        pass
