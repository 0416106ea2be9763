"""What kvstage costs the serving process it lives in: a scheduler-like pure-Python thread in
each rank process (prefill and decode) counts its loop iterations per second while kvstage is
absent, idle and connected, holding N requests that wait for the prefill (metadata out, no
write yet), and streaming one-page requests back to back. Per phase and rank it prints the
scheduler's rate as a ratio to the no-engine rate of the same process (measured before the
engine starts and after it closed), the CPU of kvstage's threads (stats()["thread_cpu_s"]) and
of every other thread of the process but the scheduler and the driver (UCX, Mooncake, kvstage)
per second and per request. Backends x paths are alternated within each round.

    .venv/bin/python examples/bench_overhead.py                       # small: ~2 minutes
    .venv/bin/python examples/bench_overhead.py --phase-s 10 --rounds 4 --waiting 32 --stream 200

Goals (issue 27): idle >= 0.99 and waiting >= 0.98 of the no-engine rate, kvstage's CPU while
waiting under 0.5 % of a core, decode CPU per one-page request under 2 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

PHASES = ("none", "idle", "waiting", "streaming", "none_after")
GEOMETRY = {"layers": 4, "heads": 8, "head_dim": 128, "dtype": "bfloat16", "page_size": 16, "pages": 512}


# -- the child: one rank process ----------------------------------------------------------------------
class Scheduler:
    """A stand-in for a serving engine's scheduler loop: pure Python, never blocking."""

    def __init__(self) -> None:
        self.count = 0
        self.native_id = 0
        self._stop = False
        self.thread = threading.Thread(target=self._run, name="scheduler", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.native_id = threading.get_native_id()
        queue: dict[int, int] = {}
        n = 0
        while not self._stop:
            for i in range(32):                   # bookkeeping of a batch: dict and int work
                queue[i & 15] = queue.get(i & 15, 0) + i
            n += 1
            self.count = n

    def stop(self) -> None:
        self._stop = True
        self.thread.join()


def _thread_cpu(skip: set[int]) -> float:
    """CPU seconds of every thread of this process not in `skip` (native ids)."""
    from kvstage.staging.thread_meter import thread_cpu_seconds
    total = 0.0
    for tid in os.listdir("/proc/self/task"):
        if int(tid) not in skip:
            total += thread_cpu_seconds(int(tid)) or 0.0
    return total


class Rank:
    def __init__(self, spec: dict):
        self.spec = spec
        self.sched = Scheduler()
        self.mgr = None
        self.room = 1000
        self.handles: list = []

    def kv_cpu(self) -> float:
        return sum(self.mgr.stats()["thread_cpu_s"].values()) if self.mgr is not None else 0.0

    def measure(self, seconds: float, work=None) -> dict:
        """The scheduler's rate and the CPU of the other threads over `seconds` (or `work()`)."""
        skip = {self.sched.native_id, threading.get_native_id()}
        c0, kv0, other0, t0 = self.sched.count, self.kv_cpu(), _thread_cpu(skip), time.perf_counter()
        requests = work() if work is not None else time.sleep(seconds) or 0
        t1 = time.perf_counter()
        c1, kv1, other1 = self.sched.count, self.kv_cpu(), _thread_cpu(skip)
        return {"seconds": t1 - t0, "rate": (c1 - c0) / (t1 - t0), "kv_cpu_s": kv1 - kv0,
                "other_cpu_s": other1 - other0, "requests": requests}

    def start(self) -> None:
        from kvstage.support import pd_rank
        s = self.spec
        spec = {"role": s["role"], "rank": 0, "tp": 1, "engine": f"{s['role']}-{s['uid']}", "backend": s["backend"],
                "staging": s["staged"], "geometry": GEOMETRY, "ring_mb": 16, "buffer_mb": 8, "workers": 2}
        self.mgr, *_ = pd_rank.build(spec, s["bootstrap"])

    def one_request(self, hold: bool = False):
        """Open one one-page request (decode: init; prefill: its pages, unless `hold`)."""
        import numpy as np
        room, self.room = self.room, self.room + 1
        page = np.array([room % GEOMETRY["pages"]], dtype=np.int64)
        if self.spec["role"] == "decode":
            h = self.mgr.receiver(room, f"prefill-{self.spec['uid']}")
            h.init(page)
        else:
            h = self.mgr.sender(room, 1)
            if not hold:
                h.send(page, last=True)
        h.page = page
        return h

    def stream(self, n: int) -> int:
        for _ in range(n):
            self._ok(self.one_request().wait(60))
        return n

    @staticmethod
    def _ok(state) -> None:
        if state.name != "Success":
            raise RuntimeError(f"a request ended {state.name}")

    def hold(self, n: int) -> None:
        """n requests waiting for the prefill's pages, both sides past their handshake."""
        from kvstage.transfer import KVPoll
        self.handles = [self.one_request(hold=True) for _ in range(n)]
        want = KVPoll.Transferring if self.spec["role"] == "decode" else KVPoll.WaitingForInput
        deadline = time.monotonic() + 60
        while any(h.poll() is not want for h in self.handles):
            if time.monotonic() > deadline:
                raise RuntimeError(f"held requests never reached {want.name}")
            time.sleep(0.01)

    def release(self) -> None:
        for h in self.handles:
            if self.spec["role"] == "prefill":
                h.send(h.page, last=True)
        for h in self.handles:
            self._ok(h.wait(60))
        self.handles = []


def child(spec: dict) -> None:
    from kvstage.staging import thread_meter  # noqa: F401
    from kvstage.support import pd_rank  # noqa: F401 - torch, numpy and kvstage load before any phase is timed
    rank = Rank(spec)
    out = {}
    for line in sys.stdin:
        cmd, *arg = line.split()
        if cmd == "measure":
            out[arg[0]] = rank.measure(spec["phase_s"])
        elif cmd == "start":
            rank.start()
        elif cmd == "warm":
            rank.stream(2)
        elif cmd == "hold":
            rank.hold(spec["waiting"])
        elif cmd == "release":
            rank.release()
        elif cmd == "stream":
            out["streaming"] = rank.measure(0, lambda: rank.stream(spec["stream"]))
        elif cmd == "close":
            rank.mgr.close()
            rank.mgr = None
        elif cmd == "exit":
            rank.sched.stop()
            print(json.dumps(out), flush=True)
            return
        print("ok", flush=True)


# -- the parent ----------------------------------------------------------------------------------------
def run_pair(args, bootstrap: str, backend: str, staged: bool) -> dict:
    from kvstage.support.cluster import rank_env
    procs = {}
    uid = secrets.token_hex(4)   # engine ids of this pair only
    for role in ("prefill", "decode"):
        spec = {"uid": uid, "role": role, "backend": backend, "staged": staged, "bootstrap": bootstrap,
                "phase_s": args.phase_s, "waiting": args.waiting, "stream": args.stream}
        procs[role] = subprocess.Popen([sys.executable, __file__, "--child", json.dumps(spec)], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True, env=rank_env())

    def step(cmd: str) -> None:
        for p in procs.values():
            p.stdin.write(cmd + "\n")
            p.stdin.flush()
        for role, p in procs.items():
            line = p.stdout.readline().strip()
            if line != "ok":
                raise RuntimeError(f"{role} rank: {cmd!r} answered {line!r} (see its stderr)")

    try:
        for cmd in ("measure none", "start", "warm", "measure idle", "hold", "measure waiting", "release", "stream",
                    "close", "measure none_after"):
            step(cmd)
        out = {}
        for role, p in procs.items():
            p.stdin.write("exit\n")
            p.stdin.flush()
            out[role] = json.loads(p.stdout.readline())
        return out
    finally:
        for p in procs.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


def report(results: list[dict]) -> list[str]:
    """Per config, rank and phase: medians over the rounds."""
    lines = [f"{'config':18} {'rank':8} {'phase':10} {'ratio':>6} {'(min-max)':>13} {'kv %core':>9} "
             f"{'other %core':>12} {'kv ms/req':>10} {'all ms/req':>11}"]
    for cfg in sorted({r["config"] for r in results}):
        runs = [r for r in results if r["config"] == cfg]
        for role in ("prefill", "decode"):
            for phase in PHASES[1:4]:
                ratios, kv, other, kv_req, all_req = [], [], [], [], []
                for r in runs:
                    ph = r[role]
                    base = (ph["none"]["rate"] + ph["none_after"]["rate"]) / 2
                    m = ph[phase]
                    ratios.append(m["rate"] / base)
                    kv.append(100 * m["kv_cpu_s"] / m["seconds"])
                    other.append(100 * m["other_cpu_s"] / m["seconds"])
                    if m["requests"]:
                        kv_req.append(1e3 * m["kv_cpu_s"] / m["requests"])
                        all_req.append(1e3 * m["other_cpu_s"] / m["requests"])
                per_req = (f"{statistics.median(kv_req):10.2f} {statistics.median(all_req):11.2f}" if kv_req
                           else f"{'':10} {'':11}")
                lines.append(f"{cfg:18} {role:8} {phase:10} {statistics.median(ratios):6.3f} "
                             f"{min(ratios):6.3f}-{max(ratios):6.3f} {statistics.median(kv):9.3f} "
                             f"{statistics.median(other):12.3f} {per_req}")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--backends", default="nixl,mooncake")
    p.add_argument("--paths", default="direct,staged")
    p.add_argument("--rounds", type=int, default=1, help="each round runs every config once, alternated")
    p.add_argument("--phase-s", type=float, default=2.0, help="seconds of each timed phase")
    p.add_argument("--waiting", type=int, default=8, help="requests held waiting for the prefill")
    p.add_argument("--stream", type=int, default=30, help="one-page requests streamed back to back")
    p.add_argument("--json", default=None, help="write every run's figures here")
    a = p.parse_args(argv)
    if a.child:
        child(json.loads(a.child))
        return 0
    from kvstage.support.cluster import start_bootstrap
    configs = [(b, path) for b in a.backends.split(",") for path in a.paths.split(",")]
    server = start_bootstrap()
    results = []
    try:
        for rnd in range(a.rounds):
            order = configs if rnd % 2 == 0 else configs[::-1]
            for backend, path in order:
                t0 = time.monotonic()
                res = run_pair(a, server.addr, backend, path == "staged")
                res.update(config=f"{backend} {path}", round=rnd)
                results.append(res)
                print(f"round {rnd} {backend} {path}: {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    finally:
        server.stop()
    print("\n".join(report(results)))
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
