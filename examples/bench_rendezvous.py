"""Lookup latency of the two rendezvous, in the same run: the bootstrap server and etcd.

    .venv/bin/python examples/bench_rendezvous.py                  # 1000 lookups each, TP 8, 3 etcd members
    .venv/bin/python examples/bench_rendezvous.py --lookups 5000 --tp 2 --members 1 --json out.json

It starts a bootstrap server (python -m kvstage.bootstrap) and an etcd cluster on this machine
(support/etcd_cluster.py; Debian's etcd-server), registers one prefill engine of --tp ranks in
each, and times --lookups complete lookups of it through each client (kvstage.bootstrap's
BootstrapClient and the etcd rendezvous), alternating rounds of 100 so that both see the same
machine load. A lookup is what a decode rank does when it first meets a prefill engine: every
rank's record, sorted, once all are there (etcd: one linearizable range read of the engine's keys).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from kvstage.bootstrap import RankInfo, open_rendezvous
from kvstage.support.cluster import start_bootstrap
from kvstage.support.etcd_cluster import EtcdCluster

ROUND = 100


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--lookups", type=int, default=1000, help="timed lookups per rendezvous")
    p.add_argument("--tp", type=int, default=8, help="ranks of the engine looked up")
    p.add_argument("--members", type=int, default=3, help="etcd cluster members")
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--json", help="write the figures here")
    a = p.parse_args(argv)
    if a.lookups < 1 or a.tp < 1 or a.members < 1:
        p.error("--lookups, --tp and --members must be >= 1")
    return a


def ranks(tp: int) -> list[RankInfo]:
    return [RankInfo(engine_id="prefill-0", role="prefill", tp_size=tp, tp_rank=r,
                     ctrl_endpoint=f"tcp://10.0.0.{r + 1}:5555", backend="nixl", backend_identity="x" * 600,
                     layout={"num_layers": 32, "head_dim": 128, "dtype": "bfloat16", "mla": False},
                     pools={"kv": 8 << 30, "staging_buffers": 64 << 20}, incarnation=1000 + r)
            for r in range(tp)]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def main(argv=None) -> int:
    a = parse(argv)
    server = start_bootstrap()
    times: dict[str, list[float]] = {"bootstrap server": [], "etcd": []}
    try:
        with EtcdCluster(a.members) as ec:
            clients = {"bootstrap server": open_rendezvous(server.addr), "etcd": open_rendezvous(ec.url("bench"))}
            try:
                for c in clients.values():
                    for info in ranks(a.tp):
                        c.register(info)
                        c.start_keepalive(info)
                    for _ in range(a.warmup):
                        c.lookup("prefill-0", timeout_s=5)
                left = a.lookups
                while left > 0:
                    n = min(ROUND, left)
                    for name, c in clients.items():
                        for _ in range(n):
                            t0 = time.perf_counter()
                            got = c.lookup("prefill-0", timeout_s=5)
                            times[name].append(time.perf_counter() - t0)
                            assert len(got) == a.tp
                    left -= n
            finally:
                for c in clients.values():
                    c.close()
    finally:
        server.stop()
    out = {"lookups": a.lookups, "tp": a.tp, "etcd_members": a.members, "results": {}}
    print(f"lookup latency, {a.lookups} lookups each of an engine of {a.tp} ranks "
          f"(etcd: {a.members} members), same run")
    print(f"  {'rendezvous':<18}{'p50 ms':>10}{'p99 ms':>10}{'mean ms':>10}")
    for name, xs in times.items():
        row = {"p50_ms": pct(xs, 50) * 1e3, "p99_ms": pct(xs, 99) * 1e3, "mean_ms": statistics.fmean(xs) * 1e3}
        out["results"][name] = row
        print(f"  {name:<18}{row['p50_ms']:>10.3f}{row['p99_ms']:>10.3f}{row['mean_ms']:>10.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
