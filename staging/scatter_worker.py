"""Decode scatter thread: copies landed ring pieces into the paged KV cache, off the
control thread, and reports each one back so its ring region can be freed.

A piece of at most `inline_max_bytes` is scattered by the thread that read its tag instead
(`run_here`, the control thread): copying it costs less than handing it to the scatter thread
and waking the control thread again with its outcome (docs/trace.md counts those hops). Both
run the same work and report the same way."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..hop_trace import TRACE, Hop
from .copy_streams import use_own_stream
from .digests import digest
from .gather_scatter import ScattersKV
from .job_threads import JobThreads
from .kernels import scatterer_class
from .plan_cache import PlanCache
from .pool_copies import LandedBlock, PoolBytes, scatter_pools
from .thread_meter import ThreadMeter
from .workers import LayerSlices, time_split

if TYPE_CHECKING:  # staging stays importable without the transfer package
    from ..transfer.state_pools import StatePool

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LandedPart:
    """One writer's part of a landed piece: where it lies in the ring and the heads it fills."""

    view: torch.Tensor               # uint8 view of the ring
    dst_heads: tuple[int, int]


@dataclass(frozen=True, kw_only=True)
class PartDigest:
    """Verify: one writer's part of a landed piece and the digest its tag carries."""

    view: torch.Tensor               # uint8 view of the ring
    digest: int
    writer: int


@dataclass(frozen=True, kw_only=True)
class ScatterJob:
    room: int
    key: tuple[int, int]
    pages: np.ndarray                                # destination cache pages of the piece
    layers: range                                    # the layers the piece holds
    parts: tuple[LandedPart, ...]
    pools: tuple[LandedBlock, ...] = ()              # the last piece: its pool blocks
    checks: tuple[PartDigest, ...] = ()              # when verifying

    @property
    def nbytes(self) -> int:
        """The bytes the job copies into the cache."""
        return sum(p.view.numel() for p in self.parts) + sum(b.view.numel() for b in self.pools)


# report(room, key, ok, reason, seconds, failure kind)
Report = Callable[..., None]


class ScatterWorker:
    """One thread on one job queue (job_threads.py)."""

    def __init__(self, k: Sequence[torch.Tensor], v: Sequence[torch.Tensor] | None, page_size: int,
                 report: Report, pools: Mapping[str, StatePool] | None = None, inline_max_bytes: int = 0,
                 own_streams: bool = True) -> None:
        """`inline_max_bytes`: the largest job `run_here` takes (0: every job goes to the thread).
        `own_streams`: on a GPU, the scatter thread and the control thread scatter on streams of
        their own (copy_streams.py)."""
        self._own_streams = own_streams
        self._k, self._v, self._page_size = tuple(k), (tuple(v) if v is not None else None), page_size
        self.inline_max_bytes = inline_max_bytes
        self._here: Callable[[ScatterJob], Callable[[], None]] | None = None   # run_here's work, made on first use
        self._pools = PoolBytes(pools or {})  # tensors viewed as bytes once, not per request
        self._report = report
        # chosen here, not in the thread: a bad KVSTAGE_STAGING_KERNELS fails the caller
        self._scatterer_class = scatterer_class(self._k[0].device)
        # the page lists of each room, validated and indexed once (plan_cache.py); thread-safe: the
        # scatter thread and run_here (the control thread) share it
        self.plans = PlanCache()
        self._thread: JobThreads[ScatterJob] = JobThreads([("kvstage-scatter", "scatter")], self._worker, "scatter")
        self.meter = self._thread.meters[0]

    def submit(self, job: ScatterJob) -> None:
        self._thread.submit(job)

    def takes_here(self, job: ScatterJob) -> bool:
        """Whether `job` is small enough for `run_here`."""
        return job.nbytes <= self.inline_max_bytes

    def run_here(self, job: ScatterJob) -> None:
        """Scatter `job` on the calling thread, then report it as the scatter thread would. Always
        called from one thread (the control thread): its scatterer, made on the first call, is
        that thread's own. The report is an event the control thread takes in a later round,
        when nothing of the job (its ring views) is held any more."""
        if self._here is None:
            self._here = self._worker(-1, self.meter)
        self._here(job)()

    def stop(self, timeout: float = 10.0) -> None:
        self._thread.stop(timeout)

    def forget_room(self, room: int) -> None:
        """A released room: drop the page lists kept for it (any thread)."""
        self.plans.forget(room)

    def _worker(self, index: int, meter: ThreadMeter) -> Callable[[ScatterJob], Callable[[], None]]:
        from ..transfer.protocol.kinds import FailureKind  # lazy: keeps staging importable on its own

        device = self._k[0].device
        use_own_stream(device, self._own_streams)   # on the thread that scatters (-1: the control thread)
        scatterer = self._scatterer_class(self.plans, caches_fixed=True)  # Triton kernels on CUDA, torch otherwise (staging/kernels.py)
        layers = LayerSlices(self._k, self._v)

        def work(job: ScatterJob) -> Callable[[], None]:
            room, key, report = job.room, job.key, self._report
            t0 = time.perf_counter()
            if TRACE.on:
                TRACE.hop(Hop.SCATTER_START, room, f"chunk {key[0]} piece {key[1]}, {len(job.pages)} pages")
            ok: bool
            reason: str | None
            bad = next((f"writer {c.writer}: the landed bytes' digest {got:#018x} is not the sent {c.digest:#018x}"
                        for c in job.checks if (got := digest(c.view)) != c.digest), None)
            if bad is not None:  # never scattered: the cache keeps what it had
                ok, reason, kind = False, f"corrupt data in chunk {key[0]} piece {key[1]}: {bad}", FailureKind.CORRUPT
            else:
                (ok, reason, queued), kind = self._scatter(scatterer, layers, job, device), FailureKind.SCATTER
            seconds = time.perf_counter() - t0
            if TRACE.on:
                TRACE.hop(Hop.SCATTER_END, room, f"ok: {time_split(t0, queued or t0 + seconds, seconds)}" if ok
                          else f"failed: {reason}")
            # reported once the loop dropped the job and with it the ring views
            return lambda: report(room, key, ok, reason, seconds, kind)

        return work

    def _scatter(self, scatterer: ScattersKV, layers: LayerSlices, job: ScatterJob,
                 device: torch.device) -> tuple[bool, str | None, float | None]:
        """(ok, why not, when its copies were all queued: perf_counter, None when it failed)."""
        try:
            k, v = layers.of(job.layers)
            # a host page list: validated, indexed and uploaded once per room and list (PlanCache),
            # not once per writer's part
            for part in job.parts:
                scatterer.scatter(part.view, k, v, job.pages, self._page_size, part.dst_heads, room=job.room)
            scatter_pools(self._pools, job.pools)
            queued = time.perf_counter()
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()
            return True, None, queued
        except Exception as exc:  # noqa: BLE001 - fails the room, not the thread
            log.exception("scatter for room %s failed", job.room)
            return False, str(exc), None
