"""PD request latency through real vLLM servers: kvstage's connector against vLLM's NixlConnector.

Per decode TP size (1, 2), one run starts PD pairs side by side (`python -m
vllm.entrypoints.openai.api_server`, CPU, a tiny random Llama built here): one with the kvstage
connector, one with vLLM's NixlConnector (`kv_buffer_device: cpu`), and with `--connectors ...
nixl-push` one with vLLM's NixlPushConnector. Rounds alternate the order of the pairs (as given
on even rounds, reversed on odd ones); each round sends the same greedy
prompts one at a time through the two-step PD proxy (support/vllm_proxy.py) after one
untimed warm-up request per pair. It prints per connector and decode TP the median and p90
request latency (client send to full answer), the median decode leg (the decode request, which
includes the KV transfer: kvstage pushes while it waits, NIXL pulls), kvstage's own transfer
seconds per request (its Prometheus histogram on the decode ranks), the CPU seconds per request
of the prefill and decode server process trees, and checks that every connector answered every
prompt with the same tokens as the first one. Every server is stopped by its PID.

    .venv-vllm/bin/python examples/bench_vllm.py --rounds 4 --decode-tp 1 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import psutil

from kvstage.support.cluster import free_port
from kvstage.support.vllm_proxy import pd_complete
from kvstage.support.vllm_servers import (
    Proc,
    build_tiny_model,
    env_for,
    kvstage_config,
    metric,
    nixl_config,
    server_argv,
    wait_healthy,
)

ENV = {"KVSTAGE_RING_MB": "16", "KVSTAGE_STAGING_BUFFER_MB": "8"}


def tree_cpu(p: Proc) -> float:
    """CPU seconds of a server's whole process tree so far."""
    total = 0.0
    try:
        root = psutil.Process(p.proc.pid)
        for q in [root, *root.children(recursive=True)]:
            try:
                t = q.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
    except psutil.NoSuchProcess:
        pass
    return total


class Pair:
    def __init__(self, name: str, model: str, logs: Path, decode_tp: int):
        self.name = name
        self.pp, self.dp, self.dm = free_port(), free_port(), free_port()
        if name == "kvstage":
            p_kv = kvstage_config("kv_producer", free_port())
            d_kv = kvstage_config("kv_consumer", free_port(), metrics_port=self.dm)
            p_env, d_env = env_for("nobind", **ENV), env_for("nobind", **ENV)
        else:
            connector = {"nixl": "NixlConnector", "nixl-push": "NixlPushConnector"}[name]
            p_kv, d_kv = nixl_config("kv_producer", connector), nixl_config("kv_consumer", connector)
            p_env = env_for("nobind", VLLM_NIXL_SIDE_CHANNEL_PORT=str(free_port()))
            d_env = env_for("nobind", VLLM_NIXL_SIDE_CHANNEL_PORT=str(free_port()))
        self.prefill = Proc(f"{name}-prefill", server_argv(model, self.pp, "--served-model-name", "m", kv=p_kv),
                            logs / f"{name}-tp{decode_tp}-prefill.log", p_env)
        self.decode = Proc(f"{name}-decode", server_argv(model, self.dp, "--served-model-name", "m", tp=decode_tp,
                                                         kv=d_kv), logs / f"{name}-tp{decode_tp}-decode.log", d_env)
        self.procs = [self.prefill, self.decode]
        self.p_url, self.d_url = f"http://127.0.0.1:{self.pp}", f"http://127.0.0.1:{self.dp}"
        self.decode_tp = decode_tp

    def run(self, ids: list[int], max_tokens: int) -> tuple[list[int], float, float]:
        t0 = time.perf_counter()
        out, _, _, decode_s = pd_complete(self.p_url, self.d_url, ids, max_tokens, self.procs)
        return out, time.perf_counter() - t0, decode_s

    def kvstage_transfer_s(self) -> float:
        if self.name != "kvstage":
            return float("nan")
        return sum(metric(f"http://127.0.0.1:{self.dm + r}", "kvstage_transfer_seconds_sum")
                   for r in range(self.decode_tp)) / self.decode_tp

    def stop(self):
        for p in self.procs:
            p.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--decode-tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--prompt-tokens", type=int, nargs="+", default=[64, 256, 600])
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--connectors", nargs="+", default=["kvstage", "nixl"], choices=["kvstage", "nixl", "nixl-push"])
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--logs", type=Path, help="keep the servers' logs in this folder (default: deleted)")
    a = ap.parse_args()
    prompts = [[(7 * i + 3) % 500 + 3 for i in range(n)] for n in a.prompt_tokens]
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        model = build_tiny_model(Path(tmp) / "model")
        logs = a.logs or Path(tmp)
        logs.mkdir(parents=True, exist_ok=True)
        for tp in a.decode_tp:
            pairs = [Pair(name, model, logs, tp) for name in a.connectors]
            try:
                procs = [p for pair in pairs for p in pair.procs]
                wait_healthy(procs, [u for pair in pairs for u in (pair.p_url, pair.d_url)])
                for pair in pairs:
                    pair.run(prompts[0], a.max_tokens)        # warm-up, untimed
                stats = {pair.name: {"lat": [], "decode": [], "cpu_p": 0.0, "cpu_d": 0.0, "n": 0, "out": []}
                         for pair in pairs}
                t_kv0 = {pair.name: pair.kvstage_transfer_s() for pair in pairs}
                for r in range(a.rounds):
                    for pair in (pairs if r % 2 == 0 else pairs[::-1]):
                        s = stats[pair.name]
                        c0 = tree_cpu(pair.prefill), tree_cpu(pair.decode)
                        for ids in prompts:
                            out, lat, dec = pair.run(ids, a.max_tokens)
                            s["lat"].append(lat)
                            s["decode"].append(dec)
                            if r == 0:
                                s["out"].append(out)
                        s["cpu_p"] += tree_cpu(pair.prefill) - c0[0]
                        s["cpu_d"] += tree_cpu(pair.decode) - c0[1]
                        s["n"] += len(prompts)
                first = stats[pairs[0].name]["out"]
                same = all(s["out"] == first for s in stats.values())
                for pair in pairs:
                    name, s = pair.name, stats[pair.name]
                    kv_transfer = (pair.kvstage_transfer_s() - t_kv0[name]) / max(1, s["n"])
                    lat = sorted(s["lat"])
                    row = {"connector": name, "decode_tp": tp, "requests": s["n"],
                           "latency_p50_ms": 1e3 * statistics.median(lat),
                           "latency_p90_ms": 1e3 * lat[int(0.9 * (len(lat) - 1))],
                           "decode_leg_p50_ms": 1e3 * statistics.median(s["decode"]),
                           "kvstage_transfer_ms": 1e3 * kv_transfer if name == "kvstage" else None,
                           "prefill_cpu_s_per_req": s["cpu_p"] / s["n"], "decode_cpu_s_per_req": s["cpu_d"] / s["n"],
                           "same_tokens": same}
                    results.append(row)
                    print(json.dumps(row), flush=True)
            finally:
                for pair in pairs:
                    pair.stop()
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
