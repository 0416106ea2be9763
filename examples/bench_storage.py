"""The storage tier's benchmark (docs/storage.md): write and read throughput of one batch of pages
(default 256 pages of 64 tokens, 1 MiB each: 32 layers x K,V x 1 KV head x 128 x bf16, i.e. an
8B Llama's page on one of 8 TP ranks) between SGLang's host pool and a local filesystem:

- kvstage: KvstageHiCacheStorage (SGLang's dynamic backend, interface v1): the pages gathered
  into a staging buffer, ONE O_DIRECT write; one O_DIRECT read scattered back.
- sglang-file: SGLang's HiCacheFile as its cache controller drives it (a flat page tensor per
  page, one buffered file per page). Its writes end in the page cache: "write" is the time to
  durable (its files fsynced at the end, as kvstage's O_DIRECT write is when it returns),
  "write-nosync" without; its reads are cold (each file fsynced and dropped from the page cache
  with POSIX_FADV_DONTNEED first).
- with --mooncake, Mooncake Store (a mooncake_master started here for each, tcp): kvstage's store behind
  the same backend (kvstage_store=mooncake) against SGLang's own mooncake backend (zero copy
  from its registered host pool), both through batch_set_v1 / batch_get_v1. --mooncake-only runs
  just these two (no local files, no dd): an A/B of the Mooncake path in a minute.
- dd: one O_DIRECT write of the same bytes from an aligned buffer, one O_DIRECT read: the disk's
  bound, without any host-pool copy.

The contenders alternate within each round (rotated order), after one warm-up round each that
is not counted (it opens the store and faults its buffers in); medians over the rounds.
Run in the SGLang venv:  PYTHONPATH=tests/sglang_adapter/shims:.. .venv-sglang/bin/python examples/bench_storage.py
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch


def build_pool(pages: int, page: int, layers: int, heads: int, dim: int, layout: str):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    kv = MHATokenToKVPool(pages * page, page, torch.bfloat16, heads, dim, layers, "cpu", False,
                          start_layer=0, end_layer=layers - 1)
    return MHATokenToKVPoolHost(kv.get_device_pool_infos()[0].buffer_info, 2.5, 0, page, layout, pin_memory=False,
                                device_capacity_tokens=kv.size, start_layer=0, end_layer=layers - 1,
                                write_back_staging=kv.hicache_write_back_staging)


def config(path: str, extra: dict | None = None):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                                model_name="bench", extra_config={"file_storage_path": path, **(extra or {})})


def drop_cache(paths) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/var/tmp/kvstage-bench-storage", help="a directory on a disk (not tmpfs)")
    ap.add_argument("--pages", type=int, default=256)
    ap.add_argument("--page-tokens", type=int, default=64)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=1)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--layout", default="page_first", choices=["page_first", "layer_first"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--mooncake", action="store_true",
                    help="also Mooncake Store (a local mooncake_master): kvstage's store against SGLang's mooncake backend")
    ap.add_argument("--mooncake-only", action="store_true",
                    help="with --mooncake: only the two Mooncake contenders (no local files, no dd)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    args.mooncake = args.mooncake or args.mooncake_only

    from sglang.srt.mem_cache.hicache_storage import HiCacheFile
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    from kvstage.staging.host_memory import HostMemory

    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    n, P = args.pages, args.page_tokens
    pool = build_pool(n, P, args.layers, args.heads, args.head_dim, args.layout)
    src, dst = pool.alloc(n * P), pool.alloc(n * P)
    flat = pool.kv_buffer.view(-1)
    flat.copy_(torch.randn(flat.numel(), dtype=torch.float32).to(flat.dtype))
    ks = StorageBackendFactory.create_backend("dynamic", config(str(root / "kvstage"), {
        "backend_name": "kvstage", "module_path": "kvstage.adapters.sglang.storage", "class_name": "KvstageHiCacheStorage",
        "interface_v1": 1, "kvstage_path": str(root / "kvstage"), "kvstage_direct": "on",
        "kvstage_staging_mb": (n + 2) * 1.0 * pool.get_dummy_flat_data_page().numel() * 2 / (1 << 20) + 1}), pool)
    ks.register_mem_pool_host(pool)
    page_bytes = ks._anchor.page_bytes
    total = n * page_bytes
    hf_dir = root / "sglang-file"
    hf = HiCacheFile(config(str(hf_dir)))
    dd_buf = HostMemory(total)
    dd_buf.tensor.copy_(flat.view(torch.uint8)[:total])

    def kvstage_rw(r):
        keys = [f"k{r}-{i}" for i in range(n)]
        t0 = time.perf_counter()
        ok = ks.batch_set_v1(keys, src)
        t1 = time.perf_counter()
        got = ks.batch_get_v1(keys, dst)
        t2 = time.perf_counter()
        assert all(ok) and all(got), "kvstage lost pages"
        return {"write": t1 - t0, "read": t2 - t1}

    def sglang_file_rw(r):
        keys = [f"f{r}-{i}" for i in range(n)]
        t0 = time.perf_counter()
        data = [pool.get_data_page(src[i * P]) for i in range(n)]     # the controller's _generic_page_set
        assert hf.batch_set(keys, data)
        t1 = time.perf_counter()
        paths = [p for p in hf_dir.iterdir() if p.name.startswith(f"f{r}-")]
        drop_cache(paths)                                               # fsync: now durable
        t2 = time.perf_counter()
        dummies = [pool.get_dummy_flat_data_page() for _ in range(n)]   # the controller's _generic_page_get
        pages = hf.batch_get(keys, dummies)
        for i, pg in enumerate(pages):
            assert pg is not None, "HiCacheFile lost a page"
            pool.set_from_flat_data_page(int(dst[i * P]), pg)
        t3 = time.perf_counter()
        return {"write": t2 - t0, "write-nosync": t1 - t0, "read": t3 - t2}

    def dd_rw(r):
        path = root / f"dd-{r}.bin"
        view = memoryview(dd_buf.tensor.numpy())
        t0 = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
        done = 0
        while done < total:
            done += os.write(fd, view[done:])
        os.close(fd)
        t1 = time.perf_counter()
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        done = 0
        while done < total:
            done += os.preadv(fd, [view[done:]], done)
        os.close(fd)
        t2 = time.perf_counter()
        path.unlink()
        return {"write": t1 - t0, "read": t2 - t1}

    contenders = {"kvstage": kvstage_rw, "sglang-file": sglang_file_rw, "dd": dd_rw}
    stack = contextlib.ExitStack()
    if args.mooncake:
        from kvstage.support.mooncake_master import mooncake_master
        # one master each: with both clients on one master, a store's objects may land in the
        # other client's segment and cross TCP, which would time placement, not the stores
        (root / "mc-kvstage").mkdir()
        (root / "mc-sglang").mkdir()
        master, metadata = stack.enter_context(mooncake_master(root / "mc-kvstage"))
        master2, metadata2 = stack.enter_context(mooncake_master(root / "mc-sglang"))
        seg = (args.rounds + 2) * total + (256 << 20)
        mk = StorageBackendFactory.create_backend("dynamic", config(str(root), {
            "backend_name": "kvstage", "module_path": "kvstage.adapters.sglang.storage",
            "class_name": "KvstageHiCacheStorage", "interface_v1": 1, "kvstage_store": "mooncake",
            "kvstage_mooncake_master": master, "kvstage_mooncake_metadata": metadata,
            "kvstage_mooncake_segment_gb": seg / (1 << 30),
            "kvstage_staging_mb": (n + 2) * page_bytes / (1 << 20) + 1}), pool)
        mk.register_mem_pool_host(pool)
        sm = StorageBackendFactory.create_backend("mooncake", config(str(root), {
            "master_server_address": master2, "metadata_server": metadata2, "global_segment_size": seg,
            "protocol": "tcp", "local_hostname": "127.0.0.1", "check_server": False}), pool)
        sm.register_mem_pool_host(pool)

        def v1_rw(backend, tag):
            def rw(r):
                keys = [f"{tag}{r}-{i}" for i in range(n)]
                t0 = time.perf_counter()
                ok = backend.batch_set_v1(keys, src)
                t1 = time.perf_counter()
                got = backend.batch_get_v1(keys, dst)
                t2 = time.perf_counter()
                assert all(ok) and all(got), f"{tag}: pages lost ({sum(ok)} stored, {sum(got)} read)"
                return {"write": t1 - t0, "read": t2 - t1}
            return rw

        contenders["kvstage-mooncake"] = v1_rw(mk, "km")
        contenders["sglang-mooncake"] = v1_rw(sm, "sm")
        if args.mooncake_only:
            for c in ("kvstage", "sglang-file", "dd"):
                del contenders[c]
    names = list(contenders)
    times: dict[str, dict[str, list[float]]] = {c: {} for c in names}
    load0 = os.getloadavg()
    print(f"# {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}  {os.cpu_count()} CPUs  {n} pages x "
          f"{page_bytes >> 10} KiB ({total >> 20} MiB)  layout {args.layout}  {args.rounds} rounds  dir {root}  "
          f"load {load0[0]:.2f}", flush=True)
    for c in names:                       # warm-up, not counted: opens the store, faults buffers in
        contenders[c](-1)
    for r in range(args.rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for c in order:
            for k, v in contenders[c](r).items():
                times[c].setdefault(k, []).append(v)
        if r == 0:
            ok_bytes = torch.equal(pool.get_data_page(src[0]), pool.get_data_page(dst[0]))
            assert ok_bytes, "pages read back differ"
    gbps = {c: {k: total / statistics.median(v) / 1e9 for k, v in t.items()} for c, t in times.items()}
    print(f"\n{'contender':<12} {'op':<13} {'median ms':>10} {'GB/s':>7}")
    for c, t in times.items():
        for k, v in t.items():
            print(f"{c:<12} {k:<13} {statistics.median(v) * 1e3:10.1f} {gbps[c][k]:7.2f}")
    ratios = {}
    if "kvstage" in gbps:
        for op in ("write", "read"):
            ratios[f"{op} kvstage/sglang-file"] = gbps["kvstage"][op] / gbps["sglang-file"][op]
            ratios[f"{op} kvstage/dd"] = gbps["kvstage"][op] / gbps["dd"][op]
        ratios["write kvstage/sglang-file-nosync"] = gbps["kvstage"]["write"] / gbps["sglang-file"]["write-nosync"]
    if args.mooncake:
        for op in ("write", "read"):
            ratios[f"{op} kvstage-mooncake/sglang-mooncake"] = (gbps["kvstage-mooncake"][op]
                                                                 / gbps["sglang-mooncake"][op])
    print()
    for k, v in ratios.items():
        goal = (3.0 if "sglang-file" in k and "nosync" not in k else 0.7 if "dd" in k
                else 1.0 if "mooncake" in k else None)
        verdict = "" if goal is None else f"  (goal >= {goal}x: {'PASS' if v >= goal else 'MISS'})"
        print(f"{k:<36} {v:5.2f}x{verdict}")
    print(f"# kvstage store stats: {ks.stats()}")
    if args.mooncake:
        print(f"# kvstage Mooncake store stats: {mk.stats()}")
    print(f"# load average at the end: {os.getloadavg()[0]:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"pages": n, "page_bytes": page_bytes, "rounds": args.rounds,
                                               "layout": args.layout, "seconds": times, "gbps": gbps,
                                               "ratios": ratios}, indent=1))
        print(f"wrote {args.json}")
    ks.close()
    if args.mooncake:
        mk.close()
        sm.close()
    stack.close()
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
