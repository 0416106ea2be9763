"""The hops of requests, read from the trace files of several processes (hop_trace.py): merged
into one timeline, cut per request, counted, paired into hand-offs, printed and drawn.

Used by examples/trace_request.py; pure apart from `plot` (matplotlib) and `load_dir` (files).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvstage.hop_trace import WAKES, Hop, HopRecord, load
from kvstage.support.figure_legend import legend_below

# A receiving hop and the hop that handed it over: (receiving kind, sending kinds, same process?)
HANDOFFS = {
    Hop.EVENT_TAKEN: ((Hop.EVENT_QUEUED,), True),       # a thread's queue: same detail ("<queue> <type>")
    Hop.SOCKET_RECV: ((Hop.SOCKET_SEND,), False),       # a control message: same type, the other process
    Hop.BACKEND_TAG: ((Hop.BACKEND_POST,), False),      # a backend write: posted there, its tag read here
    Hop.WAITER_WOKEN: ((Hop.BACKEND_DONE, Hop.STATUS), True),   # a worker's write done; a caller's outcome
}


@dataclass(frozen=True)
class Counts:
    hops: int              # hops of the request from its origin on
    wakes: int             # of them, a thread taking what another handed it (hop_trace.WAKES); an event a
                           # thread queued for itself and took in the same round wakes nobody
    lane_switches: int     # consecutive hops on different (process, thread)
    process_switches: int  # of them, across processes
    threads: int           # distinct (process, thread) lanes it touched
    by_kind: dict[str, int]


def load_dir(path: str | Path) -> list[HopRecord]:
    """Every process's trace file in `path`, merged."""
    return merge(load(f)[1] for f in sorted(Path(path).glob("*.jsonl")))


def merge(per_process: Iterable[Sequence[HopRecord]]) -> list[HopRecord]:
    """One timeline of several processes' records: one clock (CLOCK_MONOTONIC on one host), so a
    sort by time is the merge; ties keep each process's own order."""
    out = [r for recs in per_process for r in recs]
    out.sort(key=lambda r: r.t_ns)   # stable: a process's own records keep their order on a tie
    return out


def lane(r: HopRecord) -> tuple[str, str]:
    return (r.process, r.thread)


def request_hops(records: Sequence[HopRecord], room: int) -> tuple[list[HopRecord], list[HopRecord]]:
    """The hops naming `room`, split at its origin: the decode caller's init() (the request's
    latency starts there, as in examples/bench.py's one-page latency), else its first hop.
    Returns (before the origin, from the origin on): with the prefill long ready, its send() came
    before."""
    mine = [r for r in records if r.room == room]
    origin = next((i for i, r in enumerate(mine) if r.kind is Hop.HANDLE_CALL and r.detail == "receiver init()"), 0)
    return mine[:origin], mine[origin:]


def decode_woken(hops: Sequence[HopRecord]) -> int | None:
    """Index of the hop that ends the request's latency: the last decode caller's wait() returning
    (init() -> Success, as examples/bench.py's one-page latency measures it); None if none did."""
    ends = [i for i, r in enumerate(hops)
            if r.kind is Hop.WAITER_WOKEN and r.detail == "wait() returned" and r.process.startswith("decode")]
    return ends[-1] if ends else None


def counts(hops: Sequence[HopRecord]) -> Counts:
    by_kind: dict[str, int] = {}
    for r in hops:
        by_kind[r.kind.value] = by_kind.get(r.kind.value, 0) + 1
    switches = [(a, b) for a, b in zip(hops, hops[1:]) if lane(a) != lane(b)]
    own = {j for i, j in pairs(hops) if lane(hops[i]) == lane(hops[j])}   # taken by the thread that queued it
    wakes = sum(r.kind in WAKES and k not in own for k, r in enumerate(hops))
    return Counts(hops=len(hops), wakes=wakes, lane_switches=len(switches),
                  process_switches=sum(a.process != b.process for a, b in switches),
                  threads=len({lane(r) for r in hops}), by_kind=by_kind)


def pairs(hops: Sequence[HopRecord]) -> list[tuple[int, int]]:
    """Hand-offs as (index of the hop that handed over, index of the hop that took it), each
    receiving hop matched to the earliest unmatched sending hop before it (HANDOFFS)."""
    used: set[int] = set()
    out = []
    for j, r in enumerate(hops):
        rule = HANDOFFS.get(r.kind)
        if rule is None:
            continue
        kinds, same = rule
        for i in range(j):
            s = hops[i]
            if i in used or s.kind not in kinds or (s.process == r.process) != same:
                continue
            if r.kind in (Hop.EVENT_TAKEN, Hop.SOCKET_RECV) and s.detail != r.detail:
                continue
            if r.kind is Hop.WAITER_WOKEN and not _wakes(s, r):
                continue
            used.add(i)
            out.append((i, j))
            break
    return out


@dataclass(frozen=True)
class CriticalPath:
    steps: tuple[int, ...]   # indices of its hops, from the origin to the end
    wakes: int               # of its steps, a thread taking what another thread handed it
    process_switches: int    # of those, across processes


def critical_path(hops: Sequence[HopRecord], end: int) -> CriticalPath:
    """The chain of hops that `hops[end]` waited for, walked back to the first hop: at each hop,
    what came last before it of (the previous hop of its own thread, the hop that handed it over:
    `pairs`). A thread that took a hand-off after its own previous hop was waiting for it: that
    step is a wake-up on the path; otherwise the thread was busy and its own previous hop is the
    cause. Hops off the chain (a MetaAck, a second decode rank's work, a confirmation) are not
    on it, whatever the thread-wide counts say."""
    giver = {j: i for i, j in pairs(hops)}
    prev_in_lane: dict[int, int] = {}
    last: dict[tuple[str, str], int] = {}
    for k, r in enumerate(hops):
        if lane(r) in last:
            prev_in_lane[k] = last[lane(r)]
        last[lane(r)] = k
    steps, wakes, crossings = [end], 0, 0
    k = end
    while k > 0:
        own, handed = prev_in_lane.get(k), giver.get(k)
        if handed is not None and (own is None or hops[handed].t_ns >= hops[own].t_ns):
            if lane(hops[handed]) != lane(hops[k]):
                wakes += 1
                crossings += hops[handed].process != hops[k].process
            k = handed
        elif own is not None:
            k = own
        else:
            break
        steps.append(k)
    return CriticalPath(steps=tuple(reversed(steps)), wakes=wakes, process_switches=crossings)


def spans(hops: Sequence[HopRecord]) -> list[tuple[HopRecord, HopRecord]]:
    """Each gather and scatter as (its start, its end): the next end on the same thread."""
    ends = {Hop.GATHER_START: Hop.GATHER_END, Hop.SCATTER_START: Hop.SCATTER_END}
    out = []
    for i, a in enumerate(hops):
        if a.kind in ends:
            b = next((b for b in hops[i + 1:] if b.kind is ends[a.kind] and lane(b) == lane(a)), None)
            if b is not None:
                out.append((a, b))
    return out


def _wakes(s: HopRecord, r: HopRecord) -> bool:
    """A transfer worker wakes on its write's completion; a caller on the room's outcome."""
    if r.detail == "its write done":
        return s.kind is Hop.BACKEND_DONE
    return s.kind is Hop.STATUS and s.detail.split(" ")[0] in ("Success", "Failed")


def ms(r: HopRecord, origin_ns: int) -> float:
    return (r.t_ns - origin_ns) / 1e6


def timeline_lines(hops: Sequence[HopRecord], origin_ns: int) -> list[str]:
    """One line per hop: ms since the origin, the gap since the hop before, process, thread, kind, detail."""
    lines = [f"{'ms':>9} {'+gap':>7}  {'process':<9} {'thread':<16} {'hop':<14} detail"]
    prev = None
    for r in hops:
        gap = "" if prev is None else f"{(r.t_ns - prev) / 1e6:7.3f}"
        lines.append(f"{ms(r, origin_ns):9.3f} {gap:>7}  {r.process:<9} {r.thread:<16} {r.kind.value:<14} {r.detail}")
        prev = r.t_ns
    return lines


def summary_lines(name: str, hops: Sequence[HopRecord]) -> list[str]:
    """The request's counts: up to the decode caller's wake-up (its latency), and all of its hops."""
    end = decode_woken(hops)
    out = []
    if end is not None:
        c = counts(hops[:end + 1])
        out.append(f"{name}: init() -> wait() returned on the decode side in {ms(hops[end], hops[0].t_ns):.3f} ms: "
                   f"{c.hops} hops, {c.wakes} wake-ups (a thread taking what another handed it), "
                   f"{c.lane_switches} switches of thread ({c.process_switches} between processes), {c.threads} threads")
        path = critical_path(hops, end)
        out.append(f"  its critical path (what the decode caller's wake-up waited for): {len(path.steps)} hops, "
                   f"{path.wakes} wake-ups ({path.process_switches} between processes): "
                   + " > ".join(f"{hops[i].process} {hops[i].kind.value}" + (f" {hops[i].detail}" if hops[i].detail
                                and hops[i].kind in (Hop.SOCKET_SEND, Hop.SOCKET_RECV, Hop.EVENT_QUEUED,
                                                     Hop.EVENT_TAKEN) else "") for i in path.steps))
    c = counts(hops)
    out.append(f"  all its hops, to the last one at {ms(hops[-1], hops[0].t_ns):.3f} ms: {c.hops} hops, "
               f"{c.wakes} wake-ups, {c.lane_switches} switches of thread ({c.process_switches} between processes)")
    out.append("  by kind: " + ", ".join(f"{k} {n}" for k, n in sorted(c.by_kind.items(), key=lambda kv: -kv[1])))
    return out


COLORS = {Hop.HANDLE_CALL: "#000000", Hop.EVENT_QUEUED: "#8172b3", Hop.EVENT_TAKEN: "#4c72b0",
          Hop.SOCKET_SEND: "#dd8452", Hop.SOCKET_RECV: "#c44e52", Hop.BACKEND_POST: "#55a868",
          Hop.BACKEND_DONE: "#2ca02c", Hop.BACKEND_TAG: "#17becf", Hop.GATHER_START: "#937860",
          Hop.GATHER_END: "#937860", Hop.SCATTER_START: "#da8bc3", Hop.SCATTER_END: "#da8bc3",
          Hop.WAITER_WOKEN: "#ccb974", Hop.STATUS: "#8c8c8c"}
MARKERS = {Hop.EVENT_QUEUED: ">", Hop.EVENT_TAKEN: "o", Hop.SOCKET_SEND: ">", Hop.SOCKET_RECV: "o",
           Hop.BACKEND_POST: ">", Hop.BACKEND_TAG: "o", Hop.GATHER_START: "|", Hop.GATHER_END: "|",
           Hop.SCATTER_START: "|", Hop.SCATTER_END: "|", Hop.HANDLE_CALL: "*", Hop.WAITER_WOKEN: "o",
           Hop.BACKEND_DONE: "s", Hop.STATUS: "d"}


def plot(requests: Sequence[tuple[str, Sequence[HopRecord]]], path: str, plt) -> str:
    """One panel per request: a lane per (process, thread), a marker per hop, a line per hand-off."""
    fig, axes = plt.subplots(len(requests), 1, squeeze=False,
                             figsize=(12, sum(1.2 + 0.42 * len({lane(r) for r in h}) for _, h in requests)))
    seen: set[Hop] = set()
    for ax, (title, hops) in zip(axes[:, 0], requests):
        lanes = sorted({lane(r) for r in hops}, key=lambda ln: (not ln[0].startswith("decode"), ln))
        y = {ln: i for i, ln in enumerate(lanes)}
        t0 = hops[0].t_ns
        for i, j in pairs(hops):
            a, b = hops[i], hops[j]
            ax.annotate("", xy=(ms(b, t0), y[lane(b)]), xytext=(ms(a, t0), y[lane(a)]),
                        arrowprops={"arrowstyle": "->", "color": "#999999", "lw": 0.7, "shrinkA": 2, "shrinkB": 2})
        for a, b in spans(hops):   # a gather or a scatter: a bar from its start to its end
            ax.hlines(y[lane(a)], ms(a, t0), ms(b, t0), color=COLORS[a.kind], lw=7, alpha=0.45)
        for r in hops:
            ax.plot(ms(r, t0), y[lane(r)], marker=MARKERS.get(r.kind, "o"), linestyle="none", color=COLORS[r.kind],
                    ms=6, label=r.kind.value if r.kind not in seen else None)
            seen.add(r.kind)
        ax.set_yticks(range(len(lanes)), [f"{p} {t}" for p, t in lanes], fontsize=8)
        ax.set_ylim(-0.6, len(lanes) - 0.4)
        ax.invert_yaxis()
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("ms since the decode caller's init()", fontsize=8)
        ax.grid(True, axis="x", alpha=0.3)
    legend_below(fig, axes, ncol=7, bottom=0.06)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
