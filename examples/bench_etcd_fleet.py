"""etcd at fleet load: 1,000 ranks registered, kept alive, looked up and watched at once.

    .venv/bin/python examples/bench_etcd_fleet.py                       # 10 processes x 100 clients, TTL 10 s
    .venv/bin/python examples/bench_etcd_fleet.py --procs 2 --clients 10 --lookups 5 --json out.json

It starts a real three-member etcd cluster on this machine (support/etcd_cluster.py) and
--procs worker processes, each holding --clients rendezvous clients (kvstage.bootstrap's etcd
rendezvous, one per rank, as every rank of a fleet has its own), and one more process holding
one engine (8 ranks), the one that dies. Every client registers its rank (ranks are grouped 8 to
an engine) and keeps its lease alive; then each looks up --lookups random engines (what a decode
rank does when it meets a prefill engine; the first lookup starts the client's watch), timed, all
at once, --threads per process back to back: a fleet's start-up, when every decode rank meets
every prefill engine. Then one client in this process (a rank's own process, whose lookups no
other client's threads hold up) looks up random engines at --paced a second for --paced-s seconds,
timed: a fleet at work, where a rank now and then meets an engine it has not met yet; the same
client did the same before the fleet started, on one engine alone in etcd (the baseline). Then every
client of the --procs workers looks up the dying engine, and its process is killed (SIGKILL: no
lease revoked): etcd deletes its ranks' keys once their leases run out, and each watching
client's on_gone callback says when it heard. Printed
(JSON): registration and lookup latency percentiles, the delay from the kill to each rank-gone
notice (goal: within TTL + 2 s), and each etcd member's CPU seconds, resident memory and leader
changes seen (a new leader extends every lease by etcd's own rule, which delays the notices).

--fleet-nice 19 runs the worker processes at the lowest priority, so that etcd's members and the
paced client get the cores first: on one machine, the nearest to a fleet whose ranks run on
hosts of their own. The fleet's requests still reach etcd as before; only its clients' own CPU
no longer competes with etcd's.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import random
import statistics
import sys
import threading
import time
import urllib.request

from kvstage.bootstrap import BootstrapError, RankInfo, open_rendezvous
from kvstage.support.etcd_cluster import EtcdCluster

TP = 8


class WorkerFailed(RuntimeError):
    """A worker process failed or exited before it reported."""


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--procs", type=int, default=10, help="worker processes (and one more: the engine killed)")
    p.add_argument("--clients", type=int, default=100, help="rendezvous clients (ranks) per process")
    p.add_argument("--lookups", type=int, default=10, help="timed lookups per client")
    p.add_argument("--threads", type=int, default=4, help="lookup threads per process")
    p.add_argument("--paced", type=float, default=20.0, help="paced lookups per second, from one client")
    p.add_argument("--paced-s", type=float, default=20.0, help="how long the paced lookups go on (0: none)")
    p.add_argument("--ttl", type=int, default=10, help="each rank's lease, seconds (etcd rendezvous' default)")
    p.add_argument("--members", type=int, default=3)
    p.add_argument("--fleet-nice", type=int, default=0, choices=range(0, 20), metavar="0..19",
                   help="the worker processes' niceness: 19 gives etcd and the paced client the cores "
                        "first, as on a fleet whose ranks run on hosts of their own")
    p.add_argument("--json", help="write the figures here too")
    a = p.parse_args(argv)
    if a.procs < 1 or a.clients < 1 or a.lookups < 0 or a.threads < 1 or a.ttl < 1 or a.paced <= 0 or a.paced_s < 0:
        p.error("--procs, --clients, --threads, --ttl >= 1, --lookups, --paced-s >= 0, --paced > 0")
    if (a.procs * a.clients) % TP:
        p.error(f"the ranks (--procs x --clients) must be whole engines of {TP}")
    return a


def rank_info(g: int) -> RankInfo:
    return RankInfo(engine_id=f"e{g // TP}", role="prefill", tp_size=TP, tp_rank=g % TP,
                    ctrl_endpoint=f"tcp://127.0.0.1:{20000 + g}", backend="nixl", backend_identity="x" * 600,
                    layout={"num_layers": 32, "head_dim": 128, "dtype": "bfloat16", "mla": False},
                    pools={"kv": 8 << 30, "staging_buffers": 64 << 20}, incarnation=1000 + g)


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def worker(w: int, ranks: range, a: argparse.Namespace, url: str, engines: int, cmd: mp.Queue,
           out: mp.Queue) -> None:
    """One process holding `ranks`; an error ends it with a ("failed", w, reason) report, so the
    main process stops at once instead of waiting for a report that will not come."""
    try:
        run_worker(w, ranks, a, url, engines, cmd, out)
    except BaseException as exc:
        out.put(("failed", w, f"{type(exc).__name__}: {exc}"[:500]))
        raise SystemExit(1) from None


def run_worker(w: int, ranks: range, a: argparse.Namespace, url: str, engines: int, cmd: mp.Queue,
               out: mp.Queue) -> None:
    """Registers the process' ranks, times lookups, reports rank-gone notices."""
    os.nice(a.fleet_nice)
    clients = [open_rendezvous(url) for _ in ranks]
    heard: list[tuple[str, int, float]] = []
    lock = threading.Lock()

    def gone(g) -> None:
        with lock:
            heard.append((g.engine_id, g.tp_rank, time.time()))
    for c in clients:
        c.on_gone(gone)
    reg, refused = [], []
    for i, c in enumerate(clients):
        info = rank_info(ranks[i])
        t = time.perf_counter()
        for attempt in range(3):   # an overloaded etcd may let a fresh lease expire before its put
            try:
                c.register(info)
                break
            except BootstrapError as exc:
                refused.append(str(exc)[:200])
                if attempt == 2:
                    raise
        reg.append(time.perf_counter() - t)
        c.start_keepalive(info)
    out.put(("registered", w, (reg, refused, os.getpriority(os.PRIO_PROCESS, 0))))
    assert cmd.get() == "lookup"
    rng = random.Random(w)
    jobs = [(c, f"e{rng.randrange(engines)}") for c in clients for _ in range(a.lookups)]
    lat: list[float] = []

    def run(part) -> None:
        mine = []
        for c, eng in part:
            t = time.perf_counter()
            c.lookup(eng, timeout_s=30)
            mine.append(time.perf_counter() - t)
        with lock:
            lat.extend(mine)
    threads = [threading.Thread(target=run, args=(jobs[i::a.threads],)) for i in range(a.threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put(("looked_up", w, lat))
    target = cmd.get()
    for c in clients:   # every client watches the engine that will die
        c.lookup(target, timeout_s=30)
    out.put(("watching", w, None))
    while True:
        msg = cmd.get()
        if msg == "report":
            with lock:
                out.put(("heard", w, list(heard)))
        elif msg == "stop":
            break
    # no close(): each revoke would reach every rank still watching (a thousand ranks closing
    # one by one make half a million watch events, which would load the next run); the keys
    # go with the cluster
    out.put(("stopped", w, None))
    out.close()
    out.join_thread()
    os._exit(0)


def paced(url: str, engines: list[str], rate: float, seconds: float) -> list[float]:
    """Lookups of random `engines` by one client of this process at `rate` a second for
    `seconds`, each timed (one after the other: a lookup longer than 1 / rate delays the next)."""
    lat: list[float] = []
    rng = random.Random(-1)
    with open_rendezvous(url) as client:
        start = time.perf_counter()
        for i in range(int(rate * seconds)):
            wait = start + i / rate - time.perf_counter()
            if wait > 0:
                time.sleep(wait)   # the pace itself, not a wait for a condition
            t = time.perf_counter()
            client.lookup(rng.choice(engines), timeout_s=30)
            lat.append(time.perf_counter() - t)
    return lat


def paced_alone(url: str, a: argparse.Namespace) -> list[float]:
    """The paced lookups before the fleet starts: one engine registered (kept alive) in an
    otherwise empty etcd, looked up the same way; the baseline of the same run."""
    with open_rendezvous(url) as holder:
        for r in range(TP):
            info = RankInfo(engine_id="alone", role="prefill", tp_size=TP, tp_rank=r,
                            ctrl_endpoint=f"tcp://127.0.0.1:{19000 + r}", backend="nixl",
                            backend_identity="x" * 600, layout=rank_info(r).layout, pools=rank_info(r).pools,
                            incarnation=1)
            holder.register(info)
            holder.start_keepalive(info)
        return paced(url, ["alone"], a.paced, a.paced_s)


def lat_ms(lat: list[float]) -> dict:
    return {"p50": round(pct(lat, 50) * 1e3, 2), "p99": round(pct(lat, 99) * 1e3, 2),
            "max": round(max(lat, default=0) * 1e3, 2)}


def leader_changes(endpoint: str) -> int | None:
    """etcd_server_leader_changes_seen_total from the member's /metrics (None: it did not answer)."""
    try:
        with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("etcd_server_leader_changes_seen_total "):
            return int(float(line.split()[1]))
    return None


def etcd_usage(ec: EtcdCluster) -> list[dict]:
    """Each member's CPU seconds (user + system), resident memory (from /proc) and leader changes
    seen."""
    tick = os.sysconf("SC_CLK_TCK")
    rows = []
    for m in ec.members:
        pid = m.proc.pid
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/status") as f:
            rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        rows.append({"member": m.name, "cpu_s": round((int(fields[11]) + int(fields[12])) / tick, 2),
                     "rss_mib": round(rss / 1024, 1), "leader_changes": leader_changes(m.endpoint)})
    return rows


def main(argv=None) -> int:
    a = parse(argv)
    ranks = a.procs * a.clients
    engines = ranks // TP   # e0 .. e{engines - 1}; the engine killed is e{engines}, in a process of its own
    ctx = mp.get_context("spawn")
    res: dict = {"procs": a.procs, "clients_per_proc": a.clients, "ranks": ranks + TP, "engines": engines + 1,
                 "ttl_s": a.ttl, "members": a.members, "fleet_nice": a.fleet_nice, "load_1min_start": round(os.getloadavg()[0], 2)}
    with EtcdCluster(a.members) as ec:   # started by the with
        url = ec.url(f"fleet{os.getpid()}", ttl=a.ttl)
        alone = paced_alone(url, a)
        res["paced"] = {"per_s": a.paced, "seconds": a.paced_s, "alone_lookup_ms": lat_ms(alone)}
        usage = {"start": etcd_usage(ec)}
        cmds = [ctx.Queue() for _ in range(a.procs + 1)]
        out = ctx.Queue()
        held = [range(w * a.clients, (w + 1) * a.clients) for w in range(a.procs)] + [range(ranks, ranks + TP)]
        procs = [ctx.Process(target=worker, args=(w, held[w], a, url, engines, cmds[w], out), daemon=True)
                 for w in range(a.procs + 1)]
        fleet = Fleet(procs=procs, cmds=cmds, out=out)
        t0 = time.perf_counter()
        for p in procs:
            p.start()
        try:
            ok = measure(a, res, ec, fleet, usage, t0, url=url, engines=engines)
        except WorkerFailed as exc:   # the figures so far, and why the run stopped
            res["failed"] = str(exc)
            ok = False
        usage["end"] = etcd_usage(ec)
    res["etcd"] = {**usage,
                   "cpu_s_total": round(sum(m["cpu_s"] for m in usage["end"])
                                        - sum(m["cpu_s"] for m in usage["start"]), 2),
                   "rss_mib_max": max(m["rss_mib"] for m in usage["end"])}
    res["load_1min_end"] = round(os.getloadavg()[0], 2)
    text = json.dumps(res, indent=1)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")
    return 0 if ok else 1


class Fleet:
    """The worker processes, their command queues and the one report queue."""

    def __init__(self, *, procs: list, cmds: list, out: mp.Queue) -> None:
        self.procs, self.cmds, self.out = procs, cmds, out
        self.killed: set[int] = set()

    def collect(self, kind: str, n: int, timeout: float = 600) -> dict:
        """`n` reports of `kind`. A worker's failure report, or a worker gone without one (but the
        one killed on purpose), raises WorkerFailed with its reason at once."""
        got: dict = {}
        deadline = time.monotonic() + timeout
        while len(got) < n:
            try:
                k, w, data = self.out.get(timeout=1.0)
            except queue.Empty:
                dead = [w for w, p in enumerate(self.procs) if p.exitcode is not None and w not in self.killed]
                if dead:
                    raise WorkerFailed(f"waiting for {kind!r}: workers {dead} exited without a report") from None
                if time.monotonic() > deadline:
                    raise WorkerFailed(f"no {kind!r} report from every worker in {timeout:.0f} s") from None
                continue
            if k == "failed":
                raise WorkerFailed(f"worker {w} failed while the run waited for {kind!r}: {data}")
            assert k == kind, (k, kind)
            got[w] = data
        return got


def measure(a: argparse.Namespace, res: dict, ec: EtcdCluster, fleet: Fleet, usage: dict, t0: float, *,
            url: str, engines: int) -> bool:
    """Registration, lookups, then the kill and the rank-gone notices; the figures go into `res`,
    etcd's usage at each stage into `usage`. True when every notice came within TTL + 2 s."""
    got = fleet.collect("registered", a.procs + 1).values()
    reg = [x for v, _, _ in got for x in v]
    res["register_refused"] = sum(len(r) for _, r, _ in got)
    res["register_refused_examples"] = sorted({x for _, r, _ in got for x in r})[:3]
    res["fleet_niceness_seen"] = sorted({n for _, _, n in got})
    res["register_all_s"] = round(time.perf_counter() - t0, 2)
    res["register_ms"] = {"p50": round(pct(reg, 50) * 1e3, 2), "p99": round(pct(reg, 99) * 1e3, 2)}
    usage["after_register"] = etcd_usage(ec)
    for c in fleet.cmds:
        c.put("lookup")
    t1 = time.perf_counter()
    lat = [x for v in fleet.collect("looked_up", a.procs + 1).values() for x in v]
    took = time.perf_counter() - t1
    res["lookups"] = len(lat)
    res["lookup_ms"] = {"p50": round(pct(lat, 50) * 1e3, 2), "p90": round(pct(lat, 90) * 1e3, 2),
                        "p99": round(pct(lat, 99) * 1e3, 2), "max": round(max(lat, default=0) * 1e3, 2),
                        "mean": round(statistics.fmean(lat) * 1e3, 2) if lat else 0.0}
    res["lookups_per_s"] = round(len(lat) / took, 1)
    usage["after_lookups"] = etcd_usage(ec)
    lat = paced(url, [f"e{i}" for i in range(engines)], a.paced, a.paced_s)
    res["paced"]["lookups"] = len(lat)
    res["paced"]["lookup_ms"] = lat_ms(lat)
    usage["after_paced"] = etcd_usage(ec)
    victim = a.procs
    target = f"e{engines}"
    for w in range(victim):
        fleet.cmds[w].put(target)
    fleet.collect("watching", victim)
    time.sleep(a.ttl / 3 + 0.5)   # past the victim's next keepalive, so its leases are fresh
    t_kill = time.time()
    fleet.killed.add(victim)
    fleet.procs[victim].kill()
    fleet.procs[victim].join()
    want = victim * a.clients * TP   # every client of the other processes hears of each of its ranks
    deadline = time.monotonic() + a.ttl + 30
    delays: list[float] = []
    while time.monotonic() < deadline:
        time.sleep(0.5)
        for w in range(victim):
            fleet.cmds[w].put("report")
        heard = fleet.collect("heard", victim)
        delays = [t - t_kill for v in heard.values() for (e, _, t) in v if e == target]
        if len(delays) >= want:
            break
    res["watch"] = {"engine": target, "notices_expected": want, "notices": len(delays),
                    "delay_after_kill_s": {"min": round(min(delays, default=0), 2),
                                           "p50": round(pct(delays, 50), 2), "p99": round(pct(delays, 99), 2),
                                           "max": round(max(delays, default=0), 2)},
                    "goal_s": a.ttl + 2, "leader_changes_since_lookups": leader_changes_since(usage, ec)}
    for w in range(victim):
        fleet.cmds[w].put("stop")
    fleet.collect("stopped", victim)
    for p in fleet.procs[:victim]:
        p.join(60)
    return res["watch"]["notices"] >= want and res["watch"]["delay_after_kill_s"]["max"] <= a.ttl + 2


def leader_changes_since(usage: dict, ec: EtcdCluster) -> int | None:
    """The most leader changes any member saw since the paced lookups ended (None: not known)."""
    now = {m["member"]: m["leader_changes"] for m in etcd_usage(ec)}
    seen = [now[m["member"]] - m["leader_changes"] for m in usage["after_paced"]
            if m["leader_changes"] is not None and now.get(m["member"]) is not None]
    return max(seen) if seen else None


if __name__ == "__main__":
    sys.exit(main())
