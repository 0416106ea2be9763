"""Tables, goal checks, the threshold verdict and the charts of examples/bench_layerwise.py,
from its result rows (pure: rows in, lines out; the PNG needs matplotlib)."""

from __future__ import annotations

import os

GOAL_HANDOVER = 1 / 3     # layer-wise / per-chunk handover, single-chunk requests of 1K tokens and more
GOAL_TOTAL_4K = 0.7       # layer-wise / per-chunk forward start -> Success at 4K tokens
NO_LOSS = 1.05            # below the threshold: layer-wise / per-chunk within the noise of a run
PAYS = 0.95               # threshold sweep: layer-wise pays when its total is at most this x per chunk


def _rows(res: dict, run: str, backend: str, path: str) -> dict:
    return {(r["tokens"], r["mode"]): r for r in res["rows"]
            if r["run"] == run and r["backend"] == backend and r["path"] == path}


def _ratio(rows: dict, t: int, what: str, mode: str = "layer") -> float | None:
    lay, chk = rows.get((t, mode)), rows.get((t, "chunk"))
    return lay[what] / chk[what] if lay and chk and chk[what] > 0 else None


def _threshold(a) -> int:
    return a.min_tokens if a.min_tokens is not None else _default_min_tokens()


def _default_min_tokens() -> int:
    from kvstage.transfer.config import DEFAULT_LAYERWISE_MIN_TOKENS
    return DEFAULT_LAYERWISE_MIN_TOKENS


def _default_group() -> int:
    from kvstage.transfer.config import DEFAULT_LAYER_GROUP
    return DEFAULT_LAYER_GROUP


def _batching(a) -> str:
    if a.layer_batching is not None:
        return a.layer_batching
    from kvstage.transfer.config import LAYER_BATCHING_ENV, env_flag
    return "on" if env_flag(LAYER_BATCHING_ENV, True) else "off"


def report(a, res: dict) -> list[str]:
    lines: list[str] = []
    w = lines.append
    group = a.layer_group if a.layer_group is not None else _default_group()
    w(f"layer-wise sending benchmark {res['when']} on {res['machine']}; wall {res['wall_s']:.0f} s")
    w(f"command: {res['command']}")
    w(f"load average (1 min) at start {res['load_start'][0]:.2f}, at end {res['load_end'][0]:.2f}")
    w(f"model: {a.layers} layers, {a.heads} KV heads x {a.head_dim}, bf16, page {a.page_size}; chunked prefill "
      f"{a.chunk_tokens} tokens; layer_group {group}, layerwise_min_tokens {_threshold(a)}, layer_batching "
      f"{_batching(a)} (direct); {a.rounds} rounds")
    w("compute per layer per chunk: " + (f"{a.layer_ms} ms (fixed)" if a.layer_ms is not None else
      f"{a.compute_ratio} x one layer's measured transfer of the chunk (calibration below)"))
    for key, cal in res["calibration"].items():
        first = res.get("first_calibration", {}).get(key)
        w(f"  calibration {key}: one layer's transfer, ms: " + ", ".join(f"{t}: {v:.3f}" for t, v in cal.items())
          + (" (from a first pass whose c/t strayed; calibrated: "
             + ", ".join(f"{t}: {v:.3f}" for t, v in first.items()) + ")" if first else ""))
        if first:
            backend, path = key.split("/")
            rows = _rows(res, "first-pass", backend, path)
            w(f"  first pass {key}: c/t " + ", ".join(
                f"{t}: {regime(r['layer_ms'], r['handover_ms'], a.layers):.2f}"
                for (t, m), r in sorted(rows.items()) if m == "chunk"))
    for backend in a.backends:
        for path in a.paths:
            rows = _rows(res, "main", backend, path)
            if rows:
                w("")
                table(a, rows, backend, path, w)
    sweep = [(b, p) for b in a.backends for p in a.paths if _rows(res, "sweep", b, p)]
    if sweep:
        w("")
        w(f"sweep: layer-wise from 0 tokens, G layers per write, against per chunk (layer-wise pays at "
          f"<= {PAYS}x)")
        for backend, path in sweep:
            sweep_table(a, _rows(res, "sweep", backend, path), backend, path, w)
    w("")
    w(f"goals: layer-wise handover <= {GOAL_HANDOVER:.2f}x per chunk (single chunk, >= 1K tokens); forward "
      f"start -> Success <= {GOAL_TOTAL_4K}x at 4K; below the threshold no loss (<= {NO_LOSS}x)")
    lines += ["  " + g for g in goals(a, res)]
    return lines


def table(a, rows: dict, backend: str, path: str, w) -> None:
    P = 2 if path == "staged" else 1
    w(f"== {backend} {path} (prefill TP {P} -> decode TP 1): medians, ms")
    w(f"{'tokens':>7} {'chunks':>6} {'layer':>7} {'forward':>8} {'c/t':>5} | {'handover: whole':>15} {'chunk':>8} {'layer':>8} "
      f"{'l/c':>6} | {'start->Success: whole':>21} {'chunk':>8} {'layer':>8} {'l/c':>6}")
    for t in sorted({t for t, _ in rows}):
        g = lambda m, k: rows[(t, m)][k] if (t, m) in rows else float("nan")  # noqa: E731
        any_row = next(r for (tt, _), r in rows.items() if tt == t)
        rh, rt = _ratio(rows, t, "handover_ms"), _ratio(rows, t, "total_ms")
        w(f"{t:7d} {any_row['chunks']:6d} {any_row['layer_ms']:7.3f} {any_row['forward_ms']:8.1f} "
          f"{regime(any_row['layer_ms'], g('chunk', 'handover_ms'), a.layers):5.2f} | "
          f"{g('whole', 'handover_ms'):15.1f} {g('chunk', 'handover_ms'):8.1f} {g('layer', 'handover_ms'):8.1f} "
          f"{rh if rh is not None else float('nan'):6.2f} | {g('whole', 'total_ms'):21.1f} "
          f"{g('chunk', 'total_ms'):8.1f} {g('layer', 'total_ms'):8.1f} {rt if rt is not None else float('nan'):6.2f}")
    w("   (c/t: a layer's compute over a layer's transfer as measured in this run, the per-chunk handover over "
      "the layer count; the goals are set for about 1, and above it the transfer keeps up more easily)")
    issue = max(r["issue_ms"] for r in rows.values())
    w(f"   (the caller issued every send of a request within {issue:.2f} ms of the forward start, never waiting "
      f"for a layer)")


def regime(layer_ms: float, chunk_handover_ms: float, layers: int) -> float:
    """A layer's compute over a layer's transfer as the run measured it (the last chunk's
    per-chunk handover over the layer count): the calibration sets it to --compute-ratio, but
    a machine that moves bytes faster or slower later in the run shifts it."""
    if not chunk_handover_ms > 0:
        return float("nan")
    return layer_ms * layers / chunk_handover_ms


def recalibration(a, rows: dict, cal: dict[int, float], tolerance: float) -> dict[int, float] | None:
    """One layer's transfer per chunk size for a second pass, when this pass's c/t strayed from
    --compute-ratio by more than `tolerance` (a fraction) at some size; else None. Only sizes
    with a single-chunk row are judged. A stray size takes the transfer this pass measured (its
    per-chunk handover over the layer count), the others keep their calibration. Why: the
    calibration runs first, in a cluster of its own, and on this machine it can land 10 to 75 %
    off the pass it calibrates."""
    new, strayed = dict(cal), False
    for size in cal:
        chunk = rows.get((size, "chunk"))
        if chunk is None or chunk["chunks"] != 1 or not chunk["handover_ms"] > 0:
            continue
        if abs(regime(chunk["layer_ms"], chunk["handover_ms"], a.layers) / a.compute_ratio - 1) > tolerance:
            new[size], strayed = chunk["handover_ms"] / 1e3 / a.layers, True
    return new if strayed else None


def sweep_table(a, rows: dict, backend: str, path: str, w) -> None:
    groups = sorted({m.split("-", 1)[1] for _, m in rows if m.startswith("group-")},
                    key=lambda g: (g.count("."), [int(x) for x in g.split(".")]))
    w(f"-- {backend} {path}: per chunk start->Success ms, then per G layers per write: layer-wise/per-chunk "
      f"start->Success (handover)")
    w(f"   {'tokens':>6} {'chunk ms':>9} | " + " ".join(f"{'G=' + g:>13}" for g in groups) + " | best G")
    for t in sorted({t for t, _ in rows}):
        ratios = {g: (_ratio(rows, t, "total_ms", f"group-{g}"), _ratio(rows, t, "handover_ms", f"group-{g}"))
                  for g in groups}
        best = min(groups, key=lambda g: ratios[g][0])
        w(f"   {t:>6} {rows[(t, 'chunk')]['total_ms']:9.1f} | "
          + " ".join(f"{rt:6.2f} ({rh:4.2f})" for rt, rh in ratios.values()) + f" | {best}")
    for g in groups:
        w(f"   supported layerwise_min_tokens with G={g}: {supported_threshold(rows, f'group-{g}')}")


def supported_threshold(rows: dict, mode: str = "layer") -> str:
    """The shortest sweep length from which layer-wise pays at every longer sweep length."""
    lengths = sorted({t for t, m in rows if m == mode})
    pays = [(r := _ratio(rows, t, "total_ms", mode)) is not None and r <= PAYS for t in lengths]
    for i, t in enumerate(lengths):
        if all(pays[i:]):
            return f"{t} (layer-wise pays from {t} tokens)" if i else f"<= {t} (pays at every length swept)"
    return f"> {lengths[-1]} (layer-wise does not pay at any length swept)"


def goals(a, res: dict) -> list[str]:
    out = []
    threshold = _threshold(a)
    for backend in a.backends:
        for path in a.paths:
            rows = _rows(res, "main", backend, path)
            for t in sorted({t for t, _ in rows}):
                chunks = rows.get((t, "chunk"), {}).get("chunks")
                rh, rt = _ratio(rows, t, "handover_ms"), _ratio(rows, t, "total_ms")
                if rh is None or rt is None:
                    continue
                if t < threshold:
                    out.append(f"{'PASS' if rt <= NO_LOSS else 'MISS'} {backend} {path} {t}: below the threshold, "
                               f"start->Success {rt:.2f}x per chunk")
                if t >= 1024 and chunks == 1:
                    out.append(f"{'PASS' if rh <= GOAL_HANDOVER else 'MISS'} {backend} {path} {t}: handover "
                               f"{rh:.2f}x per chunk")
                if t == 4096:
                    out.append(f"{'PASS' if rt <= GOAL_TOTAL_4K else 'MISS'} {backend} {path} {t}: start->Success "
                               f"{rt:.2f}x per chunk")
    return out


def ascii_chart(a, res: dict, width: int = 40) -> list[str]:
    """Forward start -> Success of layer-wise over per chunk, one bar per length (| marks 1.0)."""
    out = ["layer-wise / per-chunk, forward start -> Success (bar: ratio; '|' at 1.0; h = handover ratio)"]
    for backend in a.backends:
        for path in a.paths:
            rows = _rows(res, "main", backend, path)
            if not rows:
                continue
            out.append(f"{backend} {path}")
            for t in sorted({t for t, _ in rows}):
                rt, rh = _ratio(rows, t, "total_ms"), _ratio(rows, t, "handover_ms")
                if rt is None:
                    continue
                n = max(0, min(width, round(rt * width / 1.2)))
                mark = round(width / 1.2)
                bar = "".join("#" if i < n else ("|" if i == mark else " ") for i in range(width + 1))
                out.append(f"  {t:>6} {bar} {rt:4.2f}  (h {rh:4.2f})")
    return out


def plot(a, res: dict, path: str) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    combos = [(b, p) for b in a.backends for p in a.paths if _rows(res, "main", b, p)]
    fig, axes = plt.subplots(2, len(combos), figsize=(4.2 * len(combos), 7), squeeze=False)
    for col, (backend, p) in enumerate(combos):
        rows = _rows(res, "main", backend, p)
        lengths = sorted({t for t, _ in rows})
        for row, what, title in ((0, "handover_ms", "handover (last layer -> Success)"),
                                 (1, "total_ms", "forward start -> Success")):
            ax = axes[row][col]
            for mode, style in (("whole", "^:"), ("chunk", "s--"), ("layer", "o-")):
                ax.plot(lengths, [rows[(t, mode)][what] for t in lengths], style, label=mode)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{backend} {p}: {title}", fontsize=9)
            ax.set_xlabel("tokens per request")
            ax.set_ylabel("ms (median)")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=100)
    return path
