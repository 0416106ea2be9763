"""The staging threads: the copies between a rank's KV cache and a staging ring, off the control
thread, in both directions. A prefill rank's transfer workers gather a piece and write it
(`TransferWorkers`); a decode rank's scatter thread copies a landed piece into its cache
(`ScatterWorker`). Both run the one worker loop of job_threads.py, copy through the kernels of
kernels.py and gather_scatter.py with the page lists of plan_cache.py, slice the cache by layer
the same way (`LayerSlices`), and run a small job on the calling thread instead (`run_here`).

## Prefill: transfer workers

Each worker owns ONE staging buffer, gathers a piece into a free part of
it and posts ONE backend write from there, and never gathers into a part a write still reads
(buffer_space.py: the part is free again when its write completed).

So a worker keeps several pieces in flight, as many as its buffer holds, and gathers the next
while the earlier ones are on the wire; two or more workers gather in parallel. A small piece
whose layers are written (`takes_here`) is gathered and posted by the control thread that hands
it out instead (`run_here`, into a free part of any worker's buffer): the hand-off to a worker
and the write's hand-off back cost more than the copy (docs/trace.md). A write's
completion is reported where the backend completes it, on the backend's owner thread (the
control thread): the worker is not woken for it. Watermark waits happen before a job gets here
(the control thread only hands out pieces whose ring region is free), so a worker never blocks on
the decode side; it blocks only while its buffer has no part free.

A relayout (decode context parallel, token_mapping.Relayout) is a job like the others: its
`pages` are pool slots (`page_tokens` 1) and its write lands as the decode rank's runs of slots
(`dst_rows`) instead of one part of a ring.

## Decode: the scatter thread

The decode scatter thread copies landed ring pieces into the paged KV cache, off the
control thread, and reports each one back so its ring region can be freed.

A piece of at most `inline_max_bytes` is scattered by the thread that read its tag instead
(`run_here`, the control thread): copying it costs less than handing it to the scatter thread
and waking the control thread again with its outcome (docs/trace.md counts those hops). Both
run the same work and report the same way (the scatter thread and `run_here`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

import numpy as np
import torch

from ..hop_trace import TRACE, Hop
from .buffer_space import BufferSpace
from .buffers import StagingBuffer
from .copy_plan import Direction
from .copy_streams import use_own_stream
from .digests import digest
from .gather_scatter import GathersKV, ScattersKV
from .job_threads import JobThreads
from .kernels import gatherer_class, scatterer_class
from .plan_cache import PlanCache, needs_upload
from .pool_copies import LandedBlock, PoolBytes, gather_pools, scatter_pools
from .thread_meter import ThreadMeter

if TYPE_CHECKING:  # staging stays importable without the protocol package
    from ..transfer.protocol.pool_parts import PoolCopy
    from ..transfer.state_pools import StatePool

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class GatherJob:
    op_id: int
    room: int
    peer: str                 # backend name of the decode rank
    pages: np.ndarray         # this rank's cache pages of the piece, in request order
    layers: range             # the layers to gather, as indices of this rank's tensors (a PP stage's
                              # own: its first layer is 0); region blocks: K of each, then V
    heads: tuple[int, int]    # local head range to send
    nbytes: int
    dst_addr: int             # absolute address of this writer's part in the decode ring
    dst_device: int
    tag: bytes
    dst_kind: str | None = None   # the ring's memory kind as the decode rank advertised it
    pools: tuple[PoolCopy, ...] = ()   # state pool copies appended after the KV bytes (the last piece)
    on_posted: Callable[[], object] | None = None   # runs on the backend's owner as it takes the write
    seal: Callable[[int], bytes] | None = None   # verify: the tag carrying the gathered bytes' digest
    ready: tuple[object, ...] = ()   # the caller's readiness objects: synchronize()d before the gather
    page_tokens: int | None = None   # tokens an entry of `pages` holds: None, the cache's page size; 1 when
                                     # `pages` are pool slots (a relayout, token_mapping.Relayout)
    dst_rows: np.ndarray | None = None   # N x 3 (address, length, device): where the gathered bytes land, in
                                         # order (a relayout); None: one contiguous part at `dst_addr`


# submit(peer, src, dst, tag, on_done, dst_kind=kind) posts one write on the backend's thread
SubmitWrite = Callable[..., None]
# report(op_id, room, ok, reason, gather_seconds, tag): tag is the signed tag the write carried
# (b"" when the gather failed and nothing was written). Called on the worker's thread when the
# gather failed, else on the backend's owner thread as the write completes.
Report = Callable[[int, int, bool, str | None, float, bytes], None]


class Synchronizes(Protocol):
    """A readiness object: a CUDA event or stream, or anything else with `synchronize()`."""

    def synchronize(self) -> object: ...


def wait_ready(ready: Sequence[object]) -> None:
    """Block until the caller's layers are written (a CUDA event, or anything with
    synchronize()): the worker waits, never the caller's thread."""
    for r in ready:
        cast(Synchronizes, r).synchronize()   # send() checked that each has synchronize()


class _PieceWork(Protocol):
    """One piece's gather, into the buffer part `at` (None: a part taken on the way); returns
    its report, to call once nothing of the piece is held (`TransferWorkers._piece_work`)."""

    def __call__(self, job: GatherJob, at: int | None = None) -> Callable[[], None]: ...


class LayerSlices:
    """The (k, v) tuples of a layer range, sliced once per range: the same tuple objects on every
    call let the gatherer/scatterer recognise its validated cache without re-keying it."""

    def __init__(self, k: tuple[torch.Tensor, ...], v: tuple[torch.Tensor, ...] | None) -> None:
        self._k, self._v = k, v
        self._slices: dict[tuple[int, int], tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...] | None]] = {}

    def of(self, layers: range) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...] | None]:
        key = (layers.start, layers.stop)
        kv = self._slices.get(key)
        if kv is None:
            lo, hi = key
            kv = self._k[lo:hi], (self._v[lo:hi] if self._v is not None else None)
            if len(self._slices) >= 256:   # bounded: a rank has few layer ranges
                self._slices.clear()
            self._slices[key] = kv
        return kv


class TransferWorkers:
    """One thread per staging buffer, all on one job queue (job_threads.py)."""

    def __init__(self, buffers: Sequence[StagingBuffer], k: Sequence[torch.Tensor], v: Sequence[torch.Tensor] | None,
                 page_size: int, submit: SubmitWrite, report: Report, pools: Mapping[str, StatePool] | None = None,
                 inline_max_bytes: int = 0, own_streams: bool = True, write_range_bytes: int | None = None):
        """`inline_max_bytes`: the largest piece `run_here` takes (0: every piece to a worker).
        `own_streams`: on a GPU, each thread that gathers does so on a stream of its own
        (copy_streams.py). `write_range_bytes`: the largest range of a piece's write (0: one
        range; None: WRITE_RANGE_BYTES of the buffers' memory kind)."""
        self._range = write_range([b.kind for b in buffers], write_range_bytes)
        self._buffers = list(buffers)
        self._own_streams = own_streams
        self.spaces = [BufferSpace(b.nbytes) for b in self._buffers]   # the parts of each buffer in flight
        self.inline_max_bytes = inline_max_bytes
        self._here: list[_PieceWork] = []   # run_here's, made on first use
        self._pools = PoolBytes(pools or {})  # tensors viewed as bytes once, not per request
        self._k, self._v, self._page_size = tuple(k), (tuple(v) if v is not None else None), page_size
        self._submit, self._report = submit, report
        # chosen here, not in the threads: a bad KVSTAGE_STAGING_KERNELS fails the caller
        self._gatherer_class = gatherer_class(self._k[0].device)
        # the page lists of each room, validated and indexed once for every worker (plan_cache.py)
        self.plans = PlanCache()
        self._threads: JobThreads[GatherJob] = JobThreads(
            [(f"kvstage-xfer-{i}", f"xfer-{i}") for i in range(len(self._buffers))], self._worker, "xfer")
        self.meters = self._threads.meters

    @property
    def count(self) -> int:
        return self._threads.count

    def submit(self, job: GatherJob) -> None:
        self._threads.submit(job)

    def takes_here(self, job: GatherJob) -> bool:
        """Whether `job` is small enough for `run_here` and needs no wait for its layers."""
        return job.nbytes <= self.inline_max_bytes and not job.ready

    def run_here(self, job: GatherJob) -> bool:
        """Gather `job` into a free part of a worker's buffer and post it, on the calling thread
        (always the control thread: its gatherer, made on the first call, is that thread's own);
        False, with nothing done, when no buffer has a part free for it now."""
        for i, space in enumerate(self.spaces):
            at = space.try_take(job.nbytes)
            if at is not None:
                if not self._here:
                    use_own_stream(self._k[0].device, self._own_streams)   # the control thread's, once
                    gatherer = self._gatherer_class(self.plans, caches_fixed=True)
                    self._here = [self._piece_work(b, gatherer) for b in range(len(self._buffers))]
                self._here[i](job, at)()   # a failed gather reports here; a posted one on completion
                return True
        return False

    def stop(self, timeout: float = 10.0) -> None:
        for space in self.spaces:   # a worker waiting for a part gives up: no write completes any more
            space.close()
        self._threads.stop(timeout)

    def forget_room(self, room: int) -> None:
        """A released room: drop the page lists kept for it (any thread)."""
        self.plans.forget(room)

    def _worker(self, index: int, meter: ThreadMeter) -> Callable[[GatherJob], Callable[[], None]]:
        """Thread `index`: its buffer, its gatherer (Triton kernels on CUDA, torch otherwise,
        staging/kernels.py), and how it does one job. Runs on that thread, which takes its own
        stream here (copy_streams.py)."""
        use_own_stream(self._k[0].device, self._own_streams)
        return self._piece_work(index, self._gatherer_class(self.plans, caches_fixed=True))

    def _piece_work(self, index: int, gatherer: GathersKV) -> _PieceWork:
        """How one piece is done with buffer `index` and `gatherer` (one thread's own): into the
        part `at` when the caller took it, else into a part taken here (waiting for one)."""
        buf, space, device = self._buffers[index], self.spaces[index], self._k[0].device
        layers = LayerSlices(self._k, self._v)

        def work(job: GatherJob, at: int | None = None) -> Callable[[], None]:
            op_id, room, report = job.op_id, job.room, self._report
            t0 = time.perf_counter()
            if TRACE.on:
                TRACE.hop(Hop.GATHER_START, room, f"{len(job.pages)} pages, {job.nbytes} bytes")
            try:
                wait_ready(job.ready)
                k, v = layers.of(job.layers)
                if at is None:
                    at = space.take(job.nbytes)   # waits while the writes in flight fill the buffer
                part = buf.tensor[at: at + job.nbytes]
                # a host page list: validated, indexed and uploaded once per room and list (PlanCache)
                n = gatherer.gather(k, v, job.pages, job.page_tokens or self._page_size, job.heads, part, room=room)
                if job.pools:
                    n += gather_pools(self._pools, job.pools, part, n)
                t_queued = time.perf_counter()
                if device.type == "cuda":
                    torch.cuda.current_stream(device).synchronize()
                if n != job.nbytes:
                    raise ValueError(f"gathered {n} bytes, the piece has {job.nbytes}")
                tag = job.tag if job.seal is None else job.seal(digest(part[:n]))
            except Exception as exc:  # noqa: BLE001 - a bad piece fails its room, not the worker
                if at is not None:
                    space.give(at)
                log.exception("gather for room %s failed", room)
                failure, gather_s = f"gather failed: {exc}", time.perf_counter() - t0
                return lambda: report(op_id, room, False, failure, gather_s, b"")
            gather_s = time.perf_counter() - t0
            if TRACE.on:   # the host's part (plan, checks, launch) and the wait for the device
                TRACE.hop(Hop.GATHER_END, room, time_split(t0, t_queued, gather_s))
            taken = at

            def on_done(ok: bool, reason: str | None) -> None:   # on the backend's owner thread
                space.give(taken)   # the backend has let go of the part
                report(op_id, room, ok, reason, gather_s, tag)

            if job.dst_rows is None:
                src, dst = write_rows(buf.addr + at, buf.device, job.dst_addr, job.dst_device, job.nbytes, self._range)
            else:
                src, dst = spread_rows(buf.addr + at, buf.device, job.dst_rows), job.dst_rows
            try:
                self._submit(job.peer, src, dst, tag, on_done, job.on_posted, dst_kind=job.dst_kind, room=room)
            except Exception as exc:  # noqa: BLE001 - not posted (the engine is stopping): its room fails
                space.give(taken)
                why = f"its write was not posted: {exc}"
                return lambda: report(op_id, room, False, why, gather_s, b"")
            return _reported_on_completion

        return work


#: the largest range of one staged write, by the staging buffer's memory kind: a piece's write is
#: cut into ranges of at most this many bytes, posted as one write (one tag); 0: one range. Why
#: these values, measured: docs/staging_kernels.md, "Staged writes in ranges".
WRITE_RANGE_BYTES = {"VRAM": 16 << 20, "DRAM": 0}


def write_range(kinds: Sequence[str], option: int | None) -> int:
    """The largest range of a staged write from buffers of memory `kinds`: `option` when given
    (0: one range), else WRITE_RANGE_BYTES of the kinds (the largest)."""
    if option is not None:
        if option < 0:
            raise ValueError(f"write_range_bytes must be >= 0, got {option}")
        return option
    return max((WRITE_RANGE_BYTES[k] for k in kinds), default=0)


def write_rows(src_addr: int, src_device: int, dst_addr: int, dst_device: int, nbytes: int,
               most: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The (src, dst) descriptor rows of one staged write of `nbytes` contiguous bytes: ranges of
    `most` bytes (the last one shorter; 0: one range), in order, the same offsets on both sides."""
    if nbytes <= 0 or most < 0:
        raise ValueError(f"a write moves a positive number of bytes in ranges of a size >= 0, got {nbytes}, {most}")
    most = most or nbytes
    offsets = np.arange(0, nbytes, most, dtype=np.uint64)
    sizes = np.minimum(np.uint64(most), np.uint64(nbytes) - offsets)
    src = np.stack([np.uint64(src_addr) + offsets, sizes, np.full_like(offsets, src_device)], axis=1)
    dst = np.stack([np.uint64(dst_addr) + offsets, sizes, np.full_like(offsets, dst_device)], axis=1)
    return src, dst


def spread_rows(src_addr: int, src_device: int, dst_rows: np.ndarray) -> np.ndarray:
    """The source rows of a write from `src_addr` on whose bytes land as `dst_rows` (N x 3:
    address, length, device), in order: the same lengths, back to back."""
    lengths = dst_rows[:, 1]
    src = np.empty_like(dst_rows)
    src[:, 0] = np.uint64(src_addr) + np.cumsum(lengths) - lengths
    src[:, 1] = lengths
    src[:, 2] = src_device
    return src


def _reported_on_completion() -> None:
    """A posted piece's report: none here, its write's completion reports it (`on_done`)."""


def _nothing_to_report() -> None:
    """A prepared page list's report: none (nothing waits for it)."""


def time_split(t0: float, queued: float, seconds: float) -> str:
    """A gather's or scatter's time as the hop trace shows it: until its copies were queued (the
    host's work: the plan, its checks, the launch), then the wait for the device to finish them
    (on CPU, where the copies run as they are queued, the second part is about 0)."""
    return f"host {(queued - t0) * 1e3:.3f} ms, device wait {(t0 + seconds - queued) * 1e3:.3f} ms"


# -- decode: the scatter thread ----------------------------------------------------------------
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


@dataclass(frozen=True)
class PreparePages:
    """A room's destination pages, to be validated and indexed (uploaded) before its first piece
    lands (ScatterWorker.prepare)."""

    room: int
    pages: np.ndarray


# report(room, key, ok, reason, seconds, failure kind)
ScatterReport = Callable[..., None]


class ScatterWorker:
    """One thread on one job queue (job_threads.py)."""

    def __init__(self, k: Sequence[torch.Tensor], v: Sequence[torch.Tensor] | None, page_size: int,
                 report: ScatterReport, pools: Mapping[str, StatePool] | None = None, inline_max_bytes: int = 0,
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
        self._thread: JobThreads[ScatterJob | PreparePages] = JobThreads([("kvstage-scatter", "scatter")], self._worker,
                                                                        "scatter")
        self.meter = self._thread.meters[0]

    def submit(self, job: ScatterJob) -> None:
        self._thread.submit(job)

    def prepare(self, room: int, pages: np.ndarray) -> None:
        """A staged room's destination pages are known. Where they would be uploaded (a cache on
        a GPU, a list of more than one run: plan_cache.needs_upload) the scatter thread validates
        and uploads them into the room's kept lists when it is next free, before the room's first
        piece, which is queued after it, so the first scatter finds them kept; elsewhere nothing
        is done (there is nothing to take off the request's path that would pay for the thread's
        wake-up). A list that does not validate is left for that scatter to refuse, as before."""
        if needs_upload(self._k[0].device, pages):
            self._thread.submit(PreparePages(room, pages))

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

    def _worker(self, index: int, meter: ThreadMeter) -> Callable[[ScatterJob | PreparePages], Callable[[], None]]:
        from ..transfer.protocol.kinds import FailureKind  # lazy: keeps staging importable on its own

        device = self._k[0].device
        use_own_stream(device, self._own_streams)   # on the thread that scatters (-1: the control thread)
        scatterer = self._scatterer_class(self.plans, caches_fixed=True)  # Triton kernels on CUDA, torch otherwise (staging/kernels.py)
        layers = LayerSlices(self._k, self._v)
        every_layer = range(len(self._k))

        def work(job: ScatterJob | PreparePages) -> Callable[[], None]:
            if isinstance(job, PreparePages):
                try:
                    k, v = layers.of(every_layer)
                    scatterer.prepare(Direction.SCATTER, k, v, job.pages, self._page_size, room=job.room)
                except Exception:  # noqa: BLE001 - a hint only: the room's scatters do it again and fail it
                    log.exception("preparing the pages of room %s failed", job.room)
                return _nothing_to_report
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
