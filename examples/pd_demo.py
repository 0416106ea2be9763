"""The PD demo: a prefill TP group and a decode TP group move a stream of requests' KV cache
through kvstage, as separate processes on this machine, and every byte is verified.

    make demo                       # defaults: prefill TP 4 -> decode TP 2, staged, NIXL
    .venv/bin/python examples/pd_demo.py --backend mooncake --no-staging --requests 16
    .venv/bin/python examples/pd_demo.py --bootstrap etcd://127.0.0.1:2379/demo   # rendezvous on etcd

It starts the bootstrap server (python -m kvstage.bootstrap; with --bootstrap, the ranks use that
rendezvous instead: another server, or etcd), one process per prefill rank and per
decode rank (examples/pd_rank.py). Prefill ranks fill each request's pages with a deterministic
pattern and send them in chunks, as chunked prefill would; decode ranks receive into random
pages and check every byte. Exit code 0 only when every request arrived and verified.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import numpy as np

from kvstage.support.cluster import Cluster


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--prefill-tp", type=int, default=4)
    p.add_argument("--decode-tp", type=int, default=2)
    p.add_argument("--backend", choices=["nixl", "mooncake"], default="nixl")
    p.add_argument("--staging", dest="staging", action="store_true", default=True,
                   help="staged path (EngineConfig.staging=True)")
    p.add_argument("--no-staging", dest="staging", action="store_false", help="direct path only")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=8, help="global KV heads")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32", "float8_e4m3fn"])
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--mla", action="store_true", help="one replicated latent head (needs --heads 1)")
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--min-tokens", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--chunk-tokens", type=int, default=1024, help="chunked-prefill chunk size")
    p.add_argument("--inflight", type=int, default=4, help="requests in flight per rank")
    p.add_argument("--ring-mb", type=float, default=64, help="decode staging ring (EngineConfig.ring_mb)")
    p.add_argument("--buffer-mb", type=float, default=32, help="per-worker prefill staging buffer")
    p.add_argument("--workers", type=int, default=2, help="prefill transfer workers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json", help="write the summary here")
    p.add_argument("--bootstrap", help="the ranks' rendezvous, instead of a bootstrap server of the demo's own: "
                                       "HOST:PORT of a running one, or etcd://HOST:PORT[,...][/NAMESPACE] "
                                       "(docs/bootstrap.md)")
    a = p.parse_args(argv)
    if a.bootstrap is not None:
        from kvstage.bootstrap.rendezvous import check_address
        try:
            check_address("--bootstrap", a.bootstrap)
        except ValueError as exc:
            p.error(str(exc))
    return a


def make_requests(a: argparse.Namespace) -> list[dict]:
    """Mixed lengths (short and long, non page-aligned), split into chunked-prefill chunks."""
    rng = random.Random(a.seed)
    chunk_pages = max(1, a.chunk_tokens // a.page_size)
    out = []
    for i in range(a.requests):
        tokens = rng.choice([rng.randint(a.min_tokens, max(a.min_tokens, a.max_tokens // 8)),
                             rng.randint(a.min_tokens, a.max_tokens)])
        pages = -(-tokens // a.page_size)
        chunks = [chunk_pages] * (pages // chunk_pages) + ([pages % chunk_pages] if pages % chunk_pages else [])
        out.append({"room": 10_000 + i, "pages": pages, "tokens": tokens, "chunks": chunks})
    return out


def bar(done: int, total: int, t0: float, width: int = 32) -> str:
    filled = width * done // max(total, 1)
    return f"\r  [{'#' * filled}{'.' * (width - filled)}] {done}/{total} requests verified  {time.time() - t0:5.1f} s"


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    requests = make_requests(a)
    pages_needed = max(r["pages"] for r in requests) * a.inflight + 8
    geometry = {"layers": a.layers, "heads": a.heads, "head_dim": a.head_dim, "dtype": a.dtype,
                "page_size": a.page_size, "pages": pages_needed, "mla": a.mla}
    token_bytes = a.layers * (1 if a.mla else 2) * a.heads * a.head_dim * {"float32": 4, "float8_e4m3fn": 1}.get(a.dtype, 2)
    print(f"kvstage PD demo: prefill TP {a.prefill_tp} -> decode TP {a.decode_tp}, {a.backend}, "
          f"{'staged' if a.staging else 'direct'} path")
    print(f"  model: {a.layers} layers, {a.heads} KV heads x {a.head_dim}, {a.dtype}, page {a.page_size}"
          f"{', MLA' if a.mla else ''}: {token_bytes / 1024:.0f} KiB of KV per token")
    print(f"  {len(requests)} requests, {sum(r['tokens'] for r in requests)} tokens, chunks of {a.chunk_tokens} tokens, "
          f"{a.inflight} in flight")
    common = {"backend": a.backend, "staging": a.staging, "geometry": geometry, "rooms": requests,
              "ring_mb": a.ring_mb, "buffer_mb": a.buffer_mb, "workers": a.workers, "inflight": a.inflight,
              "run_timeout_s": a.timeout, "seed": a.seed}
    t0 = time.time()
    with Cluster(rendezvous=a.bootstrap) as cl:
        common["barrier"] = cl.barrier(a.prefill_tp + a.decode_tp, timeout_s=a.timeout)
        progress = [os.path.join(cl.workdir, f"progress-{r}.json") for r in range(a.decode_tp)]
        for r in range(a.prefill_tp):
            cl.launch([{**common, "role": "prefill", "engine": "prefill-0", "rank": r, "tp": a.prefill_tp}], f"prefill{r}")
        for r in range(a.decode_tp):
            cl.launch([{**common, "role": "decode", "engine": "decode-0", "peer_engine": "prefill-0", "rank": r,
                        "tp": a.decode_tp, "progress": progress[r]}], f"decode{r}")
        where = f"rendezvous {cl.addr}" if a.bootstrap else f"bootstrap server on {cl.addr}"
        print(f"  {where}; {a.prefill_tp + a.decode_tp} rank processes started")
        deadline = time.time() + a.timeout + 60
        tty, shown = sys.stdout.isatty(), -1
        while time.time() < deadline and any(p.proc.poll() is None for p in cl.procs):
            done = min((_read(p) for p in progress), default=0)
            if tty:
                print(bar(done, len(requests), t0), end="", flush=True)
            elif done != shown and (done - shown >= max(1, len(requests) // 8) or done == len(requests)):
                print(bar(done, len(requests), t0).lstrip("\r"), flush=True)
                shown = done
            time.sleep(0.2)
        procs = cl.wait(30)
        if tty:
            print(bar(min(_read(p) for p in progress), len(requests), t0), flush=True)
        summary = summarize(a, requests, procs, token_bytes)
    print_table(summary)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0 if summary["verified"] else 1


def _read(path: str) -> int:
    try:
        return json.load(open(path))["ok"]
    except (OSError, ValueError, KeyError):
        return 0


def summarize(a, requests, procs, token_bytes) -> dict:
    dec, pre, problems = [], [], []
    for p in procs:
        if p.proc.returncode:
            problems.append(f"{os.path.basename(p.log_path)} exited with {p.proc.returncode}:\n{p.log(1500)}")
        for res in p.result():
            if res.get("error"):
                problems.append(f"{res['name']}: {res['error']}")
            (dec if res["role"] == "decode" else pre).append(res)
    per_room: dict[int, list] = {}
    for res in dec:
        for r in res.get("rooms", []):
            per_room.setdefault(r["room"], []).append(r)
    ok = [room for room, recs in per_room.items()
          if len(recs) == a.decode_tp and all(x["state"] == "Success" and x["verified"] for x in recs)]
    failed = sorted(set(r["room"] for r in requests) - set(ok))
    for room in failed[:5]:
        problems.append(f"request {room}: " + "; ".join(f"{x['state']} {x.get('failure') or x.get('error') or ''}"
                                                       for x in per_room.get(room, [])))
    lat = [max(x["latency_s"] for x in recs) for recs in per_room.values() if recs]
    starts = [x["start"] for recs in per_room.values() for x in recs]
    ends = [x["end"] for recs in per_room.values() for x in recs]
    wall = (max(ends) - min(starts)) if starts else float("nan")
    moved = sum(res["stats"].get("bytes_received", 0) for res in dec if "stats" in res)
    writes = sum(res["stats"].get("write_requests", 0) for res in pre if "stats" in res)
    descs = sum(res["stats"].get("descriptors", 0) for res in pre if "stats" in res)
    n = len(requests)
    tokens = sum(r["tokens"] for r in requests)
    return {
        "requests": n, "tokens": tokens, "bytes_moved": moved,
        "expected_bytes": sum(r["pages"] for r in requests) * a.page_size * token_bytes,
        "wall_s": wall, "throughput_gbps": moved / wall / 1e9 if wall else 0.0,
        "latency_p50_ms": float(np.percentile(lat, 50) * 1e3) if lat else None,
        "latency_p99_ms": float(np.percentile(lat, 99) * 1e3) if lat else None,
        "writes_per_request": writes / n, "descriptors_per_request": descs / n,
        "verified": not problems and len(ok) == n, "verified_requests": len(ok), "problems": problems,
        "config": vars(a),
    }


def print_table(s: dict) -> None:
    def row(k, v):
        print(f"  {k:<37} {v}")
    print()
    row("requests", s["requests"])
    row("tokens", s["tokens"])
    row("KV bytes moved (decode side)", f"{s['bytes_moved'] / 2**20:,.1f} MiB")
    row("wall time (first init -> last done)", f"{s['wall_s']:.2f} s")
    row("throughput", f"{s['throughput_gbps']:.2f} GB/s")
    if s["latency_p50_ms"] is not None:
        row("per-request latency p50 / p99", f"{s['latency_p50_ms']:.1f} / {s['latency_p99_ms']:.1f} ms")
    row("write requests per request", f"{s['writes_per_request']:.1f}")
    row("descriptors per request", f"{s['descriptors_per_request']:.1f}")
    row("verification", f"{'PASS' if s['verified'] else 'FAIL'}: {s['verified_requests']}/{s['requests']} requests "
                        f"bit-exact" + ("" if s["bytes_moved"] == s["expected_bytes"] else
                                        f" (moved {s['bytes_moved']} of {s['expected_bytes']} bytes)"))
    for p in s["problems"][:10]:
        print("  ! " + p)


if __name__ == "__main__":
    sys.exit(main())
