"""The measuring shell of the path choice (protocol/path_choice.py): at start, off the request
path and bounded to about a second, what this rank's writes, gathers and scatters cost.

- Writes: a few probe writes from this rank's backend into a second, private endpoint of the
  same backend in this process, on memory of the KV cache's kind: one range of a few bytes, many
  ranges of a few bytes, one range of many bytes. Their times fit per write, per range and per
  byte costs (path_choice.fit_write_cost).
- Copies: the page copies a gather and a scatter make (rows of one page of one head group,
  scattered across a buffer), timed on the KV cache's device.

A calibration that fails (a backend refusing a probe, a probe past its deadline) returns no
costs and logs one warning: the rank then plans by the fixed rule; it never fails the start.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import numpy as np
import torch

from ..backends.base import Backend, MemRegion, WriteState
from ..protocol.path_choice import WriteCost, WriterCosts, fit_write_cost

log = logging.getLogger("kvstage")

PROBE_BYTES = 4 << 20          # the large probe write and the copy benchmark
PROBE_RANGES = 128             # ranges of the many-range probe (Mooncake over TCP: ~0.4 ms a range)
PROBE_RANGE_BYTES = 64
PROBE_DEADLINE_S = 5.0         # all probe writes together: a bound for a stuck probe (they take 0.1-1.5 s)
REPEATS = 3                    # each probe write; the fastest counts

T = TypeVar("T")


class BackendCall(Protocol):
    """Runs a function of the rank's backend on the thread owning it (BackendOwner.call)."""

    def __call__(self, fn: Callable[[Backend], T], /) -> T: ...


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """What this rank measured: its writes' costs (None: not measured) and copy rates."""

    writer: WriterCosts | None
    scatter_bytes_per_s: float | None
    seconds: float                # what measuring took


def copy_rates(device: torch.device, row_bytes: int, total: int = PROBE_BYTES) -> tuple[float, float]:
    """Bytes per second of a gather (rows at scattered places into one contiguous buffer) and a
    scatter (the reverse) of `row_bytes` rows on `device`."""
    rows = max(1, total // max(8, row_bytes))
    width = max(1, row_bytes // 8)     # 8-byte elements, as the staging kernels move them (copy_units.py)
    cache = torch.zeros((rows * 2, width), dtype=torch.int64, device=device)
    buf = torch.zeros((rows, width), dtype=torch.int64, device=device)
    idx = torch.randperm(rows * 2, device=device)[:rows]

    def timed(fn: Callable[[], object]) -> float:
        best = float("inf")
        for _ in range(REPEATS):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - t0)
        return best

    nbytes = rows * width * 8
    gather = timed(lambda: torch.index_select(cache, 0, idx, out=buf))
    scatter = timed(lambda: cache.index_copy_(0, idx, buf))
    return nbytes / max(gather, 1e-9), nbytes / max(scatter, 1e-9)


def probe_writes(call: BackendCall, make_probe: Callable[[], Backend],
                 device: torch.device, mem_kind: str, deadline_s: float = PROBE_DEADLINE_S) -> list[tuple[int, int, float]]:
    """(ranges, bytes, seconds) of the probe writes from this rank's backend (`call` runs a
    function on its owning thread) into a private endpoint `make_probe()` in this process.
    Raises on any refusal or when the probes pass `deadline_s`."""
    src = torch.zeros(PROBE_BYTES, dtype=torch.uint8, device=device)
    dst = torch.zeros(PROBE_BYTES, dtype=torch.uint8, device=device)
    dev = (device.index or 0) if device.type == "cuda" else 0
    probe = make_probe()
    reg_src = None
    try:
        probe.register(   # deregistered by probe.close()
            [MemRegion(addr=dst.data_ptr(), length=PROBE_BYTES, device=dev, kind=mem_kind)])
        reg_src = call(lambda b: b.register([MemRegion(addr=src.data_ptr(), length=PROBE_BYTES, device=dev, kind=mem_kind)]))
        peer = call(lambda b: b.connect(probe.identity()))
        end = time.monotonic() + deadline_s
        shapes = [(1, PROBE_RANGE_BYTES), (PROBE_RANGES, PROBE_RANGE_BYTES), (1, PROBE_BYTES)]
        out = []
        for ranges, length in shapes:
            off = np.arange(ranges, dtype=np.uint64) * np.uint64(max(length, 2 * PROBE_RANGE_BYTES))
            descs_src = np.stack([off + np.uint64(src.data_ptr()), np.full(ranges, length, np.uint64),
                                  np.full(ranges, dev, np.uint64)], axis=1)
            descs_dst = np.stack([off + np.uint64(dst.data_ptr()), np.full(ranges, length, np.uint64),
                                  np.full(ranges, dev, np.uint64)], axis=1)
            best = float("inf")
            for _ in range(REPEATS):
                best = min(best, _one_write(call, probe, peer, descs_src, descs_dst, mem_kind, end))
            out.append((ranges, ranges * length, best))
        call(lambda b: b.disconnect(peer))
        return out
    finally:
        if reg_src is not None:
            call(lambda b: b.deregister(reg_src))
        probe.close()


def _one_write(call: BackendCall, probe: Backend, peer: str, src: np.ndarray,
               dst: np.ndarray, mem_kind: str, end: float) -> float:
    def run(b: Backend) -> float:
        t0 = time.perf_counter()
        h = b.post_write(peer, src, dst, b"kvstage-probe", dst_kind=mem_kind)
        try:
            while True:   # bounded by `end`: a start-up probe, not a serving thread
                state = b.poll_write(h)
                probe.progress()
                if state is WriteState.DONE:
                    return time.perf_counter() - t0
                if state is WriteState.FAILED:
                    raise RuntimeError(f"probe write failed: {h.reason}")
                if time.monotonic() > end:
                    raise TimeoutError("probe writes took longer than their deadline")
        finally:
            b.release_write(h)
    seconds = call(run)
    probe.drain_tags()
    return seconds


def calibrate(*, backend_kind: str, call: BackendCall,
              make_probe: Callable[[], Backend], device: torch.device, mem_kind: str, row_bytes: int,
              writes: bool) -> Calibration:
    """Measure; on any failure, one warning and no costs (the fixed rule decides)."""
    t0 = time.perf_counter()
    try:
        gather_bps, scatter_bps = copy_rates(device, row_bytes)
        cost: WriteCost | None = None
        if writes:
            cost = fit_write_cost(backend_kind, mem_kind, probe_writes(call, make_probe, device, mem_kind))
        writer = WriterCosts(writes=[cost], gather_bytes_per_s=gather_bps) if cost is not None else None
        return Calibration(writer=writer, scatter_bytes_per_s=scatter_bps, seconds=time.perf_counter() - t0)
    except Exception as exc:  # noqa: BLE001 - a failed calibration falls back, never fails the start
        log.warning("kvstage: measuring the path costs failed (%s: %s); the path is chosen by the fixed rule "
                    "(staged iff TP sizes differ)", type(exc).__name__, exc)
        return Calibration(writer=None, scatter_bytes_per_s=None, seconds=time.perf_counter() - t0)
