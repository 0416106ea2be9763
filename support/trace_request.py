"""The critical path of one request across both processes: every hop with its time.

    PYTHONPATH=.. .venv/bin/python examples/trace_request.py                  # staged, NIXL
    .venv/bin/python examples/trace_request.py --path direct --backend mooncake
    .venv/bin/python examples/trace_request.py --save docs/bench/trace-one-page

Starts a bootstrap server, a prefill rank and the decode ranks (prefill TP 1 -> decode TP
`--decode-tp`: 2 staged, as examples/bench.py's staged runs, since the staged path needs the TP
sizes to differ; 1 direct, as its one-page latency) as processes of their own, with the hop trace
on (KVSTAGE_TRACE, hop_trace.py). As in examples/bench.py's one-page latency, the prefill side
sends every request at once and the decode side runs them one at a time, init() until wait()
returns (the decode ranks init() each request together, as one step of a TP engine would):
`--warmup` one-page requests, then the traced ones: a one-page request and a multi-piece request
(`--pages` pages, cut into pieces of `--piece-mb` on the staged path). The ranks write their
trace files when they close; they are merged into one timeline (one clock: CLOCK_MONOTONIC of
this host), and each traced request's hops are printed from the decode caller's init() on,
counted, and drawn (`--save PREFIX`: PREFIX.txt and PREFIX.png; docs/trace.md).
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
import tempfile
from pathlib import Path

from kvstage.hop_trace import ENV
from kvstage.support import hop_report
from kvstage.support.cluster import Cluster

ONE_PAGE, MULTI = "one-page request", "multi-piece request"


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--path", choices=("staged", "direct"), default="staged")
    p.add_argument("--backend", choices=("nixl", "mooncake"), default="nixl")
    p.add_argument("--decode-tp", type=int, default=None,
                   help="decode ranks, prefill TP being 1 (default: 2 staged, which needs the TP sizes to differ; "
                        "1 direct, as bench.py's one-page latency)")
    p.add_argument("--warmup", type=int, default=5, help="untraced one-page requests first")
    p.add_argument("--pages", type=int, default=8, help="pages of the multi-piece request")
    p.add_argument("--piece-mb", type=float, default=0.5, help="staging piece size (MiB)")
    p.add_argument("--ring-mb", type=int, default=64, help="each decode rank's staging ring (MiB)")
    p.add_argument("--buffer-mb", type=int, default=8, help="each transfer worker's staging buffer (MiB)")
    p.add_argument("--credits", action=argparse.BooleanOptionalAction, default=None,
                   help="ring credits on or off (default: KVSTAGE_CREDITS, on)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where every rank's KV cache, ring and buffers live (cuda: VRAM of GPU 0)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--save", default=None, help="write PREFIX.txt (what is printed) and PREFIX.png")
    p.add_argument("--trace-dir", default=None, help="where the ranks write their trace files (default: a temp dir)")
    a = p.parse_args(argv)
    if a.decode_tp is None:
        a.decode_tp = 2 if a.path == "staged" else 1
    return a


def run(a: argparse.Namespace, trace_dir: str) -> dict[str, int]:
    """The ranks, to the end; returns the traced rooms by name. Raises if a request failed."""
    rooms = [{"room": i + 1, "pages": 1, "chunks": [1]} for i in range(a.warmup)]
    traced = {ONE_PAGE: a.warmup + 1, MULTI: a.warmup + 2}
    rooms += [{"room": traced[ONE_PAGE], "pages": 1, "chunks": [1]},
              {"room": traced[MULTI], "pages": a.pages, "chunks": [a.pages]}]
    geom = {"layers": a.layers, "heads": a.heads, "head_dim": a.head_dim, "dtype": "bfloat16",
            "page_size": a.page_size, "pages": 64 * max(1, a.pages) + 8}
    common = {"backend": a.backend, "staging": a.path == "staged", "geometry": geom, "rooms": rooms,
              "run_timeout_s": a.timeout, "workers": 2, "piece_mb": a.piece_mb, "ring_mb": a.ring_mb, "buffer_mb": a.buffer_mb,
              "bench": {"mode": "latency", "verify": list(traced.values())}, "credits": a.credits,
              "device": "cuda:0" if a.device == "cuda" else "cpu"}
    with Cluster(env={ENV: trace_dir}) as cl:
        common["barrier"] = cl.barrier(1 + a.decode_tp, timeout_s=a.timeout)
        meet = Path(cl.workdir, "meet")   # the decode ranks init() each request together
        meet.mkdir()
        common["bench"]["meet"] = {"dir": str(meet), "count": a.decode_tp, "timeout_s": a.timeout}
        procs = [cl.launch([{**common, "role": "prefill", "engine": "pf", "rank": 0, "tp": 1}], "p0")]
        procs += [cl.launch([{**common, "role": "decode", "engine": "dc", "peer_engine": "pf", "rank": r,
                             "tp": a.decode_tp}], f"d{r}") for r in range(a.decode_tp)]
        cl.wait(a.timeout + 60)
        bad = []
        for p in procs:
            res = p.result()
            if not res or res[0].get("error"):
                bad.append(f"{p.log_path}: {res[0].get('error') if res else 'no result'} {p.log(800)}")
                continue
            bad += [f"room {r['room']}: {r['state']} {r.get('failure')}" for r in res[0]["rooms"]
                    if r["state"] != "Success" or r["verified"] is False]
        if bad:
            raise RuntimeError("the traced run failed:\n" + "\n".join(bad[:10]))
    return traced


def report(a: argparse.Namespace, records, traced: dict[str, int]) -> tuple[list[str], list[tuple[str, list]]]:
    """The printed lines and, per traced request, (title, its hops from the origin on)."""
    lines = [f"kvstage hop trace, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, commit "
             f"{_commit()}", f"command: {' '.join(['examples/trace_request.py'] + sys.argv[1:])}",
             f"{a.path} path, backend {a.backend}, KV caches on {a.device}, prefill TP 1 -> decode TP {a.decode_tp}; {a.layers} layers, "
             f"{a.heads} KV heads x {a.head_dim}, bf16, page {a.page_size} "
             f"({a.page_size * a.layers * 2 * a.heads * a.head_dim * 2 // 1024} KiB a page); piece {a.piece_mb:g} MiB",
             "clock: CLOCK_MONOTONIC, one for both processes (same host); ms since the decode caller's init()"]
    drawn, summaries = [], []
    for name, room in traced.items():
        before, hops = hop_report.request_hops(records, room)
        pages = 1 if name == ONE_PAGE else a.pages
        title = f"{name} (room {room}, {pages} page{'s' if pages > 1 else ''}, {a.path}, {a.backend})"
        lines += ["", f"== {title}"]
        if not hops:
            lines.append("   no hops recorded")
            continue
        t0 = hops[0].t_ns
        if before:
            lines.append(f"   before init(), the prefill side (ready long before, as in bench.py's latency): "
                         f"{len(before)} hops, e.g. " + ", ".join(f"{r.kind.value} {r.detail}" for r in before[:4]))
        lines += hop_report.timeline_lines(hops, t0)
        summaries += hop_report.summary_lines(name, hops)
        drawn.append((title, hops))
    lines += ["", "== counts"] + summaries
    return lines, drawn


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None) -> int:
    a = parse(argv)
    trace_dir = a.trace_dir or tempfile.mkdtemp(prefix="kvstage-trace-")
    traced = run(a, trace_dir)
    records = hop_report.load_dir(trace_dir)
    lines, drawn = report(a, records, traced)
    print("\n".join(lines))
    if a.save:
        Path(a.save).parent.mkdir(parents=True, exist_ok=True)
        Path(a.save + ".txt").write_text("\n".join(lines) + "\n")
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib is not installed (requirements/bench.txt): no picture")
            return 0
        print(f"wrote {a.save}.txt and {hop_report.plot(drawn, a.save + '.png', plt)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
