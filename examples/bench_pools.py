"""What a Mamba-like state pool costs beside the KV: the same requests, P4 -> D2 staged, with and
without a heads-sharded pool of one slot per request and one tensor per layer, alternated in one
run. Prints backend writes (the pool must add none) and per-request seconds against what the
pool's bytes would cost at the write bandwidth measured without it, with a bootstrap interval of
the ratio (six rank processes on two cores make single runs vary by tens of percent); first, the
staging copies of one writer measured in this process (examples/bench_pool_copies.py).

    .venv/bin/python examples/bench_pools.py --transports nixl,mooncake --tokens 2048 --requests 6
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys

import bench_pool_copies
import numpy as np

from kvstage.support import bench


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--transports", type=bench._transports, default="nixl,mooncake")
    p.add_argument("--tokens", type=bench._int(1), default=2048)
    p.add_argument("--requests", type=bench._int(2), default=6, help="timed requests per run (plus one warm-up)")
    p.add_argument("--rounds", type=bench._int(1), default=2, help="alternated without/with pairs")
    bench.add_model_args(p, layers=8)
    p.add_argument("--ssm-heads", type=bench._int(1), default=8)
    p.add_argument("--ssm-state", type=bench._ints, default="64,128", help="one head's state per layer (fp32)")
    p.add_argument("--own-writes", action="store_true",
                   help="the pool in a region of its own (StatePool(own_writes=True)): what a host pool "
                        "beside a device cache does; staged: bounce copies, direct: its own writes")
    p.add_argument("--direct", action="store_true", help="the direct path instead of the staged one")
    p.add_argument("--json", default="docs/bench/pools.json")
    a = p.parse_args(argv)
    a.chunk_tokens = 0
    return a


def one_run(a, transport: str, with_pool: bool) -> dict:
    pages = -(-a.tokens // a.page_size)
    geom = bench.geometry(a, a.tokens, 1)
    if with_pool:
        geom["pools"] = {"ssm": {"sharding": "heads", "heads": a.ssm_heads, "items": a.requests + 2,
                                 "tensors": [["float32", list(a.ssm_state)]] * a.layers,
                                 "own_writes": a.own_writes}}
    rooms = [{"room": i + 1, "pages": pages, "chunks": [pages], "drain_before": True,
              **({"pool_items": {"ssm": 1}} if with_pool else {})} for i in range(a.requests + 1)]
    recs = bench.run_kvstage(a, transport, 4, 2, not a.direct, rooms, geom, verify=[1])
    secs = bench.per_request_seconds(recs[1:])
    st = recs[0]["stats"]
    rooms_done = len(recs)  # the warm-up included: the engine's counters cover it too
    return {"seconds": statistics.median(secs), "samples": secs,
            "copy_s": (sum(s.get("gather_s", 0.0) for s in st["prefill"])
                       + sum(s.get("scatter_s", 0.0) for s in st["decode"])) / rooms_done,
            "prefill_writes": sum(s.get("write_requests", 0) for s in st["prefill"]),
            "decode_tags": sum(s.get("tags_received", 0) for s in st["decode"])}


def ratio_interval(without: list[float], with_: list[float], draws: int = 2000) -> tuple[float, float]:
    """95 % bootstrap interval of median(with) / median(without), resampling requests. It does not
    cover the run-to-run spread (a run's rank processes settle into faster or slower patterns on
    two cores): the per-round ratios show that."""
    rng = np.random.default_rng(0)
    a, b = np.asarray(without), np.asarray(with_)
    r = [np.median(rng.choice(b, b.size)) / np.median(rng.choice(a, a.size)) for _ in range(draws)]
    return float(np.percentile(r, 2.5)), float(np.percentile(r, 97.5))


def _ms(seconds: list[float]) -> str:
    return "[" + ", ".join(f"{s * 1e3:.1f}" for s in seconds) + "]"


def main(argv=None) -> int:
    a = parse(argv)
    kv_bytes = -(-a.tokens // a.page_size) * a.page_size * bench.token_bytes(a)
    pool_bytes = a.layers * a.ssm_heads * math.prod(a.ssm_state) * 4
    lines = [f"P4 -> D2 {'direct' if a.direct else 'staged'}{', pool with own_writes' if a.own_writes else ''}, {a.tokens} tokens ({kv_bytes / 2**20:.1f} MiB of KV), Mamba-like pool "
             f"{pool_bytes / 2**20:.2f} MiB per request ({a.layers} layers x {a.ssm_heads} heads x "
             f"{a.ssm_state} fp32), {a.requests} timed requests per run, {a.rounds} rounds alternated"]
    out = {"args": {k: v for k, v in vars(a).items()}, "results": []}
    copies = bench_pool_copies.measure(layers=a.layers, heads=a.heads // 4, head_dim=a.head_dim,
                                       page_size=a.page_size, tokens=a.tokens, state=tuple(a.ssm_state))
    out["copies"] = copies
    lines += bench_pool_copies.report(copies)
    for transport in a.transports:
        runs = {False: [], True: []}
        for _ in range(a.rounds):
            for with_pool in (False, True):
                runs[with_pool].append(one_run(a, transport, with_pool))
        every = {w: [x for r in runs[w] for x in r["samples"]] for w in (False, True)}
        base, pooled = statistics.median(every[False]), statistics.median(every[True])
        low, high = ratio_interval(every[False], every[True])
        expected = base * (kv_bytes + pool_bytes) / kv_bytes   # the pool's bytes at the measured bandwidth
        row = {"transport": transport, "without_s": base, "with_s": pooled, "expected_s": expected,
               "ratio_interval": [low, high],
               "round_ratios": [w["seconds"] / o["seconds"] for o, w in zip(runs[False], runs[True])],
               "writes_without": [r["prefill_writes"] for r in runs[False]],
               "writes_with": [r["prefill_writes"] for r in runs[True]],
               "tags_without": [r["decode_tags"] for r in runs[False]], "tags_with": [r["decode_tags"] for r in runs[True]],
               "copy_without_s": statistics.median(r["copy_s"] for r in runs[False]),
               "copy_with_s": statistics.median(r["copy_s"] for r in runs[True]),
               "runs_without_s": [r["seconds"] for r in runs[False]], "runs_with_s": [r["seconds"] for r in runs[True]],
               "samples_without_s": [r["samples"] for r in runs[False]], "samples_with_s": [r["samples"] for r in runs[True]]}
        out["results"].append(row)
        lines.append(f"{transport:9s} without pool {base * 1e3:8.2f} ms  with pool {pooled * 1e3:8.2f} ms  "
                     f"ratio {pooled / base:5.3f} [requests' 95 % {low:.2f}-{high:.2f}]  (bytes alone: {expected / base:5.3f})  backend writes per run "
                     f"without {row['writes_without']} with {row['writes_with']}")
        if row["copy_without_s"]:   # the direct path has no staging copies
            lines.append(f"{'':9s} staging copies (gather + scatter, all ranks) per request: without "
                         f"{row['copy_without_s'] * 1e3:.2f} ms, with {row['copy_with_s'] * 1e3:.2f} ms, ratio "
                         f"{row['copy_with_s'] / row['copy_without_s']:.3f} (bytes alone: {expected / base:5.3f})")
        lines.append(f"{'':9s} per-run medians, ms: without {_ms(row['runs_without_s'])} with {_ms(row['runs_with_s'])}; "
                     f"ratio per round " + ", ".join(f"{r:.2f}" for r in row["round_ratios"]))
    print("\n".join(lines))
    bench.save_json(a.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
