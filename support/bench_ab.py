"""Two or more trees of kvstage measured side by side in one run: the rounds alternate the trees
(A B, then B A, ...), each measurement a fresh process running that tree's own benchmark code,
and the table gives each figure's median and range per tree and the ratio to the first tree.
This is how a change is shown faster or not (docs/benchmarks.md): alternated rounds, never a
figure against one measured at another time.

    python examples/bench_ab.py --rev 11ead45 --rev HEAD --rounds 4 --measure staged-latency,staged-lengths
    python examples/bench_ab.py --tree before=/tmp/old/kvstage --tree after=. --device cuda --lengths 2048,8192

`--rev R` checks commit R out into a temporary git worktree (removed at the end); `--tree
LABEL=DIR` takes a kvstage tree as it is (a directory holding the package's files, e.g. an
exported old tree on a GPU machine, where the checkout has no git metadata). Each measurement
imports `kvstage` from the tree it measures, through PYTHONPATH; it calls only what
`support/bench.py` has long offered (`parse`, `latency`, `length_sweep`), so older trees run too.

Measurements (`--measure`, comma-separated):
  staged-latency   one page, staged P1 -> D2 (bench.py's latency section, `--latency-path staged`)
  direct-latency   one page, direct P1 -> D1
  staged-lengths   staged P1 -> D2 at each of `--lengths`, one request in flight
Figures: p50 and p99 (ms) of each latency, the median time (ms) and GB/s of each length.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

MEASURES = ("staged-latency", "direct-latency", "staged-lengths")

#: what runs in the measured tree's process: argv[1] is a JSON object (measure, device, transport,
#: requests, lengths); it prints one JSON object of figures
INNER = r"""
import json, sys
from kvstage.support import bench
spec = json.loads(sys.argv[1])
base = ["--device", spec["device"], "--transports", spec["transport"]]
out = {}
if spec["measure"].endswith("-latency"):
    path = spec["measure"].split("-")[0]
    a = bench.parse(base + ["--latency-requests", str(spec["requests"]), "--latency-path", path])
    r = bench.latency(a, spec["transport"])
    out = {"p50_ms": r["p50_ms"], "p99_ms": r["p99_ms"]}
else:
    a = bench.parse(base + ["--lengths", ",".join(map(str, spec["lengths"]))])
    for row in bench.length_sweep(a, spec["transport"], "staged"):
        out[f"{row['tokens']}_ms"] = row["seconds"] * 1e3
        out[f"{row['tokens']}_gbps"] = row["gbps"]
print("BENCH_AB " + json.dumps(out))
"""


@dataclass(frozen=True)
class Tree:
    """A tree to measure: its label and the directory PYTHONPATH must name for `import kvstage`
    to find it (the parent of a directory called kvstage)."""

    label: str
    path_entry: str


def round_order(trees: list[Tree], rnd: int) -> list[Tree]:
    """A B C in even rounds, C B A in odd ones: drift over the run weighs on every tree alike."""
    return list(trees) if rnd % 2 == 0 else list(reversed(trees))


def summarize(samples: dict[str, dict[str, list[float]]], first: str) -> list[str]:
    """One line per figure: per tree its median and [min-max] over the rounds, and the median's
    ratio to the first tree's."""
    figures = sorted({f for per in samples.values() for f in per})
    out = []
    for f in figures:
        cells = []
        base = statistics.median(samples[first][f]) if samples[first].get(f) else None
        for label, per in samples.items():
            vals = per.get(f)
            if not vals:
                cells.append(f"{label} -")
                continue
            med = statistics.median(vals)
            ratio = f" ({med / base:.2f}x)" if base and label != first else ""
            cells.append(f"{label} {med:.3f} [{min(vals):.3f}-{max(vals):.3f}]{ratio}")
        out.append(f"{f:24s} " + "  ".join(cells))
    return out


def package_entry(directory: str, scratch: str, label: str) -> str:
    """The PYTHONPATH entry under which `directory` (a kvstage tree) imports as kvstage: its
    parent when it is called kvstage, else a scratch directory holding a link of that name."""
    d = Path(directory).resolve()
    if not (d / "__init__.py").exists():
        raise SystemExit(f"bench_ab: {directory} is not a kvstage tree (no __init__.py)")
    if d.name == "kvstage":
        return str(d.parent)
    link_dir = Path(scratch) / f"tree-{label}"
    link_dir.mkdir(parents=True, exist_ok=True)
    (link_dir / "kvstage").symlink_to(d)
    return str(link_dir)


@contextmanager
def trees_of(revs: list[str], dirs: list[str], repo: Path) -> Iterator[list[Tree]]:
    """The trees named by `--rev` (git worktrees, removed afterwards) and `--tree LABEL=DIR`."""
    scratch = tempfile.mkdtemp(prefix="kvstage-ab-")
    made: list[Path] = []
    try:
        out = []
        for rev in revs:
            where = Path(scratch) / f"rev-{len(made)}" / "kvstage"
            subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", "-f", str(where), rev],
                           check=True, capture_output=True)
            made.append(where)
            out.append(Tree(rev, str(where.parent)))
        for spec in dirs:
            label, sep, directory = spec.partition("=")
            if not sep or not label or not directory:
                raise SystemExit(f"bench_ab: --tree takes LABEL=DIR, got {spec!r}")
            out.append(Tree(label, package_entry(directory, scratch, label)))
        if len({t.label for t in out}) != len(out):
            raise SystemExit("bench_ab: two trees have the same label")
        yield out
    finally:
        for where in made:
            subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(where)], capture_output=True)


def measure(tree: Tree, spec: dict, timeout: float) -> dict[str, float]:
    """One measurement in a fresh process of `tree`: its figures."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (tree.path_entry, os.environ.get("PYTHONPATH"))
                                                         if p)}
    res = subprocess.run([sys.executable, "-c", INNER, json.dumps(spec)], env=env, capture_output=True, text=True,
                         timeout=timeout, cwd=tree.path_entry)
    line = next((x for x in res.stdout.splitlines() if x.startswith("BENCH_AB ")), None)
    if res.returncode != 0 or line is None:
        raise RuntimeError(f"{tree.label} {spec['measure']} failed (exit {res.returncode}): {res.stderr[-2000:]}")
    figures: dict[str, float] = json.loads(line[len("BENCH_AB "):])
    return figures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", action="append", default=[], help="a commit, checked out into a worktree")
    ap.add_argument("--tree", action="append", default=[], help="LABEL=DIR: a kvstage tree as it is")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--measure", default="staged-latency,staged-lengths")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--transport", default="nixl")
    ap.add_argument("--requests", type=int, default=100, help="one-page requests per latency figure (10 warm up)")
    ap.add_argument("--lengths", default="2048", help="tokens of the staged-lengths requests")
    ap.add_argument("--timeout", type=float, default=600, help="seconds one measurement may take")
    ap.add_argument("--json", default=None, help="where every sample is saved")
    a = ap.parse_args(argv)
    measures = [m for m in a.measure.split(",") if m]
    bad = [m for m in measures if m not in MEASURES]
    if bad or not measures:
        ap.error(f"--measure takes {', '.join(MEASURES)}; got {a.measure!r}")
    if len(a.rev) + len(a.tree) < 2 or a.rounds < 1 or a.requests < 11:
        ap.error("two trees or more, at least one round, and at least 11 requests (10 warm up) are needed")
    lengths = [int(x) for x in a.lengths.split(",")]
    repo = Path(__file__).resolve().parent.parent
    with trees_of(a.rev, a.tree, repo) as trees:
        samples: dict[str, dict[str, list[float]]] = {t.label: {} for t in trees}
        for rnd in range(a.rounds):
            for tree in round_order(trees, rnd):
                for m in measures:
                    spec = {"measure": m, "device": a.device, "transport": a.transport, "requests": a.requests,
                            "lengths": lengths}
                    got = measure(tree, spec, a.timeout)
                    for name, value in got.items():
                        samples[tree.label].setdefault(f"{m.split('-')[0]} {name}", []).append(value)
                    print(f"round {rnd} {tree.label} {m}: " + ", ".join(f"{k} {v:.3f}" for k, v in got.items()),
                          flush=True)
    print("\n".join(summarize(samples, trees[0].label)))
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "samples": samples}, indent=1))
    return 0
