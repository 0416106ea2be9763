"""`MooncakePageStore`: pages in Mooncake Store, Mooncake's distributed KV store, for a fleet of
servers sharing one L3 (its master and clients come with the Mooncake package).

Same contract as `DirectFileStore` (`PageStore`): put/get/present by `PageKey`, never raising for
a store that is unreachable or full (pages not stored, misses; `stats.last_error` says why), and
never handing back bytes that do not match their digest.

- Each object is a page followed by a 16-byte trailer (magic, format version, xxh3-64 of the
  page). `put`/`get` gather a batch into a staging buffer registered with Mooncake (`HostMemory`)
  and store it by ONE `batch_put_from`, read by ONE `batch_get_into`, each page checked against
  its trailer before it is handed on. `put_pieces`/`get_pieces` do the same with no copy at all,
  straight from and into registered memory given as (address, size) pieces per page (SGLang's
  host pool), by ONE `batch_put_from_multi_buffers` / `batch_get_into_multi_buffers`; the same
  objects, so either path reads what the other wrote.
- Object keys are ``kvstage/<namespace digest>/<kind>/<key>``: another namespace finds nothing.
- Eviction is Mooncake's, per object: unlike the file store, the pages of one batch are not
  evicted together (a request's KV and states may part; a missing state is a miss by SGLang's
  hit policies, never wrong bytes).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import struct
import threading
from collections.abc import Callable, Sequence

import numpy as np
import torch
import xxhash

from ..staging.host_memory import HostMemory
from .batch_file import round_up
from .file_store import PageKey, StoreError, StoreStats

__all__ = ["MooncakePageStore"]

log = logging.getLogger(__name__)

_TRAILER = struct.Struct("<4sIQ")   # magic, version, xxh3-64
MAGIC = b"KVSM"
VERSION = 1
_TRAILER_DTYPE = np.dtype([("magic", "S4"), ("version", "<u4"), ("digest", "<u8")])
assert _TRAILER_DTYPE.itemsize == _TRAILER.size


def _digest(pieces: Sequence[tuple[int, int]]) -> int:
    """xxh3-64 of a page's pieces, read in place."""
    h = xxhash.xxh3_64()
    for addr, n in pieces:
        h.update((ctypes.c_char * n).from_address(addr))
    return h.intdigest()


class MooncakePageStore:
    """`master`: the master's RPC address (host:port); `metadata`: its HTTP metadata server URL
    (``http://host:port/metadata``) or an etcd address; `segment_bytes`: the memory this client
    gives to the shared store."""

    def __init__(self, *, namespace: str, master: str, metadata: str, staging_bytes: int,
                 segment_bytes: int = 1 << 30, local_hostname: str = "127.0.0.1", protocol: str = "tcp",
                 device: str = "") -> None:
        from mooncake.store import MooncakeDistributedStore
        self.namespace = namespace
        self._prefix = f"kvstage/{hashlib.sha256(namespace.encode()).hexdigest()[:20]}/"
        self.stats = StoreStats(direct=False)
        self._store = MooncakeDistributedStore()
        rc = self._store.setup(local_hostname, metadata, segment_bytes, 16 << 20, protocol, device, master)
        if rc != 0:
            raise StoreError(f"Mooncake Store setup against master {master} failed (rc {rc})")
        self._wbuf = HostMemory(round_up(staging_bytes))
        self._rbuf = HostMemory(round_up(staging_bytes))
        self.staging_bytes = self._wbuf.nbytes
        for buf in (self._wbuf, self._rbuf):
            rc = self._store.register_buffer(buf.addr, buf.nbytes)
            if rc != 0:
                raise StoreError(f"Mooncake Store register_buffer of {buf.nbytes} bytes failed (rc {rc})")
        self._wlock = threading.Lock()
        self._rlock = threading.Lock()
        self.read_only = False

    def _key(self, pk: PageKey) -> str:
        return f"{self._prefix}{pk.kind}/{pk.key}"

    def present(self, pks: Sequence[PageKey]) -> list[bool]:
        if not pks:
            return []
        try:
            res = self._store.batch_is_exist([self._key(pk) for pk in pks])
        except Exception as exc:   # unreachable master: nothing is there for us
            self.stats.last_error = f"batch_is_exist failed: {exc}"
            return [False] * len(pks)
        return [r == 1 for r in res]

    def contains(self, pk: PageKey) -> bool:
        return self.present([pk])[0]

    def _slots(self, sizes: Sequence[int]) -> list[int]:
        offsets, at = [], 0
        for n in sizes:
            offsets.append(at)
            at += round_up(n + _TRAILER.size, 64)
        if at > self.staging_bytes:
            raise ValueError(f"a batch of {at} bytes exceeds the {self.staging_bytes}-byte staging buffer")
        return offsets

    def _batches(self, idx: list[int], sizes: Sequence[int]):
        batch, used = [], 0
        for i in idx:
            n = round_up(sizes[i] + _TRAILER.size, 64)
            if n > self.staging_bytes:
                raise ValueError(f"a page of {sizes[i]} bytes exceeds the {self.staging_bytes}-byte staging buffer")
            if batch and used + n > self.staging_bytes:
                yield batch
                batch, used = [], 0
            batch.append(i)
            used += n
        if batch:
            yield batch

    def _to_store(self, pks: Sequence[PageKey]) -> tuple[list[bool], list[int]]:
        """(stored already, per page; the indices of the pages to store: absent, first of their key)."""
        there = self.present(pks)
        self.stats.pages_skipped_present += sum(there)
        todo, seen = [], set()
        for i, pk in enumerate(pks):
            if not there[i] and pk not in seen:
                seen.add(pk)
                todo.append(i)
        return list(there), todo

    def put(self, pks: Sequence[PageKey], sizes: Sequence[int], fill: Callable[[int, torch.Tensor], None]) -> list[bool]:
        if len(pks) != len(sizes):
            raise ValueError(f"{len(pks)} keys and {len(sizes)} sizes")
        ok, todo = self._to_store(pks)
        for batch in self._batches(todo, sizes):
            with self._wlock:
                buf = self._wbuf.tensor
                offs = self._slots([sizes[i] for i in batch])
                for off, i in zip(offs, batch):
                    page = buf[off:off + sizes[i]]
                    fill(i, page)
                    tr = _TRAILER.pack(MAGIC, VERSION, xxhash.xxh3_64_intdigest(page.numpy()))
                    buf[off + sizes[i]:off + sizes[i] + _TRAILER.size].copy_(
                        torch.frombuffer(bytearray(tr), dtype=torch.uint8))
                try:
                    res = self._store.batch_put_from([self._key(pks[i]) for i in batch],
                                                     [self._wbuf.addr + o for o in offs],
                                                     [sizes[i] + _TRAILER.size for i in batch])
                except Exception as exc:
                    res = [-1] * len(batch)
                    self.stats.last_error = f"batch_put_from failed: {exc}"
            self._count_puts(batch, res, [sizes[i] for i in batch], ok)
        done = {pks[i] for i, x in enumerate(ok) if x}
        return [pk in done for pk in pks]

    def get(self, pks: Sequence[PageKey], sizes: Sequence[int], drain: Callable[[int, torch.Tensor], None]) -> list[bool]:
        if len(pks) != len(sizes):
            raise ValueError(f"{len(pks)} keys and {len(sizes)} sizes")
        ok = [False] * len(pks)
        for batch in self._batches(list(range(len(pks))), sizes):
            with self._rlock:
                buf = self._rbuf.tensor
                offs = self._slots([sizes[i] for i in batch])
                want = [sizes[i] + _TRAILER.size for i in batch]
                try:
                    got = self._store.batch_get_into([self._key(pks[i]) for i in batch],
                                                     [self._rbuf.addr + o for o in offs], want)
                except Exception as exc:
                    got = [-1] * len(batch)
                    self.stats.last_error = f"batch_get_into failed: {exc}"
                self.stats.reads += 1
                for off, i, n, w in zip(offs, batch, got, want):
                    if n != w:
                        continue
                    page = buf[off:off + sizes[i]]
                    magic, version, digest = _TRAILER.unpack(bytes(buf[off + sizes[i]:off + w].numpy()))
                    if magic != MAGIC or version != VERSION or xxhash.xxh3_64_intdigest(page.numpy()) != digest:
                        self.stats.pages_corrupt += 1
                        self.stats.last_error = f"page {pks[i].key!r} failed its digest: a miss"
                        log.warning("kvstage storage: %s", self.stats.last_error)
                        continue
                    drain(i, page)
                    ok[i] = True
                    self.stats.bytes_read += sizes[i]
        n_ok = sum(ok)
        self.stats.pages_read += n_ok
        self.stats.pages_missed += len(ok) - n_ok
        return ok

    # ---- zero copy: pages as (address, size) pieces of memory registered with `register` ----

    def register(self, addr: int, nbytes: int) -> None:
        """Register memory (SGLang's host pool) that `put_pieces` and `get_pieces` address."""
        rc = self._store.register_buffer(addr, nbytes)
        if rc != 0:
            raise StoreError(f"Mooncake Store register_buffer of {nbytes} bytes at {addr:#x} failed (rc {rc})")

    def put_pieces(self, pks: Sequence[PageKey], pieces: Sequence[Sequence[tuple[int, int]]]) -> list[bool]:
        """Store each page from its pieces in place (registered memory) with its trailer: one
        `batch_put_from_multi_buffers` per batch, the same objects `put` stores."""
        ok, todo = self._to_store(pks)
        per = self.staging_bytes // _TRAILER.size
        for start in range(0, len(todo), per):
            batch = todo[start:start + per]
            with self._wlock:
                buf = self._wbuf.tensor
                for j, i in enumerate(batch):
                    tr = _TRAILER.pack(MAGIC, VERSION, _digest(pieces[i]))
                    buf[j * _TRAILER.size:(j + 1) * _TRAILER.size].copy_(torch.frombuffer(bytearray(tr), dtype=torch.uint8))
                try:
                    res = self._store.batch_put_from_multi_buffers(
                        [self._key(pks[i]) for i in batch],
                        [[p for p, _ in pieces[i]] + [self._wbuf.addr + j * _TRAILER.size] for j, i in enumerate(batch)],
                        [[n for _, n in pieces[i]] + [_TRAILER.size] for i in batch])
                except Exception as exc:
                    res = [-1] * len(batch)
                    self.stats.last_error = f"batch_put_from_multi_buffers failed: {exc}"
            self._count_puts(batch, res, [sum(n for _, n in pieces[i]) for i in batch], ok)
        done = {pks[i] for i, x in enumerate(ok) if x}
        return [pk in done for pk in pks]

    def get_pieces(self, pks: Sequence[PageKey], pieces: Sequence[Sequence[tuple[int, int]]]) -> list[bool]:
        """Read each page straight into its pieces (registered memory), then check it against its
        trailer: a page that does not match is a miss (False). Its pieces then hold bytes that
        must not be used: SGLang frees the host pages of a miss without reading them.

        One `batch_get_into_multi_buffers` per batch, then the batch's trailers read in one step
        (numpy) and each page read whole digested on this thread (digesting in two halves on
        two threads, or beside the get in parts, was measured no faster here: docs/storage.md)."""
        ok = [False] * len(pks)
        sizes = [sum(n for _, n in p) for p in pieces]
        per = self.staging_bytes // _TRAILER.size
        for start in range(0, len(pks), per):
            batch = range(start, min(len(pks), start + per))
            with self._rlock:
                base = self._rbuf.addr - start * _TRAILER.size      # page i's trailer: base + 16 i
                try:
                    got = self._store.batch_get_into_multi_buffers(
                        [self._key(pks[i]) for i in batch],
                        [[p for p, _ in pieces[i]] + [base + i * _TRAILER.size] for i in batch],
                        [[n for _, n in pieces[i]] + [_TRAILER.size] for i in batch])
                except Exception as exc:
                    got = [-1] * len(batch)
                    self.stats.last_error = f"batch_get_into_multi_buffers failed: {exc}"
                self.stats.reads += 1
                trailers = self._rbuf.tensor[: len(batch) * _TRAILER.size].numpy().view(_TRAILER_DTYPE)
                self._check(pks, pieces, sizes, batch, got, trailers, ok)
                del trailers
        n_ok = sum(ok)
        self.stats.pages_read += n_ok
        self.stats.pages_missed += len(ok) - n_ok
        return ok

    def _check(self, pks, pieces, sizes, batch: range, got, trailers, ok: list[bool]) -> None:
        """Pages of `batch` whose object came back whole and matches its trailer: ok."""
        header = ((trailers["magic"] == MAGIC) & (trailers["version"] == VERSION)).tolist()
        expected = trailers["digest"].tolist()
        for j, i in enumerate(batch):
            if got[j] != sizes[i] + _TRAILER.size:
                continue
            if not header[j] or _digest(pieces[i]) != expected[j]:
                self.stats.pages_corrupt += 1
                self.stats.last_error = f"page {pks[i].key!r} failed its digest: a miss"
                log.warning("kvstage storage: %s", self.stats.last_error)
                continue
            ok[i] = True
            self.stats.bytes_read += sizes[i]

    def _count_puts(self, batch, res, sizes, ok) -> None:
        self.stats.writes += 1
        failed = [rc for rc in res if rc != 0]
        if failed:
            self.stats.pages_not_stored += len(failed)
            self.stats.last_error = f"Mooncake Store refused {len(failed)} pages (rc {failed[0]})"
            log.warning("kvstage storage: %s", self.stats.last_error)
        for i, rc, n in zip(batch, res, sizes):
            ok[i] = rc == 0
            if rc == 0:
                self.stats.pages_written += 1
                self.stats.bytes_written += n

    def clear(self) -> None:
        """Mooncake Store is shared: this removes nothing (SGLang's clear is per server)."""

    def close(self) -> None:
        with self._wlock, self._rlock:
            try:
                self._store.unregister_buffer(self._wbuf.addr)
                self._store.unregister_buffer(self._rbuf.addr)
            except Exception:
                pass
            self._store.close()
            self._wbuf.close()
            self._rbuf.close()
