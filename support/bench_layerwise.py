"""What layer-wise sending buys: a simulated prefill forward pass, its KV sent whole, per chunk
or layer by layer, alternated in one run, over real NIXL / Mooncake between real processes.

    .venv/bin/python examples/bench_layerwise.py --quick            # 256, 1K, 4K tokens, ~9 min
    .venv/bin/python examples/bench_layerwise.py --json docs/bench/layerwise.json \\
        --plot docs/bench/layerwise.png --rounds 3                   # 256 .. 32K, docs/journal/benchmarks-2026-11.md

Each prefill rank (examples/layerwise_rank.py) plays a GPU engine whose CPU runs ahead: at the
forward start it issues every send() of the request at once, each with a readiness object that
a kvstage thread waits on; the object's synchronize() returns when the simulated GPU finished
that layer (layer l of chunk c is done (c * layers + l + 1) * layer time after the start). The
layer time of a chunk is, unless --layer-ms fixes it, --compute-ratio times one layer's share
of the chunk's transfer, measured first (calibration: the chunk's KV sent per chunk with no
compute, median over a few requests, divided by the layer count): compute and transfer of a
layer take about as long, the regime of real GPU servers. The table's c/t says how close a run
came: where a single-chunk length's c/t is off --compute-ratio by more than --regime-tolerance,
that backend and path run a second time, the stray lengths at the transfer the first pass
measured; the first pass stays in the JSON (run "first-pass") and the report names its c/t.

Modes: whole (one send of every page and layer, ready when the forward pass ends), chunk (each
chunk with all its layers, ready when its last layer is done), layer (each chunk layer by
layer; the room writes groups of EngineConfig.layer_group layers, or on the direct path, with
EngineConfig.layer_batching, writes that size themselves, and a request shorter than
layerwise_min_tokens per chunk). Per request: handover = last layer computed -> decode Success,
total = forward start -> decode Success. Paths: staged (hetero TP, prefill TP 2 -> decode TP 1,
staging on) and direct (equal TP 1 -> 1, staging off). The sweep runs, against per chunk, layer-wise
from 0 tokens with G layers per write (the caller sends G layers at a time to a room with
layer_group=1, layerwise_min_tokens=0 and layer_batching off: the writes layer_group=G makes),
over short lengths:
where layer-wise starts to pay, and which group size pays most (G = a.b.c: growing groups of a,
then b, then c layers until the layers end; docs/journal/benchmarks-2026-11.md says when they pay). The first
request of each (length, mode) up to 4K tokens is an untimed warm-up, verified byte for byte on
the decode rank.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from kvstage.support import bench, cluster, layerwise_rank, layerwise_report

MODES = ("whole", "chunk", "layer")   # as examples/layerwise_rank.py sends them
BACKENDS = ("nixl", "mooncake")
WARMUP_MAX_TOKENS = 4096
PATHS = {"staged": (2, 1, True), "direct": (1, 1, False)}   # prefill TP, decode TP, staging


def _schedules(text: str) -> list[str]:
    out = [s.strip() for s in text.split(",") if s.strip()]
    for s in out:
        layerwise_rank.schedule_ranges(s, 1)   # ValueError (argparse says it) for a bad one
    return out


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", type=bench._choices(BACKENDS), default="nixl,mooncake")
    p.add_argument("--paths", type=bench._choices(tuple(PATHS)), default="staged,direct")
    p.add_argument("--lengths", type=bench._ints, default="256,512,1024,2048,4096,8192,16384,32768",
                   help="tokens per request")
    p.add_argument("--sweep-lengths", type=bench._ints, default="256,512,1024,4096",
                   help="lengths of the sweep of thresholds and group sizes")
    p.add_argument("--sweep-groups", type=_schedules, default="1,2,4,8,16,1.2.4.5.6.7",
                   help="layers per write in the sweep (each layer-wise from 0 tokens, against per chunk); "
                        "a.b.c: growing groups, a layers, then b, then c until the layers end")
    p.add_argument("--no-sweep", action="store_true", help="skip the threshold sweep")
    p.add_argument("--rounds", type=bench._int(1), default=5, help="timed requests per (length, mode)")
    p.add_argument("--chunk-tokens", type=bench._int(1), default=8192, help="chunked prefill size")
    p.add_argument("--layer-ms", type=bench._mb, default=None,
                   help="compute ms per layer per chunk, for every length (default: calibrated per chunk size)")
    p.add_argument("--compute-ratio", type=bench._mb, default=1.0,
                   help="a layer's compute / a layer's measured transfer (calibrated layer time)")
    p.add_argument("--calibration-requests", type=bench._int(1), default=5)
    p.add_argument("--regime-tolerance", type=bench._mb, default=0.15,
                   help="a second pass, at the transfer the first one measured, where a chunk size's c/t is off "
                        "--compute-ratio by more than this fraction")
    p.add_argument("--no-second-pass", action="store_true", help="keep the first pass whatever its c/t")
    p.add_argument("--layer-group", type=bench._int(0), default=None, help="EngineConfig.layer_group (default: its)")
    p.add_argument("--min-tokens", type=bench._int(0), default=None,
                   help="EngineConfig.layerwise_min_tokens of the main run (default: its)")
    p.add_argument("--layer-batching", choices=("on", "off"), default=None,
                   help="EngineConfig.layer_batching of the main run (default: its, KVSTAGE_LAYER_BATCHING or on)")
    bench.add_model_args(p)
    p.add_argument("--quick", action="store_true", help="lengths 256,1024,4096, 3 rounds")
    p.add_argument("--json", default="")
    p.add_argument("--plot", default="", help="a PNG of the table (needs matplotlib: requirements/bench.txt)")
    a = p.parse_args(argv)
    if a.quick:
        a.lengths, a.rounds, a.sweep_lengths, a.sweep_groups = [256, 1024, 4096], min(a.rounds, 3), [256, 512, 1024], ["2", "4", "8"]
    return a


def chunking(a, tokens: int) -> list[int]:
    """Pages per chunk of a request of `tokens`."""
    pages, per = -(-tokens // a.page_size), max(1, a.chunk_tokens // a.page_size)
    return [min(per, pages - i) for i in range(0, pages, per)]


def run_cluster(a, backend: str, path: str, requests: list[dict], *, pages: int, min_tokens: int | None,
                layer_group: int | None, layer_batching: bool | None = None, timeout: float = 900) -> list[dict]:
    """One bootstrap server, the prefill ranks and a decode rank through `requests`; per
    request the prefill rank 0 record joined with the decode record."""
    P, D, staged = PATHS[path]
    geom = {"layers": a.layers, "heads": a.heads, "head_dim": a.head_dim, "dtype": "bfloat16",
            "page_size": a.page_size, "pages": pages}
    mgr = {"backend": backend, "staging": staged, "geometry": geom, "ring_mb": a.ring_mb, "buffer_mb": a.buffer_mb,
           "workers": 2, "run_timeout_s": timeout, "layer_group": layer_group, "layerwise_min_tokens": min_tokens,
           "layer_batching": layer_batching,
           "timeouts": {"room": timeout, "metadata": timeout, "write": 300.0, "watermark": 300.0,
                        "arrival": 60.0, "scatter": 120.0}}
    env = dict(bench.TRANSPORTS[backend][1])
    with cluster.Cluster(env=env) as cl:
        sync = os.path.join(cl.workdir, "sync")
        os.makedirs(sync)
        common = {"bootstrap": cl.addr, "barrier": cl.barrier(P + D, timeout_s=timeout), "sync_dir": sync,
                  "prefill_ranks": P, "requests": requests}
        procs = [launch(cl, {**common, "manager": {**mgr, "role": "prefill", "engine": "pf", "rank": r, "tp": P}},
                        f"p{r}", env) for r in range(P)]
        procs += [launch(cl, {**common, "manager": {**mgr, "role": "decode", "engine": "dc", "peer_engine": "pf",
                                                    "rank": r, "tp": D}}, f"d{r}", env) for r in range(D)]
        cl.wait(timeout + 120)
        results = [p.result() for p in procs]
        bad = [f"{p.log_path}: {res.get('error') or 'no result'} {p.log(1500)}"
               for p, res in zip(procs, results) if not res or res.get("error")]
        dec = {r["room"]: r for r in results[P]["requests"]} if not bad else {}
        out = []
        for rec in ([] if bad else results[0]["requests"]):
            d = dec.get(rec["room"])
            if d is None or rec["state"] != "Success" or d["state"] != "Success" or d["verified"] is False:
                bad.append(f"room {rec['room']}: prefill {rec['state']} {rec['failure']}; decode {d}")
                continue
            out.append({**rec, "t_success": d["t_success"], "verified": d["verified"],
                        "handover_s": d["t_success"] - rec["t_last"], "total_s": d["t_success"] - rec["t0"]})
        if bad:
            raise RuntimeError("layer-wise benchmark run failed:\n" + "\n".join(bad[:6]))
        return out


def launch(cl: cluster.Cluster, spec: dict, name: str, env: dict) -> cluster.RankProc:
    """A layerwise_rank.py process, killed with the cluster."""
    base = os.path.join(cl.workdir, name)
    spec = {**spec, "result": base + ".result.json"}
    bench.save_json(base + ".json", spec)
    log = open(base + ".log", "w")
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve().parents[1] / "examples" / "layerwise_rank.py"), base + ".json"],
                            stdout=log, stderr=subprocess.STDOUT, env=cluster.rank_env(env))
    rp = cluster.RankProc(proc=proc, spec_path=base + ".json", result_path=base + ".result.json",
                          log_path=base + ".log")
    cl.procs.append(rp)
    return rp


def cache_pages(a, lengths: list[int]) -> int:
    return -(-max(lengths) // a.page_size) + 8


def calibrate(a, backend: str, path: str, lengths: list[int]) -> dict[int, float]:
    """Seconds of one layer's share of a chunk's transfer, per chunk size in tokens: chunks sent
    whole with no compute, median of the timed requests over the layer count. The sizes take
    turns request by request, so that a slow spell of the machine does not land on one size's
    requests only (a calibration too fast for one size lets the transfer fall behind there)."""
    sizes = sorted({min(t, a.chunk_tokens) for t in lengths})
    reqs, room = [], 1
    for i in range(a.calibration_requests + 1):
        for t in sizes:
            reqs.append({"room": room, "chunks": chunking(a, t), "mode": "chunk", "layer_s": [0.0], "verify": i == 0,
                         "tokens": t, "warmup": i == 0})
            room += 1
    recs = {r["room"]: r for r in run_cluster(a, backend, path, reqs, pages=cache_pages(a, sizes), min_tokens=None,
                                                 layer_group=a.layer_group)}
    return {t: statistics.median(recs[q["room"]]["handover_s"] for q in reqs if q["tokens"] == t and not q["warmup"])
            / a.layers for t in sizes}


def layer_seconds(a, cal: dict[int, float], tokens: int) -> list[float]:
    """Compute seconds per layer of each chunk of a request."""
    out = []
    for n in chunking(a, tokens):
        t = n * a.page_size
        out.append(a.layer_ms / 1e3 if a.layer_ms is not None else a.compute_ratio * cal[min(t, a.chunk_tokens)])
    return out


def plan(a, cal: dict, lengths: list[int], modes: tuple[str, ...], first_room: int) -> list[dict]:
    """Warm-ups (one per length up to WARMUP_MAX_TOKENS and mode, verified; longer ones would
    cost more to fill and check than to move), then rounds; each round every length, modes in an
    order rotated per round."""
    reqs, room = [], first_room

    def add(t: int, mode: str, rnd: int) -> None:
        nonlocal room
        reqs.append({"room": room, "chunks": chunking(a, t), "mode": mode, "layer_s": layer_seconds(a, cal, t),
                     "verify": rnd < 0, "tokens": t, "round": rnd})
        room += 1
    for t in [t for t in lengths if t <= WARMUP_MAX_TOKENS]:
        for mode in modes:
            add(t, mode, -1)
    for rnd in range(a.rounds):
        order = modes[rnd % len(modes):] + modes[:rnd % len(modes)]
        for t in lengths:
            for mode in order:
                add(t, mode, rnd)
    return reqs


def measure(a, backend: str, path: str, cal: dict, lengths: list[int], modes: tuple[str, ...],
            min_tokens: int | None, layer_group: int | None, label: str,
            layer_batching: bool | None = None) -> list[dict]:
    reqs = plan(a, cal, lengths, modes, 1)
    load0 = os.getloadavg()[0]
    recs = {r["room"]: r for r in run_cluster(a, backend, path, reqs, pages=cache_pages(a, lengths),
                                              min_tokens=min_tokens, layer_group=layer_group,
                                              layer_batching=layer_batching)}
    load1 = os.getloadavg()[0]
    rows = []
    for t in lengths:
        for mode in modes:
            mine = [recs[q["room"]] for q in reqs if q["tokens"] == t and q["mode"] == mode and q["round"] >= 0]
            rows.append({"run": label, "backend": backend, "path": path, "tokens": t, "mode": mode,
                         "chunks": len(chunking(a, t)), "layer_ms": layer_seconds(a, cal, t)[0] * 1e3,
                         "forward_ms": sum(layer_seconds(a, cal, t)) * a.layers * 1e3,
                         "handover_ms": statistics.median(r["handover_s"] for r in mine) * 1e3,
                         "total_ms": statistics.median(r["total_s"] for r in mine) * 1e3,
                         "issue_ms": max(r["issue_s"] for r in mine) * 1e3,
                         "ready_threads": sorted({n for r in mine for n in r["ready_threads"]}),
                         "last_sync_late_ms": statistics.median(r["last_sync_late_s"] for r in mine) * 1e3,
                         "handover_samples_ms": [r["handover_s"] * 1e3 for r in mine],
                         "total_samples_ms": [r["total_s"] * 1e3 for r in mine],
                         "syncs": mine[-1]["syncs"],   # (deadline since t0, called - deadline, returned - deadline)
                         "load": [load0, load1]})
    return rows


def main(argv=None) -> int:
    a = parse(argv)
    res = {"when": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "machine": f"{platform.node()}, {os.cpu_count()} CPUs, loopback", "command": " ".join(sys.argv),
           "args": vars(a), "calibration": {}, "first_calibration": {}, "rows": [], "load_start": os.getloadavg()}
    sweep = [] if a.no_sweep else a.sweep_lengths
    t_start = time.time()
    for backend in a.backends:
        for path in a.paths:
            key = f"{backend}/{path}"
            say = lambda what: print(f"[{time.time() - t_start:6.0f}s] {key}: {what}", flush=True)  # noqa: E731
            cal = {}
            if a.layer_ms is None:
                say("calibration (per chunk, no compute)")
                cal = calibrate(a, backend, path, sorted(set(a.lengths) | set(sweep)))
                res["calibration"][key] = {str(t): s * 1e3 for t, s in cal.items()}
                say("one layer's transfer, ms: " + ", ".join(f"{t}: {s * 1e3:.3f}" for t, s in cal.items()))
            say("whole / per chunk / layer-wise")
            batching = None if a.layer_batching is None else a.layer_batching == "on"
            rows = measure(a, backend, path, cal, a.lengths, MODES, a.min_tokens, a.layer_group, "main", batching)
            better = None if a.layer_ms is not None or a.no_second_pass else layerwise_report.recalibration(
                a, {(r["tokens"], r["mode"]): r for r in rows}, cal, a.regime_tolerance)
            if better is not None:
                say("c/t strayed: a second pass, one layer's transfer as the first measured it, ms: "
                    + ", ".join(f"{t}: {s * 1e3:.3f}" for t, s in better.items()))
                for r in rows:
                    r["run"] = "first-pass"
                res["first_calibration"][key] = res["calibration"][key]
                res["calibration"][key] = {str(t): s * 1e3 for t, s in better.items()}
                cal = better
                rows += measure(a, backend, path, cal, a.lengths, MODES, a.min_tokens, a.layer_group, "main",
                                batching)
            res["rows"] += rows
            if sweep:
                say("sweep of thresholds and group sizes (layer_group=1, layerwise_min_tokens=0, layer_batching "
                    "off, G layers per send)")
                modes = ("chunk",) + tuple(f"group-{g}" for g in a.sweep_groups)
                res["rows"] += measure(a, backend, path, cal, sweep, modes, 0, 1, "sweep", False)
    res["wall_s"], res["load_end"] = time.time() - t_start, os.getloadavg()
    lines = layerwise_report.report(a, res)
    lines += [""] + layerwise_report.ascii_chart(a, res)
    print("\n".join(lines))
    res["report"] = lines
    if a.plot:
        print(layerwise_report.plot(a, res, a.plot) or "matplotlib is not installed (requirements/bench.txt): no plot")
    if a.json:
        bench.save_json(a.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
