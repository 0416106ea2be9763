"""Where each thread of each rank process spent its samples, from a py-spy recording of a
benchmark (docs/trace.md, "CPU per thread": the sampling profiler that also works on a GPU
machine, where the cProfile of `PD_RANK_PROFILE_DIR` did not finish).

    py-spy record --subprocesses --threads --rate 500 --format raw -o spy.txt -- python examples/bench.py ...
    python -m kvstage.support.spy_report spy.txt [--top N] [--thread kvstage-scatter]

py-spy's raw format is one line per distinct stack: `frame;frame;...;frame COUNT`, where with
`--subprocesses` the first frames name the processes (`process PID:"command line"`) and with
`--threads` the next one the thread (`thread (TID): NAME`). A rank process is named by its spec
file (`.../002-d1.json` is `d1`, as `support/cluster.py` names them), any other by its command.
Numbered threads of one pool (`kvstage-xfer-0`, `-1`) are summed as one (`kvstage-xfer-N`).

One line per process and thread: its samples; with --top N, also the N frames where its samples
sat (own) and the N it was inside of (inclusive; frames on the stack of every sample, the
thread's own start, left out). A file ending in .gz is read compressed. py-spy samples wall-clock time of threads that
are not idle, native calls (a CUDA copy, a backend's post) included.
"""

from __future__ import annotations

import argparse
import gzip
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

_SPEC = re.compile(r"/\d+-([^/\s]+)\.json\b")
_POOL = re.compile(r"^(kvstage-[a-z]+)-\d+$")


@dataclass(frozen=True)
class Sample:
    """One raw line: the process and thread it is from, its frames outermost first, its count."""

    process: str
    thread: str
    frames: tuple[str, ...]
    count: int


@dataclass
class ThreadSamples:
    """What one thread of one process spent: its samples, and per frame own and inclusive."""

    samples: int = 0
    own: Counter[str] = field(default_factory=Counter)
    inside: Counter[str] = field(default_factory=Counter)


def process_name(command: str) -> str:
    """A rank process by its spec file (`002-d1.json`: `d1`), any other by its command."""
    m = _SPEC.search(command)
    return m.group(1) if m else (command.split()[-1] if command.strip() else "?")


def thread_name(name: str) -> str:
    """Numbered threads of one pool as one (`kvstage-xfer-1`: `kvstage-xfer-N`)."""
    m = _POOL.match(name)
    return f"{m.group(1)}-N" if m else name


def parse_line(line: str) -> Sample | None:
    """One raw line, or None for a blank one. ValueError for a line that is not py-spy's raw format."""
    line = line.rstrip("\n")
    if not line.strip():
        return None
    stack, _, count = line.rpartition(" ")
    if not stack or not count.isdigit():
        raise ValueError(f"not a py-spy raw line (frames, a space, a count): {line[:80]!r}")
    parts = stack.split(";")
    processes = [p for p in parts if p.startswith("process ")]
    command = processes[-1].split(":", 1)[1].strip('"') if processes and ":" in processes[-1] else ""
    at = next((i for i, p in enumerate(parts) if p.startswith("thread (")), None)
    thread = parts[at].split(": ", 1)[1] if at is not None and ": " in parts[at] else "?"
    frames = tuple(parts[at + 1:] if at is not None else [p for p in parts if not p.startswith("process ")])
    return Sample(process_name(command), thread_name(thread), frames, int(count))


def summarize(lines: Iterable[str]) -> dict[tuple[str, str], ThreadSamples]:
    """Per (process, thread): its samples, own frame counts and inclusive frame counts (a frame
    that recurs in one stack counts once)."""
    out: dict[tuple[str, str], ThreadSamples] = {}
    for line in lines:
        s = parse_line(line)
        if s is None:
            continue
        t = out.setdefault((s.process, s.thread), ThreadSamples())
        t.samples += s.count
        if s.frames:
            t.own[s.frames[-1]] += s.count
        for f in dict.fromkeys(s.frames):   # once a stack, outermost first (ties stay in that order)
            t.inside[f] += s.count
    return out


def report(summary: dict[tuple[str, str], ThreadSamples], top: int = 0, thread: str = "") -> list[str]:
    rows = sorted(((k, v) for k, v in summary.items() if thread in k[1]), key=lambda kv: -kv[1].samples)
    out = []
    for (proc, name), t in rows:
        out.append(f"{proc:>12s} {name:28s} {t.samples:8d} samples")
        if top:
            out += [f"{'':12s}   own {n:7d} {f}" for f, n in t.own.most_common(top)]
            inside = [(f, n) for f, n in t.inside.most_common() if n < t.samples]   # not in every sample
            out += [f"{'':12s}   in  {n:7d} {f}" for f, n in inside[:top]]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("raw", help="py-spy record --format raw output")
    ap.add_argument("--top", type=int, default=0, help="also each thread's N frames of most samples (own, inclusive)")
    ap.add_argument("--thread", default="", help="only threads whose name contains this")
    a = ap.parse_args(argv)
    with (gzip.open(a.raw, "rt") if a.raw.endswith(".gz") else open(a.raw)) as f:
        print("\n".join(report(summarize(f), a.top, a.thread)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
