"""What end-to-end verify costs: the same requests with EngineConfig(verify=False) and
verify=True, alternated in one run, staged (P1 -> D2) and direct (P1 -> D2), per-request medians
and their ratio (goal: under 15% on the 2048-token staged request).

    .venv/bin/python examples/bench_verify.py --transports nixl,mooncake --tokens 2048 --requests 5
"""

from __future__ import annotations

import argparse
import statistics
import sys

from kvstage.support import bench


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--transports", type=bench._transports, default="nixl,mooncake")
    p.add_argument("--paths", default="staged,direct")
    p.add_argument("--tokens", type=bench._int(1), default=2048)
    p.add_argument("--requests", type=bench._int(2), default=5, help="timed requests per run (plus one warm-up)")
    p.add_argument("--rounds", type=bench._int(1), default=2, help="alternated off/on pairs")
    bench.add_model_args(p, layers=32)
    p.add_argument("--json", default="docs/bench/verify.json")
    a = p.parse_args(argv)
    a.chunk_tokens = 0
    return a


def one_run(a, transport: str, path: str, verify: bool) -> float:
    pages = -(-a.tokens // a.page_size)
    rooms = [{"room": i + 1, "pages": pages, "chunks": [pages], "drain_before": True} for i in range(a.requests + 1)]
    recs = bench.run_kvstage(a, transport, 1, 2, path == "staged", rooms, bench.geometry(a, a.tokens), verify=[1],
                             extra={"verify": verify})
    return statistics.median(bench.per_request_seconds(recs[1:]))


def main(argv=None) -> int:
    a = parse(argv)
    nbytes = -(-a.tokens // a.page_size) * a.page_size * bench.token_bytes(a)
    lines = [f"verify off vs on, P1 -> D2, {a.tokens} tokens ({nbytes / 2**20:.0f} MiB of KV, {a.layers} layers), "
             f"{a.requests} timed requests per run, {a.rounds} rounds alternated; per-request medians"]
    out = {"args": vars(a), "results": []}
    for transport in a.transports:
        for path in a.paths.split(","):
            runs = {False: [], True: []}
            for _ in range(a.rounds):
                for verify in (False, True):
                    runs[verify].append(one_run(a, transport, path, verify))
            off, on = statistics.median(runs[False]), statistics.median(runs[True])
            cost = on / off - 1
            out["results"].append({"transport": transport, "path": path, "off_s": off, "on_s": on, "cost": cost,
                                   "runs_off": runs[False], "runs_on": runs[True]})
            lines.append(f"{transport:9s} {path:7s} off {off * 1e3:8.2f} ms ({nbytes / off / 1e9:5.2f} GB/s)  "
                         f"on {on * 1e3:8.2f} ms ({nbytes / on / 1e9:5.2f} GB/s)  cost {cost * 100:+6.1f} %"
                         + ("  (goal < 15 %)" if path == "staged" else ""))
    print("\n".join(lines))
    bench.save_json(a.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
