"""PD request latency through real SGLang servers: kvstage against SGLang's own mooncake backend.

One run starts, per phase, a prefill and a decode server (`python -m sglang.launch_server`, CPU,
a tiny random Llama built here) behind `sglang_router --pd-disaggregation --mini-lb`, with
`--disaggregation-transfer-backend kvstage` or `mooncake`, phases alternating (kvstage, mooncake,
kvstage, mooncake, ...). Each phase sends the same short greedy requests one at a time through the
router and times each (client send to full answer); two warm-up requests go first, untimed. It
prints per backend the median and p90 request latency, the ratio, and the transfer latency SGLang
records from each backend's get_transfer_metric() (prefill /metrics), the CPU seconds per request
of the prefill and decode server processes (their whole process trees) and of kvstage's own
threads in them, the latency ratio with a bootstrap interval and per round, and checks that every
phase answered every prompt with the same tokens. Every server is stopped by its PID.

SGLang's mooncake backend runs on CPU with MOONCAKE_PROTOCOL=tcp and a test-only plugin
(tests/sglang_adapter/mooncake_cpu_shim, on PYTHONPATH of those servers only) that turns off its
sender's pinned-memory page-index path (supports_host_tensor_indices), which needs CUDA.

    PYTHONPATH=tests/sglang_adapter/shims .venv-sglang/bin/python examples/bench_sglang.py --requests 8
"""

from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import requests

from kvstage.support import bench
from kvstage.support.sglang_servers import build_tiny_model, env_for, generate, start_pd

ROOT = Path(__file__).resolve().parent.parent

MOONCAKE_SHIM = ROOT / "tests" / "sglang_adapter" / "mooncake_cpu_shim"
BACKENDS = ("kvstage", "mooncake")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=bench._int(1), default=8, help="timed requests per phase")
    p.add_argument("--rounds", type=bench._int(2), default=2, help="phases per backend, alternated")
    p.add_argument("--prompt-tokens", type=bench._int(1), default=40)
    p.add_argument("--max-new", type=bench._int(1), default=8)
    p.add_argument("--kvstage-backend", choices=("nixl", "mooncake"), default="nixl",
                   help="kvstage's own transport underneath (KVSTAGE_SGLANG_BACKEND)")
    p.add_argument("--max-minutes", type=bench._int(1), default=30, help="no new phase starts past this")
    p.add_argument("--json", default="", help="also write the figures here")
    return p.parse_args(argv)


def prompts(a) -> list[list[int]]:
    import random
    return [[random.Random(1000 + i).randrange(3, 512) for _ in range(a.prompt_tokens)] for i in range(a.requests)]


def env_of(backend: str, a) -> dict:
    if backend == "mooncake":
        return env_for(extra_path=(MOONCAKE_SHIM,), MOONCAKE_PROTOCOL="tcp")
    return env_for(KVSTAGE_SGLANG_BACKEND=a.kvstage_backend)


def transfer_metric(prefill_url: str) -> tuple[float, int]:
    """(sum of ms, count) of SGLang's kv_transfer_latency_ms histogram on the prefill server."""
    text = requests.get(f"{prefill_url}/metrics", timeout=10).text
    total = count = 0.0
    for name, val in re.findall(r"^sglang:kv_transfer_latency_ms_(sum|count)\{[^}]*\} (\S+)$", text, re.M):
        if name == "sum":
            total += float(val)
        else:
            count += float(val)
    return total, int(count)


def process_cpu(pid: int) -> tuple[float, float]:
    """(CPU seconds of a server process and all its descendants, of kvstage's threads in them):
    kvstage's threads carry their name in the kernel (staging/thread_meter.py)."""
    import psutil
    try:
        root = psutil.Process(pid)
        tree = [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return 0.0, 0.0
    total = kv = 0.0
    for p in tree:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            continue
        for task in Path(f"/proc/{p.pid}/task").glob("*"):
            try:
                if (task / "comm").read_text().startswith("kvstage"):
                    kv += int((task / "schedstat").read_text().split()[0]) / 1e9
            except (OSError, ValueError, IndexError):
                continue
    return total, kv


def phase(a, model: str, backend: str, logs: Path, ids: list[list[int]]) -> dict:
    procs, url, prefill_url = start_pd(model, logs, env_of(backend, a), backend, extra=("--enable-metrics",))
    try:
        for warm in ids[:2]:
            generate(url, warm, procs, a.max_new)
        before = transfer_metric(prefill_url)
        servers = {p.name: p.proc.pid for p in procs if p.name in ("prefill", "decode")}
        cpu0 = {name: process_cpu(pid) for name, pid in servers.items()}
        seconds, outputs = [], []
        for prompt in ids:   # timed: one try each, a failure ends the run
            body = {"input_ids": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": a.max_new,
                                                             "ignore_eos": True}}
            t0 = time.perf_counter()
            reply = requests.post(f"{url}/generate", json=body, timeout=120)
            seconds.append(time.perf_counter() - t0)
            if reply.status_code != 200:
                raise RuntimeError(f"{backend}: HTTP {reply.status_code}: {reply.text[:300]}")
            outputs.append(reply.json()["output_ids"])
        cpu1 = {name: process_cpu(pid) for name, pid in servers.items()}
        after = transfer_metric(prefill_url)
    finally:
        for p in reversed(procs):
            p.stop()
    n = after[1] - before[1]
    cpu = {name: {"server_s": (cpu1[name][0] - cpu0[name][0]) / len(ids),
                  "kvstage_threads_s": (cpu1[name][1] - cpu0[name][1]) / len(ids)} for name in cpu0}
    return {"backend": backend, "seconds": seconds, "outputs": outputs, "cpu_per_request": cpu,
            "transfer_ms": (after[0] - before[0]) / n if n > 0 else None, "transfers": n}


def ratio_interval(k: list[float], m: list[float], draws: int = 2000) -> tuple[float, float]:
    """A 90 % bootstrap interval of median(k) / median(m), the requests resampled per backend."""
    import random
    rng = random.Random(0)
    out = sorted(statistics.median(rng.choices(k, k=len(k))) / statistics.median(rng.choices(m, k=len(m)))
                 for _ in range(draws))
    return out[int(0.05 * draws)], out[int(0.95 * draws) - 1]


def p90(xs: list[float]) -> float:
    s = sorted(xs)
    return s[max(0, math.ceil(0.9 * len(s)) - 1)]


def main(argv=None) -> int:
    a = parse(argv)
    deadline = time.monotonic() + a.max_minutes * 60
    work = Path(tempfile.mkdtemp(prefix="bench-sglang-"))
    model = build_tiny_model(work / "tiny-llama")
    ids = prompts(a)
    load0 = os.getloadavg()
    runs = []
    for r in range(a.rounds):
        for backend in BACKENDS:
            if time.monotonic() > deadline:
                print(f"stopping early: past --max-minutes {a.max_minutes}", file=sys.stderr)
                break
            logs = work / f"{len(runs)}-{backend}"
            logs.mkdir()
            runs.append(phase(a, model, backend, logs, ids))
            x = runs[-1]
            print(f"phase {len(runs)} {backend:8s} median {statistics.median(x['seconds']) * 1e3:8.1f} ms", flush=True)
    load1 = os.getloadavg()
    lines = [f"PD request latency, real SGLang servers on CPU (P1 -> D1, tiny Llama), {a.requests} greedy requests "
             f"of {a.prompt_tokens} prompt tokens and {a.max_new} new tokens per phase, one at a time, "
             f"{len(runs)} phases alternated; kvstage over {a.kvstage_backend}, mooncake over tcp",
             f"load average (1 min) {load0[0]:.2f} at start, {load1[0]:.2f} at end, {os.cpu_count()} cores"]
    summary = {}
    for backend in BACKENDS:
        mine = [x for x in runs if x["backend"] == backend]
        all_s = [s for x in mine for s in x["seconds"]]
        if not all_s:
            continue
        ms = [x["transfer_ms"] for x in mine if x["transfer_ms"] is not None]
        cpu = {side: {what: statistics.median(x["cpu_per_request"][side][what] for x in mine)
                      for what in ("server_s", "kvstage_threads_s")} for side in ("prefill", "decode")}
        summary[backend] = {"median_s": statistics.median(all_s), "p90_s": p90(all_s), "all_s": all_s,
                            "phase_medians_s": [statistics.median(x["seconds"]) for x in mine],
                            "transfer_ms": statistics.median(ms) if ms else None, "cpu_per_request": cpu}
        s = summary[backend]
        lines.append(f"{backend:8s} median {s['median_s'] * 1e3:8.1f} ms  p90 {s['p90_s'] * 1e3:8.1f} ms  "
                     f"phase medians {', '.join(f'{v * 1e3:.1f}' for v in s['phase_medians_s'])} ms  "
                     f"transfer (get_transfer_metric) "
                     + (f"{s['transfer_ms']:.2f} ms" if s["transfer_ms"] is not None else "n/a"))
        lines.append(f"{'':8s} CPU per request (median over phases): "
                     + ", ".join(f"{side} server {c['server_s'] * 1e3:.1f} ms (kvstage threads "
                                 f"{c['kvstage_threads_s'] * 1e3:.2f} ms)" for side, c in cpu.items()))
    if len(summary) == 2:
        k, m = summary["kvstage"], summary["mooncake"]
        lo, hi = ratio_interval(k["all_s"], m["all_s"])
        rounds = [statistics.median(x["seconds"]) / statistics.median(y["seconds"])
                  for x, y in zip([x for x in runs if x["backend"] == "kvstage"],
                                  [x for x in runs if x["backend"] == "mooncake"])]
        lines.append(f"ratio kvstage / mooncake: median {k['median_s'] / m['median_s']:.3f} "
                     f"(90 % bootstrap interval {lo:.3f}-{hi:.3f}; per round {', '.join(f'{r:.3f}' for r in rounds)}), "
                     f"p90 {k['p90_s'] / m['p90_s']:.3f}")
        for side in ("prefill", "decode"):
            kc, mc = k["cpu_per_request"][side]["server_s"], m["cpu_per_request"][side]["server_s"]
            lines.append(f"{side} server CPU per request kvstage / mooncake: {kc / mc:.3f}" if mc else
                         f"{side} server CPU per request: mooncake measured none")
    same = all(x["outputs"] == runs[0]["outputs"] for x in runs)
    lines.append(f"outputs token-identical across all phases and both backends: {'yes' if same else 'NO'}")
    lines.append(f"server logs: {work}")
    print("\n".join(lines))
    if a.json:
        bench.save_json(a.json, {"args": vars(a), "summary": summary, "runs": runs, "load": [load0, load1],
                                 "identical": same})
    return 0 if same and len(summary) == 2 else 1


if __name__ == "__main__":
    sys.exit(main())
