"""A fleet of prefill and decode engines driven through the pure protocol on one machine.

    .venv/bin/python examples/fleet_sim.py                                  # 64 x 64 engines, TP 8, 10,000 in flight
    .venv/bin/python examples/fleet_sim.py --prefill 4 --decode 4 --in-flight 1000 --json out.json
    .venv/bin/python examples/fleet_sim.py --prefill-tp 8,4 --decode-tp 1,2,4,8 --loss 0.001

Each request goes from one prefill engine to one decode engine of the same model (a GQA model
with 8 KV heads and pages of --page-size tokens, and an MLA model with pages of 64 tokens):
chunked or layer by layer, some with a prefix the decode side holds, some aborted, some ranks
killed early on, room ids reused. kvstage.sim.fleet is the engine shell around the rooms; it
checks every invariant at the end and this tool exits 1 when one broke. What it prints (JSON):
control messages and bytes per request by type, ring occupancy and fairness, memory per room in
flight, the rooms' CPU time per request, heartbeats per rank, rendezvous lookups per request,
and how long a dead rank's requests took to fail; with --engine-leases, the beats of engine-pair
leases over the same connections. docs/scale.md has the results.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

from kvstage.sim.beats import fleet_beats
from kvstage.sim.fleet import Fleet, FleetConfig, Model
from kvstage.sim.network import NetworkModel
from kvstage.sim.report import peer_activity, room_memory, summarize


def tps(s: str) -> tuple[int, ...]:
    out = tuple(int(x) for x in s.split(","))
    if not out or any(t not in (1, 2, 4, 8) for t in out):
        raise argparse.ArgumentTypeError(f"TP sizes are 1, 2, 4 or 8, got {s}")
    return out


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--prefill", type=int, default=64, help="prefill engines")
    p.add_argument("--decode", type=int, default=64, help="decode engines")
    p.add_argument("--prefill-tp", type=tps, default=(8,), help="TP sizes of the prefill engines, in turn")
    p.add_argument("--decode-tp", type=tps, default=(8,), help="TP sizes of the decode engines, in turn")
    p.add_argument("--requests", type=int, default=0, help="requests in all (0: 1.2 x --in-flight)")
    p.add_argument("--in-flight", type=int, default=10_000)
    p.add_argument("--page-size", type=int, default=16, help="tokens per page of the GQA model (1..64)")
    p.add_argument("--mla", action=argparse.BooleanOptionalAction, default=True, help="also serve an MLA model")
    p.add_argument("--loss", type=float, default=0.0, help="probability a control message is lost")
    p.add_argument("--deaths", type=int, default=2, help="ranks killed while requests are in flight")
    p.add_argument("--aborts", type=float, default=0.01)
    p.add_argument("--ring-mib", type=int, default=8, help="each decode rank's staging ring")
    p.add_argument("--watermark-to-all", action="store_true",
                   help="send each watermark move to every staging peer (the engine before watermark_fanout.py)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--memory-sample", type=int, default=200, help="rooms per side whose memory is measured")
    p.add_argument("--json", help="write the figures here too")
    p.add_argument("--engine-leases", type=float, default=0.0, metavar="SECONDS",
                   help="then drive engine-pair leases (kvstage.sim.beats) over the fleet's connections for "
                        "this many simulated seconds, one rank killed and one cut off half-way (0: not)")
    a = p.parse_args(argv)
    if a.prefill < 1 or a.decode < 1 or a.in_flight < 1 or not 1 <= a.page_size <= 64:
        p.error("--prefill, --decode and --in-flight must be >= 1, --page-size 1..64")
    return a


def config(a: argparse.Namespace) -> FleetConfig:
    models = (Model(name=f"gqa-p{a.page_size}", mla=False, heads=8, layers=4, page_size=a.page_size),)
    if a.mla:
        models += (Model(name="mla-p64", mla=True, heads=1, layers=4, page_size=64),)
    return FleetConfig(prefill_engines=a.prefill, decode_engines=a.decode, prefill_tp=a.prefill_tp,
                       decode_tp=a.decode_tp, models=models, requests=a.requests or int(a.in_flight * 1.2),
                       in_flight=a.in_flight, aborts=a.aborts, deaths=a.deaths, ring_bytes=a.ring_mib << 20,
                       network=NetworkModel(loss=a.loss), seed=a.seed,
                       watermark_to_all=a.watermark_to_all)


def commit() -> str:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None) -> int:
    a = parse(argv)
    load0, head = os.getloadavg()[0], commit()   # the code that runs: HEAD when it starts
    fleet = Fleet(config(a))
    memory: dict = {}
    peers: dict = {}

    def measure() -> None:   # once the first requests' rooms are all set up and mid-transfer
        memory.update(room_memory(fleet, a.memory_sample))
        peers.update(peer_activity(fleet, fleet.cfg.timeouts.lease / 4))
    fleet.at(0.035, "hook", measure)
    fleet.at(0.5, "hook", lambda: peers.update(late=peer_activity(fleet, fleet.cfg.timeouts.lease / 4)))
    t, cpu = time.perf_counter(), time.process_time()
    fleet.run()
    wall = time.perf_counter() - t - fleet.hook_s
    cpu = time.process_time() - cpu - fleet.hook_s
    out = summarize(fleet, wall)
    out["cpu_s"] = round(cpu, 1)   # the process's CPU time: the wall time a quiet core would take
    out["memory_per_room_in_flight"] = memory
    out["heartbeats_in_flight"] = peers
    broken = out["invariants_broken"]
    if a.engine_leases > 0:
        t = time.perf_counter()
        beats = fleet_beats(fleet, a.engine_leases, seed=a.seed)
        out["engine_leases"] = {**beats.summary(), "wall_s": round(time.perf_counter() - t, 1)}
        broken = broken or bool(beats.false_losses or beats.fence_breaks or beats.missed)
    out["run"] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": head,
                  "load_1min_start": round(load0, 2), "load_1min_end": round(os.getloadavg()[0], 2), "cpus": os.cpu_count(), "python": platform.python_version(),
                  "command": "examples/fleet_sim.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    text = json.dumps(out, indent=1)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
