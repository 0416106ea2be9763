"""Compare runs of examples/bench.py made before and after a change, side by side.

    python examples/bench_compare.py --before b1.json b2.json b3.json --after a1.json a2.json a3.json

Runs should alternate (before, after, before, ...) on an otherwise idle machine. For every
figure the runs share (throughput per transport, path and length; rooms in flight; one-page
latency) it prints the median of each side, the after/before ratio, and each side's spread
(max/min over its runs), so a change is judged against the noise between runs of one side.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys


def figures(run: dict) -> dict[tuple, float]:
    """(section, transport, what, size) -> value; GB/s for throughput, ms for latency."""
    out = {}
    for r in run.get("lengths", []):
        out[("GB/s", r["transport"], r["path"], r["tokens"])] = r["gbps"]
    for r in run.get("inflight", []):
        out[("GB/s in flight", r["transport"], r["path"], r["inflight"])] = r["gbps"]
    for name, r in run.get("latency", {}).items():
        out[("p50 ms", name, "one page", 1)] = r["p50_ms"]
        out[("p99 ms", name, "one page", 1)] = r["p99_ms"]
    return out


def compare(before: list[dict], after: list[dict]) -> list[str]:
    b, a = [figures(r) for r in before], [figures(r) for r in after]
    keys = sorted(set.intersection(*(set(x) for x in b + a)), key=lambda k: (k[1], k[0], k[2], k[3]))
    lines = [f"{'figure':44} {'before':>9} {'after':>9} {'after/before':>13} {'spread b':>9} {'spread a':>9}"]
    for k in keys:
        vb, va = [x[k] for x in b], [x[k] for x in a]
        mb, ma = statistics.median(vb), statistics.median(va)
        ratio = ma / mb if mb else float("nan")
        name = f"{k[1]} {k[2]} {k[3]} ({k[0]})"
        lines.append(f"{name:44} {mb:9.3f} {ma:9.3f} {ratio:12.2f}x {max(vb) / min(vb):8.2f}x "
                     f"{max(va) / min(va):8.2f}x")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", nargs="+", required=True, help="bench.py --json files of the old code")
    p.add_argument("--after", nargs="+", required=True, help="bench.py --json files of the new code")
    a = p.parse_args(argv)
    runs = {side: [json.load(open(f)) for f in files] for side, files in (("before", a.before), ("after", a.after))}
    print("\n".join(compare(runs["before"], runs["after"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
