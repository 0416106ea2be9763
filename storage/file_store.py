"""`DirectFileStore`: pages on a local filesystem, one O_DIRECT file per batch, one pass per run.

A batch of pages is gathered into a page-aligned staging buffer (kvstage's `HostMemory`), digested
there (xxh3-64 per page), followed by its footer, and written into ONE new batch file
(storage/batch_file.py has the format) by large O_DIRECT writes of `segment_bytes` (32 MiB) each,
issued by the store's I/O thread as soon as a segment is gathered: the disk writes segment k while
the caller's thread gathers and digests segment k+1, so the batch costs about its disk time, not
disk time plus copy plus digest. A read asks the index where each page is and reads each run of
pages of one file into the read staging buffer the same way, segment by segment ahead of the
caller's thread, which checks every page's digest and only then hands its bytes to the caller: a
page whose bytes do not match is a miss, never data.

Contract
--------
- Keys are (kind, key): `kind` names the namespace of state within the store (SGLang's pool
  name: "kv", "mamba", "indexer"...), `key` SGLang's page hash. The store itself belongs to one
  `namespace` (model, rank, layout, dtype...): its files live in a directory named by the
  namespace's digest and carry the namespace in their footer; a file of another namespace is
  never read (a miss).
- Eviction is by batch file, least recently used first: the pages and the states written in one
  batch (a request's KV and its Mamba state, say) are evicted together.
- `put` never raises for a store that is full, gone or read-only: those pages are reported not
  stored (False) and `stats()` says why; `get` reports a miss for anything it cannot read whole
  and verified. Misuse (a page larger than the staging buffer, sizes and keys of different
  lengths) raises ValueError.
- Thread safety: one lock for the index, one per staging buffer; SGLang calls from its prefetch
  and backup threads at once. The I/O thread (one per store) only runs the writes and reads that
  a call holding its staging buffer's lock queued, and that call waits for every one of them
  before it returns or lets go of the buffer.
- A written file is not fsynced: this is a cache; a file whose footer is not readable after a
  crash is ignored at the next open, and a page whose bytes are wrong fails its digest.
"""

from __future__ import annotations

import errno
import hashlib
import itertools
import logging
import os
import shutil
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Protocol

import torch
import xxhash

from ..staging.host_memory import HostMemory
from .batch_file import (
    ALIGN,
    TRAILER_BYTES,
    Entry,
    FormatError,
    decode_footer,
    encode_tail,
    plan_batch,
    plan_reads,
    round_up,
)

__all__ = ["DirectFileStore", "DirectMode", "PageKey", "PageStore", "StoreError", "StoreStats"]

log = logging.getLogger(__name__)

SUFFIX = ".kvb"
_O_DIRECT = getattr(os, "O_DIRECT", 0)
SEGMENT_BYTES = 32 << 20    # one O_DIRECT write or read of a batch: large, and small enough to pipeline


class StoreError(RuntimeError):
    """The store cannot be opened at all (its directory cannot be made or read)."""


class DirectMode(Enum):
    ON = "on"       # O_DIRECT or an error
    AUTO = "auto"   # O_DIRECT where the filesystem honours it, else buffered I/O (logged once)
    OFF = "off"     # buffered I/O


@dataclass(frozen=True)
class PageKey:
    kind: str
    key: str


@dataclass
class _Batch:
    path: Path
    size: int
    entries: dict[PageKey, Entry]
    last_use: int


@dataclass
class StoreStats:
    """Counters since open; `last_error` says why the last page was not stored or not read."""

    pages_written: int = 0
    pages_skipped_present: int = 0
    pages_not_stored: int = 0
    writes: int = 0
    bytes_written: int = 0
    pages_read: int = 0
    pages_missed: int = 0
    pages_corrupt: int = 0
    reads: int = 0
    bytes_read: int = 0
    batches_evicted: int = 0
    last_error: str = ""
    direct: bool = True
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "extra"}
        d.update(self.extra)
        return d


class PageStore(Protocol):
    """What a store offers the SGLang backend (DirectFileStore, MooncakePageStore)."""

    namespace: str
    stats: StoreStats
    staging_bytes: int

    def present(self, pks: Sequence[PageKey]) -> list[bool]: ...

    def contains(self, pk: PageKey) -> bool: ...

    def put(self, pks: Sequence[PageKey], sizes: Sequence[int],
            fill: Callable[[int, torch.Tensor], None]) -> list[bool]: ...

    def get(self, pks: Sequence[PageKey], sizes: Sequence[int],
            drain: Callable[[int, torch.Tensor], None]) -> list[bool]: ...

    def clear(self) -> None: ...

    def close(self) -> None: ...


def _namespace_dir(namespace: str) -> str:
    return hashlib.sha256(namespace.encode()).hexdigest()[:20]


class DirectFileStore:
    """See the module docstring. `capacity_bytes`: the most the batch files may take on disk
    (None: what is there now plus 90% of the filesystem's free space). `staging_bytes`: each of
    the two staging buffers (write, read); a batch larger than it is written as several files.
    `segment_bytes`: the size of each write and read (an `ALIGN` multiple, rounded up to whole
    pages: a page is never split between two)."""

    def __init__(self, *, root: str | os.PathLike, namespace: str, staging_bytes: int,
                 capacity_bytes: int | None = None, direct: DirectMode = DirectMode.AUTO,
                 segment_bytes: int = SEGMENT_BYTES) -> None:
        if staging_bytes < 2 * ALIGN:
            raise ValueError(f"staging_bytes must be at least {2 * ALIGN}, got {staging_bytes}")
        if segment_bytes < ALIGN or segment_bytes % ALIGN:
            raise ValueError(f"segment_bytes must be a positive multiple of {ALIGN}, got {segment_bytes}")
        self.segment_bytes = segment_bytes
        self.namespace = namespace
        self.dir = Path(root) / _namespace_dir(namespace)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            if not self.dir.is_dir():
                raise StoreError(f"storage directory {self.dir} cannot be made: {exc.strerror or exc}") from None
        if not os.access(self.dir, os.R_OK | os.X_OK):
            raise StoreError(f"storage directory {self.dir} is not readable")
        self.read_only = not os.access(self.dir, os.W_OK)
        self.stats = StoreStats()
        self._direct_mode = direct
        self.stats.direct = direct is not DirectMode.OFF and bool(_O_DIRECT)
        if direct is DirectMode.ON and not _O_DIRECT:
            raise StoreError("O_DIRECT is not available on this platform")
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstage-storage-io")
        self._wbuf = HostMemory(round_up(staging_bytes))
        self._rbuf = HostMemory(round_up(staging_bytes))
        self.staging_bytes = self._wbuf.nbytes
        self._wlock = threading.Lock()
        self._rlock = threading.Lock()
        self._lock = threading.RLock()
        self._index: dict[PageKey, int] = {}
        self._batches: dict[int, _Batch] = {}
        self._clock = itertools.count(1)
        self._total = 0
        self._scan()
        if capacity_bytes is None:
            capacity_bytes = self._total + int(0.9 * shutil.disk_usage(self.dir).free)
        self.capacity_bytes = capacity_bytes
        if self.read_only:
            self.stats.last_error = f"{self.dir} is read-only: pages are served, none stored"
            log.warning("kvstage storage: %s", self.stats.last_error)

    # ---- open ----------------------------------------------------------------------------

    def _scan(self) -> None:
        for path in sorted(self.dir.iterdir()):
            if path.name.endswith(".tmp"):
                if not self.read_only:
                    path.unlink(missing_ok=True)
                continue
            if not path.name.endswith(SUFFIX):
                continue
            try:
                file_id = int(path.name[: -len(SUFFIX)], 16)
                footer, size = self._read_footer(path)
            except (ValueError, OSError) as exc:
                log.warning("kvstage storage: ignoring %s: %s", path, exc)
                continue
            if footer.namespace != self.namespace:
                log.warning("kvstage storage: %s belongs to namespace %r, not %r: ignored", path,
                            footer.namespace, self.namespace)
                continue
            self._add_batch(file_id, path, size, footer.entries)
        self._next_id = itertools.count(max(self._batches, default=0) + 1)

    @staticmethod
    def _read_footer(path: Path):
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < TRAILER_BYTES or size % ALIGN:
                raise FormatError(f"size {size} is not a batch file's")
            f.seek(size - TRAILER_BYTES)
            trailer = f.read(TRAILER_BYTES)
            body_len = int.from_bytes(trailer[8:16], "little")
            tail_len = min(size, round_up(body_len + TRAILER_BYTES))
            f.seek(size - tail_len)
            return decode_footer(f.read(tail_len), size), size

    def _add_batch(self, file_id: int, path: Path, size: int, entries: Sequence[Entry]) -> None:
        with self._lock:
            batch = _Batch(path, size, {}, next(self._clock))
            for e in entries:
                pk = PageKey(e.kind, e.key)
                if pk in self._index:      # an older copy: the newer file wins
                    self._drop_key(pk)
                batch.entries[pk] = e
                self._index[pk] = file_id
            self._batches[file_id] = batch
            self._total += size

    def _drop_key(self, pk: PageKey) -> None:
        file_id = self._index.pop(pk, None)
        if file_id is not None:
            self._batches[file_id].entries.pop(pk, None)

    def _drop_batch(self, file_id: int) -> None:
        batch = self._batches.pop(file_id, None)
        if batch is None:
            return
        for pk in batch.entries:
            if self._index.get(pk) == file_id:
                del self._index[pk]
        self._total -= batch.size

    # ---- queries -------------------------------------------------------------------------

    def contains(self, pk: PageKey) -> bool:
        with self._lock:
            return pk in self._index

    def present(self, pks: Sequence[PageKey]) -> list[bool]:
        with self._lock:
            return [pk in self._index for pk in pks]

    @property
    def used_bytes(self) -> int:
        return self._total

    def __len__(self) -> int:
        return len(self._index)

    # ---- writes --------------------------------------------------------------------------

    def put(self, pks: Sequence[PageKey], sizes: Sequence[int], fill: Callable[[int, torch.Tensor], None]) -> list[bool]:
        """Store pages `pks` (sizes in bytes); `fill(i, dst)` copies page i's bytes into `dst`
        (a uint8 tensor of exactly sizes[i] bytes in the staging buffer). Pages already stored
        are not written again (True). One write per batch file; see the module contract."""
        if len(pks) != len(sizes):
            raise ValueError(f"{len(pks)} keys and {len(sizes)} sizes")
        ok = [False] * len(pks)
        todo: list[int] = []
        queued: set[PageKey] = set()
        with self._lock:
            for i, pk in enumerate(pks):
                if pk in self._index:
                    ok[i] = True
                    self._batches[self._index[pk]].last_use = next(self._clock)
                    self.stats.pages_skipped_present += 1
                elif pk not in queued:
                    queued.add(pk)
                    todo.append(i)
                else:
                    ok[i] = None  # a duplicate within the call: resolved after the write
        if not todo:
            return [bool(x) if x is not None else True for x in ok]
        if self.read_only:
            self._not_stored(len(todo), f"{self.dir} is read-only")
            return self._resolve(pks, ok)
        for chunk in self._chunks(todo, sizes):
            self._write_batch(pks, sizes, chunk, fill, ok)
        return self._resolve(pks, ok)

    def _resolve(self, pks, ok) -> list[bool]:
        done = {pks[i] for i, x in enumerate(ok) if x}
        return [bool(x) if x is not None else pks[i] in done for i, x in enumerate(ok)]

    def _chunks(self, todo: list[int], sizes: Sequence[int]):
        room = self.staging_bytes - ALIGN * 16    # left for the footer: 64 KiB
        chunk: list[int] = []
        used = 0
        for i in todo:
            n = round_up(sizes[i])
            if n > room:
                raise ValueError(f"a page of {sizes[i]} bytes exceeds the {self.staging_bytes}-byte staging buffer")
            if chunk and used + n > room:
                yield chunk
                chunk, used = [], 0
            chunk.append(i)
            used += n
        if chunk:
            yield chunk

    def _not_stored(self, n: int, why: str) -> None:
        self.stats.pages_not_stored += n
        if why != self.stats.last_error:
            log.warning("kvstage storage: %d pages not stored: %s", n, why)
        self.stats.last_error = why

    def _write_batch(self, pks, sizes, chunk: list[int], fill, ok: list) -> None:
        layout = plan_batch([sizes[i] for i in chunk])
        # the footer's size is known before the digests are: each is at most 9 bytes of msgpack
        bound = layout.data_bytes + len(encode_tail(self.namespace, [
            Entry(kind=pks[i].kind, key=pks[i].key, offset=layout.offsets[j], nbytes=sizes[i], digest=(1 << 64) - 1)
            for j, i in enumerate(chunk)]))
        if bound > self.staging_bytes:
            raise ValueError(f"batch of {bound} bytes exceeds the {self.staging_bytes}-byte staging buffer")
        with self._wlock:
            if not self._make_room(bound):
                self._not_stored(len(chunk), f"store full: {bound} bytes do not fit {self.capacity_bytes} "
                                             f"(used {self._total})")
                return
            file_id = next(self._next_id)
            path = self.dir / f"{file_id:016x}{SUFFIX}"
            tmp = self.dir / f".{file_id:016x}.tmp"
            buf = self._wbuf.tensor
            view = memoryview(buf.numpy())
            entries: list[Entry] = []
            writes: list[Future] = []
            fd, total, done = -1, 0, False
            try:
                fd = self._open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
                start = 0                      # the first byte not yet handed to the I/O thread
                for j, i in enumerate(chunk):
                    off, n = layout.offsets[j], sizes[i]
                    dst = buf[off:off + n]
                    fill(i, dst)
                    entries.append(Entry(kind=pks[i].kind, key=pks[i].key, offset=off, nbytes=n,
                                         digest=xxhash.xxh3_64_intdigest(dst.numpy())))
                    end = off + round_up(n)
                    if end - start >= self.segment_bytes and j < len(chunk) - 1:
                        writes.append(self._io.submit(_pwrite_all, fd, view[start:end], start))
                        start = end
                tail = encode_tail(self.namespace, entries)
                total = layout.data_bytes + len(tail)
                buf[layout.data_bytes:total].copy_(torch.frombuffer(bytearray(tail), dtype=torch.uint8))
                writes.append(self._io.submit(_pwrite_all, fd, view[start:total], start))
                for w in writes:
                    w.result()
                os.close(fd)
                fd = -1
                os.replace(tmp, path)
                done = True
            except OSError as exc:
                if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                    self.read_only = True
                self._not_stored(len(chunk), f"write of {path} failed: {exc.strerror or exc}")
                return
            finally:
                for w in writes:           # every write ends before the buffer is used again
                    w.exception()
                if fd >= 0:
                    os.close(fd)
                if not done:
                    try:
                        tmp.unlink(missing_ok=True)
                    except OSError:    # the filesystem went read-only under us: nothing was created
                        pass
        self._add_batch(file_id, path, total, entries)
        self.stats.writes += 1
        self.stats.bytes_written += total
        self.stats.pages_written += len(chunk)
        for i in chunk:
            ok[i] = True

    def _open(self, path: Path, flags: int) -> int:
        if self.stats.direct:
            try:
                return os.open(path, flags | _O_DIRECT, 0o644)
            except OSError as exc:
                if exc.errno != errno.EINVAL or self._direct_mode is DirectMode.ON:
                    raise
                self.stats.direct = False
                log.warning("kvstage storage: %s does not honour O_DIRECT; buffered I/O from now on", self.dir)
        return os.open(path, flags, 0o644)

    def _make_room(self, nbytes: int) -> bool:
        """Evict least recently used batch files until `nbytes` more fit; False if they never can."""
        if nbytes > self.capacity_bytes:
            return False
        with self._lock:
            victims = sorted(self._batches, key=lambda f: self._batches[f].last_use)
            for file_id in victims:
                if self._total + nbytes <= self.capacity_bytes:
                    break
                path = self._batches[file_id].path
                self._drop_batch(file_id)
                self.stats.batches_evicted += 1
                try:
                    path.unlink()
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    log.warning("kvstage storage: eviction of %s failed: %s", path, exc)
            return self._total + nbytes <= self.capacity_bytes

    # ---- reads ---------------------------------------------------------------------------

    def get(self, pks: Sequence[PageKey], sizes: Sequence[int], drain: Callable[[int, torch.Tensor], None]) -> list[bool]:
        """Read pages `pks`; `drain(i, src)` gets page i's verified bytes (a uint8 tensor of
        sizes[i] bytes, valid during the call). A page that is absent, of another size, not
        readable or whose digest does not match is a miss (False)."""
        if len(pks) != len(sizes):
            raise ValueError(f"{len(pks)} keys and {len(sizes)} sizes")
        ok = [False] * len(pks)
        wanted = []
        with self._lock:
            for i, pk in enumerate(pks):
                file_id = self._index.get(pk)
                if file_id is None:
                    continue
                batch = self._batches[file_id]
                entry = batch.entries[pk]
                if entry.nbytes != sizes[i]:
                    continue
                batch.last_use = next(self._clock)
                wanted.append((i, file_id, entry))
            paths = {f: self._batches[f].path for _, f, _ in wanted}
        with self._rlock:
            buf = self._rbuf.tensor
            view = memoryview(buf.numpy())
            for run in plan_reads(wanted, self.staging_bytes):
                self._read_run(run, paths[run.file_id], buf, view, pks, drain, ok)
        n_ok = sum(ok)
        self.stats.pages_read += n_ok
        self.stats.pages_missed += len(ok) - n_ok
        return ok

    def _read_run(self, run, path: Path, buf: torch.Tensor, view: memoryview, pks, drain, ok: list) -> None:
        """Read one run into the read buffer, segment by segment on the I/O thread, while this
        thread checks and hands over the pages of the segments already in."""
        try:
            fd = self._open(path, os.O_RDONLY)
        except OSError as exc:
            return self._read_failed(run, path, exc)
        reads: list[Future] = []
        try:
            segments = list(_segments(run.items, run.length, self.segment_bytes))
            reads = [self._io.submit(_pread_all, fd, view[a:b], run.offset + a) for a, b, _ in segments]
            failed = False
            for (_, _, items), r in zip(segments, reads):
                exc = r.exception()
                if exc is not None or failed:
                    if not failed:
                        self._read_failed(run, path, exc)
                    failed = True
                    continue
                for item in items:
                    src = buf[item.at:item.at + item.nbytes]
                    if xxhash.xxh3_64_intdigest(src.numpy()) != item.digest:
                        self.stats.pages_corrupt += 1
                        self.stats.last_error = f"page {pks[item.index].key!r} failed its digest: dropped"
                        log.warning("kvstage storage: %s", self.stats.last_error)
                        with self._lock:
                            self._drop_key(pks[item.index])
                        continue
                    drain(item.index, src)
                    ok[item.index] = True
            if not failed:
                self.stats.reads += 1
                self.stats.bytes_read += run.length
        finally:
            for r in reads:            # every read ends before the buffer is used again
                r.exception()
            os.close(fd)

    def _read_failed(self, run, path: Path, exc: BaseException) -> None:
        self.stats.last_error = f"read of {path} failed: {getattr(exc, 'strerror', None) or exc}"
        log.warning("kvstage storage: %s", self.stats.last_error)
        if isinstance(exc, FileNotFoundError):
            with self._lock:
                self._drop_batch(run.file_id)

    # ---- life ----------------------------------------------------------------------------

    def clear(self) -> None:
        """Remove every batch file of this namespace."""
        with self._lock:
            for file_id in list(self._batches):
                path = self._batches[file_id].path
                self._drop_batch(file_id)
                path.unlink(missing_ok=True)

    def close(self) -> None:
        with self._wlock, self._rlock:         # a put or get in progress ends first
            self._io.shutdown(wait=True)
            self._wbuf.close()
            self._rbuf.close()


def _segments(items, length: int, segment: int):
    """The run's reads: (start, end, items wholly inside) in run order, each about `segment`
    bytes and cut only between two pages' slots (`ALIGN` multiples); together they cover the run."""
    start, inside = 0, []
    for k, item in enumerate(items):
        inside.append(item)
        end = item.at + round_up(item.nbytes)
        if end - start >= segment and k < len(items) - 1:
            yield start, end, inside
            start, inside = end, []
    yield start, length, inside


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        n = os.pwrite(fd, data[done:], offset + done)
        if n <= 0:
            raise OSError(errno.ENOSPC, "short write")
        done += n


def _pread_all(fd: int, out: memoryview, offset: int) -> None:
    done = 0
    while done < len(out):
        n = os.preadv(fd, [out[done:]], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, f"short read at {offset + done}")
        done += n
