"""Where the time of one request goes: the phase breakdown of its timeline
(`handle.metrics().timeline`) on the prefill rank and on a decode rank, for a one-page and a
2048-token request, staged and direct (prefill TP 1 -> decode TP 2). Part of examples/bench.py
(`--sections phases`).

One request at a time, after one untimed warm-up request of each length; each phase is the
median over the timed requests of the seconds since the phase before it. The bars start where
both sides are engaged, at `metadata` (prefill: the decode side's metadata arrived; decode: it
sent its metadata): what comes before is the benchmark's own pacing between requests (the
prefill sender is created before the decode side reaches the request), not the engine's.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from kvstage.support.figure_legend import legend_below
from kvstage.transfer.timeline import PHASES, Timeline

PATHS = ("staged", "direct")
FROM = "metadata"      # bars start here (see above)
COLORS = {"init": "#bbbbbb", "metadata": "#999999", "first_write": "#4c72b0", "last_write": "#dd8452",
          "scattered": "#55a868", "ended": "#c44e52"}
LABELS = {"first_write": "until the first write (prefill: posted; decode: landed)",
          "last_write": "until the last write (prefill: completed; decode: landed)",
          "scattered": "until the last piece is scattered (decode, staged)",
          "ended": "until Success (prefill: the decode side's confirmation)"}


def run(a, transport: str, path: str, run_ranks) -> list[dict]:
    """One cluster for `path`; a row per (length, side) with the median phases in seconds.
    `run_ranks` is bench.run_ranks (passed in: this module is imported by bench.py)."""
    lengths = list(a.phase_lengths)
    rooms, length_of, room_id = [], {}, 1
    for tokens in lengths:
        pages = -(-tokens // a.page_size)
        for rep in range(a.phase_requests + 1):           # the first of each length is a warm-up
            rooms.append({"room": room_id, "pages": pages, "chunks": [pages], "drain_before": True})
            length_of[room_id] = tokens if rep else None
            room_id += 1
    geom = {"layers": a.layers, "heads": a.heads, "head_dim": a.head_dim, "dtype": "bfloat16",
            "page_size": a.page_size, "pages": -(-max(lengths) // a.page_size) + 8}
    verify = [next(r for r, t in length_of.items() if t == tokens) for tokens in lengths]
    pre, dec = run_ranks(a, transport, 1, 2, path == "staged", rooms, geom, verify=verify)
    out = []
    for side, result in (("prefill", pre[0]), ("decode", dec[0])):
        for tokens in lengths:
            timelines = [Timeline(**r["metrics"]["timeline"]) for r in result["rooms"]
                         if length_of[r["room"]] == tokens]
            out.append({"transport": transport, "path": path, "tokens": tokens, "side": side,
                        "requests": len(timelines), "phases": median_phases(timelines)})
    return out


def median_phases(timelines: list[Timeline]) -> dict[str, float]:
    """Phase -> median seconds since the phase before it (phases every timeline has)."""
    per: dict[str, list[float]] = {}
    for t in timelines:
        for name, seconds in t.segments():
            per.setdefault(name, []).append(seconds)
    return {name: statistics.median(v) for name, v in per.items() if len(v) == len(timelines)}


def shown(phases: dict[str, float]) -> list[tuple[str, float]]:
    """The phases after FROM, in their usual order."""
    after = PHASES[PHASES.index(FROM) + 1:]
    return [(p, phases[p]) for p in after if p in phases and p != "init"]


def report(rows: list[dict]) -> list[str]:
    lines = []
    if not rows:
        return lines
    lines.append("")
    lines.append("== where the time of one request goes (median ms per phase, since the phase before it)")
    cols = [p for p in PHASES if p != "created"]
    lines.append(f"{'transport':>9} {'path':>6} {'tokens':>6} {'side':>7} " + " ".join(f"{c:>11}" for c in cols))
    for r in rows:
        cells = " ".join(f"{r['phases'][c] * 1e3:11.3f}" if c in r["phases"] else f"{'-':>11}" for c in cols)
        lines.append(f"{r['transport']:>9} {r['path']:>6} {r['tokens']:6d} {r['side']:>7} {cells}")
    return lines


def plot(rows: list[dict], out_dir: str, plt) -> list[str]:
    """One figure per transport: a panel per length, a bar per (path, side), stacked phases."""
    made = []
    for transport in dict.fromkeys(r["transport"] for r in rows):
        mine = [r for r in rows if r["transport"] == transport]
        lengths = list(dict.fromkeys(r["tokens"] for r in mine))
        fig, axes = plt.subplots(len(lengths), 1, figsize=(9, 1.1 + 1.6 * len(lengths)), squeeze=False)
        for ax, tokens in zip(axes[:, 0], lengths):
            bars = [r for path in PATHS for side in ("prefill", "decode") for r in mine
                    if (r["path"], r["side"], r["tokens"]) == (path, side, tokens)]
            for y, r in enumerate(bars):
                left = 0.0
                for phase, seconds in shown(r["phases"]):
                    ax.barh(y, seconds * 1e3, left=left, color=COLORS[phase], edgecolor="white",
                            label=LABELS.get(phase, phase) if y == 0 or phase == "scattered" else None)
                    left += seconds * 1e3
                ax.text(left, y, f" {left:.2f} ms", va="center", fontsize=8)
            ax.set_yticks(range(len(bars)), [f"{r['path']} {r['side']}" for r in bars], fontsize=8)
            ax.invert_yaxis()
            ax.set_xlim(0, ax.get_xlim()[1] * 1.15)
            ax.set_title(f"{transport}: a {tokens}-token request, prefill TP 1 -> decode TP 2, from '{FROM}'",
                         fontsize=9)
            ax.set_xlabel("ms (median of each phase)", fontsize=8)
            ax.grid(True, axis="x", alpha=0.3)
        legend_below(fig, axes, ncol=2, bottom=0.12)
        path = str(Path(out_dir) / f"phases_{transport}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        made.append(path)
    return made
