"""kvstage as SGLang's HiCache L3 storage backend (docs/storage.md), through SGLang's own
mechanism for out-of-tree backends::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config '{
        "backend_name": "kvstage", "module_path": "kvstage.adapters.sglang.storage",
        "class_name": "KvstageHiCacheStorage", "interface_v1": 1, "kvstage_path": "/mnt/nvme/kv"}'

``interface_v1`` makes SGLang hand the backend host-pool indices (batch_get_v1/batch_set_v1)
rather than page tensors: pages go from SGLang's host pool straight into kvstage's staging buffer
and back (for MHA/MLA pools, through the pool's own page pointers: no intermediate tensor), one
O_DIRECT write per batch, one read per run (storage/file_store.py). Hybrid models use the v2
calls (a `PoolTransfer` per pool): every pool's pages of one call go into ONE batch file, under a
kind per pool ("kv", "mamba", "indexer"...), so a request's KV and states are stored, found and
evicted together.

The store: ``kvstage_store`` "file" (default: local files, below) or "mooncake" (Mooncake Store,
shared by a fleet: ``kvstage_mooncake_master`` host:port, ``kvstage_mooncake_metadata`` its
metadata URL, ``kvstage_mooncake_segment_gb`` (1), ``kvstage_mooncake_protocol`` ("tcp")).
File store keys (all optional but the path): ``kvstage_path`` (or KVSTAGE_STORAGE_DIR),
``kvstage_capacity_gb`` (default: 90% of the free space), ``kvstage_direct`` ("auto", "on",
"off"), ``kvstage_staging_mb`` (default: one SGLang batch of pages, at most 1/8 of the available
memory), ``kvstage_prefetch_reserve`` (the fraction of the L2 pool a prefetch leaves free, 0.25).

Never raises out of a data call: a store that is full, gone or read-only stores nothing (False),
anything not read whole and verified is a miss, and the server keeps serving; `stats()` says why.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from ...storage.file_store import DirectFileStore, DirectMode, PageKey, PageStore
from ...storage.prefetch import PrefetchBudget, PrefetchMetrics

__all__ = ["KvstageHiCacheStorage", "namespace_for"]

log = logging.getLogger(__name__)

PATH_ENV = "KVSTAGE_STORAGE_DIR"
BATCH_PAGES = 128  # SGLang's STORAGE_BATCH_SIZE: the most pages one call carries per pool


def namespace_for(config: HiCacheStorageConfig) -> str:
    """Who may read these pages: the model and this rank's place (MLA pages are shared by the
    TP ranks, as in SGLang's file backend). Each pool's format is in its kind (`_Pool.kind`)."""
    model = (config.model_name or "").replace("/", "-")
    parts = [f"model={model}", f"pp={config.pp_rank}/{config.pp_size}", f"cp={config.attn_cp_rank}/{config.attn_cp_size}"]
    if not config.is_mla_model:
        parts.append(f"tp={config.tp_rank}/{config.tp_size}")
    if config.dcp_size > 1:
        parts.append(f"dcp={config.dcp_rank}/{config.dcp_size}/{config.logical_page_size}")
    return ";".join(parts)


def _available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


@dataclass
class _Pool:
    """One SGLang host pool as the store sees it: its kind (name and page format) and how one of
    its pages is copied out and in. `pointers`: through get_page_buffer_meta (MHA/MLA pools,
    straight from the pool's memory); otherwise the pool's flat data page calls."""

    name: str
    pool: Any
    page_size: int
    page_bytes: int
    pointers: bool

    @classmethod
    def of(cls, name: str, pool: Any) -> _Pool:
        page_size = getattr(pool, "page_size", 1) or 1
        pointers = False
        if type(pool).__name__ in ("MHATokenToKVPoolHost", "MLATokenToKVPoolHost"):
            try:
                _, sizes = pool.get_page_buffer_meta(torch.zeros(page_size, dtype=torch.int64))
                page_bytes, pointers = sum(sizes), True
            except (ValueError, NotImplementedError, AssertionError, AttributeError):
                pass
        if not pointers:
            dummy = pool.get_dummy_flat_data_page()
            page_bytes = dummy.numel() * dummy.element_size()
        return cls(str(name), pool, page_size, page_bytes, pointers)

    @property
    def kind(self) -> str:
        p = self.pool
        fmt = getattr(p, "storage_format_tag", None) or ""
        return (f"{self.name}:{type(p).__name__}:{getattr(p, 'layout', '')}:{getattr(p, 'dtype', '')}:"
                f"{self.page_bytes}:{'ptr' if self.pointers else 'flat'}{':' + fmt if fmt else ''}")

    def page_starts(self, host_indices: torch.Tensor, n: int) -> list[int]:
        return [int(host_indices[i * self.page_size]) for i in range(n)]

    def pieces(self, host_indices: torch.Tensor, n: int) -> list[list[tuple[int, int]]]:
        """(address, size) pieces of each of the n pages, in the pool's own page order."""
        ptrs, sizes = self.pool.get_page_buffer_meta(host_indices[: n * self.page_size])
        per = len(ptrs) // n
        return [list(zip(ptrs[i * per:(i + 1) * per], sizes[i * per:(i + 1) * per])) for i in range(n)]


def _copy_out(pieces: list[tuple[int, int]], dst: torch.Tensor) -> None:
    at = dst.data_ptr()
    for ptr, size in pieces:
        ctypes.memmove(at, ptr, size)
        at += size


def _copy_in(src: torch.Tensor, pieces: list[tuple[int, int]]) -> None:
    at = src.data_ptr()
    for ptr, size in pieces:
        ctypes.memmove(ptr, at, size)
        at += size


class KvstageHiCacheStorage(HiCacheStorage):
    """See the module docstring. SGLang's dynamic loader constructs it as
    ``KvstageHiCacheStorage(storage_config, kwargs)`` and then registers the host pool(s)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None) -> None:
        extra = dict(storage_config.extra_config or {})
        self.config = storage_config
        self.extra = extra
        self.kind = str(extra.get("kvstage_store", "file"))
        if self.kind not in ("file", "mooncake"):
            raise ValueError(f"kvstage_store must be 'file' or 'mooncake', got {self.kind!r}")
        self.root = extra.get("kvstage_path") or os.environ.get(PATH_ENV)
        if self.kind == "file" and not self.root:
            raise ValueError(f"kvstage storage needs a directory: extra config 'kvstage_path' or {PATH_ENV}")
        if self.kind == "mooncake":
            missing = [k for k in ("kvstage_mooncake_master", "kvstage_mooncake_metadata") if k not in extra]
            if missing:
                raise ValueError(f"kvstage_store 'mooncake' needs extra config {missing}")
        cap = extra.get("kvstage_capacity_gb")
        self.capacity_bytes = int(float(cap) * (1 << 30)) if cap is not None else None
        self.direct = DirectMode(str(extra.get("kvstage_direct", "auto")))
        mb = extra.get("kvstage_staging_mb")
        self.staging_bytes = int(float(mb) * (1 << 20)) if mb is not None else None
        self.reserve_fraction = float(extra.get("kvstage_prefetch_reserve", 0.25))
        self.namespace = namespace_for(storage_config)
        self.prefetch_metrics = PrefetchMetrics()
        self._pools: dict[str, _Pool] = {}
        self._store: PageStore | None = None
        self._open_lock = threading.Lock()
        self._anchor: _Pool | None = None
        self._registered: set[str] = set()
        self._last_grant: tuple[str | None, int] = (None, 0)   # last key granted, pages granted to its prefix
        self._counts = {"prefetch_pgs": [], "backup_pgs": []}

    # ---- pools and the store -------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host) -> None:
        super().register_mem_pool_host(mem_pool_host)
        # hybrid models hand over a pool group (entries per pool): its anchor entry is the KV pool
        entry = getattr(mem_pool_host, "anchor_entry", None)
        kv_pool = entry.host_pool if entry is not None else mem_pool_host
        self._anchor = self._pools[str(PoolName.KV)] = _Pool.of(str(PoolName.KV), kv_pool)

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        pool = self._pools[str(host_pool_name)] = _Pool.of(str(host_pool_name), host_pool)
        if str(host_pool_name) == str(PoolName.KV):
            self._anchor = pool

    def on_host_pools_registered(self) -> None:
        """SGLang's attach is over: open the store now, so that a store that cannot be opened
        (no directory, unreachable master) fails the attach with its reason, not a request."""
        self.store  # noqa: B018

    @property
    def store(self) -> PageStore:
        """Opened on first use, when every pool (and so the largest page) is known."""
        if self._store is None:
            with self._open_lock:
                if self._store is None:
                    largest = max((p.page_bytes for p in self._pools.values()), default=1 << 20)
                    want = self.staging_bytes or BATCH_PAGES * ((largest + 4095) // 4096 * 4096) + (64 << 10)
                    limit = _available_memory() // 8
                    size = max(min(want, limit), (largest + 4095) // 4096 * 4096 + (128 << 10))
                    if size < want:
                        log.warning("kvstage storage: staging buffers of %d MiB, not %d: 1/8 of the free memory",
                                    size >> 20, want >> 20)
                    if self.kind == "mooncake":
                        from ...storage.mooncake_store import MooncakePageStore
                        self._store = MooncakePageStore(
                            namespace=self.namespace, master=self.extra["kvstage_mooncake_master"],
                            metadata=self.extra["kvstage_mooncake_metadata"], staging_bytes=size,
                            segment_bytes=int(float(self.extra.get("kvstage_mooncake_segment_gb", 1)) * (1 << 30)),
                            local_hostname=self.extra.get("kvstage_mooncake_hostname", "127.0.0.1"),
                            protocol=self.extra.get("kvstage_mooncake_protocol", "tcp"))
                    else:
                        self._store = DirectFileStore(root=self.root, namespace=self.namespace, staging_bytes=size,
                                                      capacity_bytes=self.capacity_bytes, direct=self.direct)
        return self._store

    def _pool(self, name) -> _Pool:
        return self._pools[str(name)]

    # ---- exists and the prefetch budget ----------------------------------------------------

    def _grant(self, hits: int, already: int = 0) -> int:
        """Shrink a prefetch of `hits` pages to what the L2 pool has free beyond its reserve,
        less the `already` pages granted to earlier batches of the same prefix (SGLang asks in
        batches of 128 and allocates only after the last answer)."""
        host = getattr(self, "mem_pool_host", None)
        if host is None or hits == 0:
            return hits
        budget = PrefetchBudget(pool_tokens=host.size, page_size=self._anchor.page_size,
                                reserve_fraction=self.reserve_fraction)
        free = max(0, int(host.available_size()) - already * self._anchor.page_size)
        grant = budget.grant(hits, free)
        self.prefetch_metrics.add(grant)
        if grant.granted < hits:
            log.info("kvstage storage: prefetch of %d pages shrunk to %d (%d tokens free, %d kept for L2)",
                     hits, grant.granted, grant.free_tokens, grant.reserve_tokens)
        return grant.granted

    def exists(self, key: str) -> bool:
        try:
            return self.store.contains(PageKey(self._anchor.kind, key))
        except Exception as exc:   # the server keeps serving: a store that fails is a miss
            log.error("kvstage storage: exists failed: %s", exc)
            return False

    def batch_exists(self, keys: list[str], extra_info=None) -> int:
        try:
            return self._batch_exists(keys, extra_info)
        except Exception as exc:
            log.error("kvstage storage: batch_exists failed: %s", exc, exc_info=True)
            return 0

    def _batch_exists(self, keys: list[str], extra_info) -> int:
        present = self.store.present([PageKey(self._anchor.kind, k) for k in keys])
        hits = present.index(False) if False in present else len(present)
        prefix = getattr(extra_info, "prefix_keys", None)
        last_key, already = self._last_grant
        if not (prefix and last_key is not None and prefix[-1] == last_key):
            already = 0        # not the next batch of the prefix granted last
        granted = self._grant(hits, already)
        self._last_grant = (keys[granted - 1] if granted else None, already + granted)
        return granted

    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info=None) -> PoolTransferResult:
        """Longest KV prefix whose every extra pool is there too, by each pool's hit policy (as
        SGLang's file backend decides), then shrunk to the prefetch budget."""
        try:
            return self._batch_exists_v2(keys, pool_transfers)
        except Exception as exc:   # the server keeps serving: a store that fails is a miss
            log.error("kvstage storage: batch_exists_v2 failed: %s", exc, exc_info=True)
            return PoolTransferResult.empty()

    def _batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None) -> PoolTransferResult:
        store = self.store
        kv = store.present([PageKey(self._anchor.kind, k) for k in keys])
        kv_pages = kv.index(False) if False in kv else len(kv)
        hit_count: dict[str, int] = {str(PoolName.KV): kv_pages} if kv_pages else {}
        restorable = set(range(1, kv_pages + 1))
        for t in pool_transfers or []:
            if not restorable:
                break
            pool = self._pools.get(str(t.name))
            has = store.present([PageKey(pool.kind, k) for k in keys[:kv_pages]]) if pool else [False] * kv_pages
            if t.hit_policy == PoolHitPolicy.ALL_PAGES:
                boundary = has.index(False) if False in has else kv_pages
                ok = set(range(1, boundary + 1))
            elif t.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                trailing = max(1, len(t.keys) if t.keys else 1)
                ok = {n for n in range(1, kv_pages + 1) if all(has[max(0, n - trailing):n])}
                boundary = max(ok, default=0)
            else:
                log.warning("kvstage storage: hit policy %s of pool %s not supported: a miss", t.hit_policy, t.name)
                ok, boundary = set(), 0
            if boundary:
                hit_count[str(t.name)] = boundary
            restorable &= ok
        final = max(restorable, default=0)
        granted = self._grant(final)
        ordered = sorted(n for n in restorable if n <= granted)
        return PoolTransferResult(ordered[-1] if ordered else 0, hit_count, ordered)

    # ---- zero-copy v1 (one pool) and v2 (several pools, one batch file) ---------------------

    def _items(self, pool: _Pool, keys: list[str], host_indices: torch.Tensor):
        n = len(keys)
        if host_indices is None or host_indices.numel() < n * pool.page_size:
            raise ValueError(f"{pool.name}: {n} pages need {n * pool.page_size} host indices, "
                             f"got {0 if host_indices is None else host_indices.numel()}")
        if pool.pointers:
            pieces = pool.pieces(host_indices, n)
            out = [lambda dst, p=p: _copy_out(p, dst) for p in pieces]
            inn = [lambda src, p=p: _copy_in(src, p) for p in pieces]
        else:
            starts = pool.page_starts(host_indices, n)
            out = [lambda dst, s=s: dst.copy_(pool.pool.get_data_page(s, flat=True).view(-1).view(torch.uint8))
                   for s in starts]
            inn = [lambda src, s=s: pool.pool.set_from_flat_data_page(
                s, src.view(pool.pool.get_dummy_flat_data_page().dtype)) for s in starts]
        kind = pool.kind
        return [PageKey(kind, k) for k in keys], [pool.page_bytes] * n, out, inn

    def _io(self, parts: list[tuple[_Pool, list[str], torch.Tensor]], write: bool) -> list[list[bool]]:
        store = self.store
        if hasattr(store, "put_pieces") and all(p.pointers for p, _, _ in parts):
            return self._io_in_place(store, parts, write)
        pks, sizes, outs, ins, bounds = [], [], [], [], []
        for pool, keys, idx in parts:
            k, s, o, i = self._items(pool, keys, idx)
            bounds.append((len(pks), len(pks) + len(k)))
            pks += k
            sizes += s
            outs += o
            ins += i
        if write:
            ok = self.store.put(pks, sizes, lambda j, dst: outs[j](dst))
        else:
            ok = self.store.get(pks, sizes, lambda j, src: ins[j](src))
        return [ok[a:b] for a, b in bounds]

    def _io_in_place(self, store, parts, write: bool) -> list[list[bool]]:
        """Mooncake Store, MHA/MLA pools: pages go from and to the host pool in place."""
        pks, pieces, bounds = [], [], []
        for pool, keys, idx in parts:
            if idx is None or idx.numel() < len(keys) * pool.page_size:
                raise ValueError(f"{pool.name}: {len(keys)} pages need {len(keys) * pool.page_size} host indices")
            if pool.name not in self._registered:
                buf = pool.pool.kv_buffer
                store.register(buf.data_ptr(), buf.numel() * buf.element_size())
                self._registered.add(pool.name)
            bounds.append((len(pks), len(pks) + len(keys)))
            kind = pool.kind
            pks += [PageKey(kind, k) for k in keys]
            pieces += pool.pieces(idx, len(keys)) if keys else []
        ok = store.put_pieces(pks, pieces) if write else store.get_pieces(pks, pieces)
        return [ok[a:b] for a, b in bounds]

    def _safe(self, what: str, n: list[int], fn) -> list[list[bool]]:
        try:
            return fn()
        except Exception as exc:  # the server keeps serving: a failed call is a miss / not stored
            log.error("kvstage storage: %s failed: %s", what, exc, exc_info=True)
            self.store.stats.last_error = f"{what}: {exc}"
            return [[False] * k for k in n]

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info=None) -> list[bool]:
        (ok,) = self._safe("get", [len(keys)], lambda: self._io([(self._anchor, keys, host_indices)], False))
        self._counts["prefetch_pgs"].append(sum(ok))
        return ok

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info=None) -> list[bool]:
        (ok,) = self._safe("set", [len(keys)], lambda: self._io([(self._anchor, keys, host_indices)], True))
        self._counts["backup_pgs"].append(sum(ok))
        return ok

    def _v2(self, transfers: list[PoolTransfer], write: bool) -> dict[str, list[bool]]:
        parts = [(self._pool(t.name), list(t.keys or []), t.host_indices) for t in transfers]
        res = self._safe("set_v2" if write else "get_v2", [len(p[1]) for p in parts],
                         lambda: self._io(parts, write))
        return {t.name: r for t, r in zip(transfers, res)}

    def batch_get_v2(self, transfers: list[PoolTransfer], extra_info=None) -> dict[str, list[bool]]:
        return self._v2(transfers, False)

    def batch_set_v2(self, transfers: list[PoolTransfer], extra_info=None) -> dict[str, list[bool]]:
        return self._v2(transfers, True)

    # ---- SGLang's older tensor calls (without interface_v1) --------------------------------

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None):
        dsts = [t if t is not None else self._anchor.pool.get_dummy_flat_data_page() for t in target_locations]
        pks = [PageKey(self._anchor.kind, k) for k in keys]
        sizes = [t.numel() * t.element_size() for t in dsts]
        ok = self.store.get(pks, sizes, lambda j, src: dsts[j].view(-1).view(torch.uint8).copy_(src))
        return [d if o else None for d, o in zip(dsts, ok)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        flat = [v.contiguous().view(-1).view(torch.uint8) for v in values]
        pks = [PageKey(self._anchor.kind, k) for k in keys]
        return all(self.store.put(pks, [f.numel() for f in flat], lambda j, dst: dst.copy_(flat[j])))

    # ---- the rest ------------------------------------------------------------------------

    def stats(self) -> dict:
        """The store's counters (incl. why the last page was not stored or read) and the
        prefetch budget's (pages requested, granted, prefetches shrunk)."""
        return {**self.store.stats.as_dict(), **self.prefetch_metrics.as_dict()}

    def get_stats(self):
        from sglang.srt.observability.metrics_collector import StorageMetrics
        m = StorageMetrics(prefetch_pgs=self._counts["prefetch_pgs"], backup_pgs=self._counts["backup_pgs"])
        self._counts = {"prefetch_pgs": [], "backup_pgs": []}
        m.kvstage = self.stats()
        return m

    def clear(self) -> bool:
        self.store.clear()
        return True

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
