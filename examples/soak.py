"""Soak: random requests, random aborts, random kills and freezes, for as long as you like.

    .venv/bin/python examples/soak.py --minutes 30 [--backend mooncake] [--json out.json]

Runs epochs until the time is up. Each epoch starts a bootstrap server and the ranks of a prefill
TP 2 -> decode TP 1 group (staged) in separate processes, and sends a random batch of requests
(random lengths and chunking, some aborted by either side) in two halves. Between the halves it
breaks something at random, while the first half is in flight:
  nothing | SIGKILL a prefill rank | SIGKILL the decode rank | SIGSTOP the decode rank past its
  lease, then SIGCONT | restart the bootstrap server
A killed rank is restarted (a new incarnation) for the second half. Every request that succeeds
is verified byte for byte on the decode side. Printed at the end (and written as JSON): rooms
completed, rooms failed (by kind), bytes verified, corruptions found (must be 0), hangs (must be
0: a rank that did not finish its requests in time).

--starve runs it starved, the way kvstage runs in a busy serving engine: every rank process has a
thread that always wants the GIL (pd_rank.py's gil_hog: the scheduler loop's stand-in), and
4 x os.cpu_count() CPU burner processes (pure busy loops, not niced: they compete with the ranks
as the serving engine's other busy processes do) run for the whole soak and are killed at its
end, however it ends. The deadlines are the production ones (Timeouts()), not the soak's short
ones. --faults none --no-aborts makes every request one that no fault touched: each must succeed.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

from kvstage.support.cluster import Cluster, rank_spec

GEOM = {"layers": 4, "heads": 4, "head_dim": 64, "dtype": "bfloat16", "page_size": 16, "pages": 1024}
TIMEOUTS = {"lease": 2.0, "heartbeat": 0.25, "connect": 4.0, "bootstrap": 20.0, "close": 3.0, "arrival": 3.0,
            "metadata": 20.0, "write": 6.0, "watermark": 10.0, "room": 60.0}
PAGE_BYTES = GEOM["layers"] * 2 * GEOM["heads"] * GEOM["head_dim"] * 2 * GEOM["page_size"]
FAULTS = ["none", "kill_prefill", "kill_decode", "freeze_decode", "restart_bootstrap"]


def make_rooms(rng: random.Random, first: int, n: int, slow: bool) -> list[dict]:
    rooms = []
    for i in range(first, first + n):
        pages = rng.randint(1, 40)
        k = rng.randint(1, min(4, pages))
        cuts = sorted(rng.sample(range(1, pages), k - 1)) if k > 1 else []
        b = [0] + cuts + [pages]
        r = {"room": i, "pages": pages, "chunks": [y - x for x, y in zip(b, b[1:])]}
        if slow:
            r["chunk_delay_s"] = 0.3
        roll = rng.random()
        if not MODE["aborts"]:
            pass
        elif roll < 0.08:
            r["abort_after_chunks"] = rng.randint(0, len(r["chunks"]) - 1)
        elif roll < 0.16:
            r["abort_after_s"] = rng.uniform(0, 0.5)
        rooms.append(r)
    return rooms


RANK_FIELDS = {"staging": True, "geometry": GEOM, "ring_mb": 2, "buffer_mb": 1, "inflight": 8, "timeouts": TIMEOUTS,
               "run_timeout_s": 120}
# no "timeouts": the production ones (Timeouts()). The driver's deadline outlasts every one of
# them (the decode room's 600 s included), so a room still alive at it outlived its own deadline.
STARVED_FIELDS = {"staging": True, "geometry": GEOM, "ring_mb": 2, "buffer_mb": 1, "inflight": 8, "gil_hog": True,
                  "run_timeout_s": 900}
LATENESS = ("ctrl_tick_late_max_s", "ctrl_round_max_s", "backend_step_max_s", "heard_gap_max_s", "silence_max_s")  # stats(), max
MODE = {"fields": RANK_FIELDS, "lease": TIMEOUTS["lease"], "aborts": True}

BURNER = ("import os\nppid = os.getppid()\nwhile os.getppid() == ppid:\n    for _ in range(1_000_000):\n        pass\n")


def start_burners(n: int) -> list[subprocess.Popen]:
    """n pure busy loops in their own processes, at the ranks' priority (not niced). Each also
    stops by itself once the soak that started it is gone (its parent changes), so none can
    outlive a soak killed with SIGKILL by more than a fraction of a second."""
    return [subprocess.Popen([sys.executable, "-c", BURNER]) for _ in range(n)]


def stop_burners(burners: list[subprocess.Popen]) -> None:
    for b in burners:
        if b.poll() is None:
            b.kill()
    for b in burners:
        b.wait()


CHECKS: dict = {}   # --verify / --corrupt-data: {"verify": True} on every rank, the fault on the decode rank


def spec(role, rank, tp, rooms, backend, **kw):
    extra = {"verify": True} if CHECKS.get("verify") else {}
    if role == "decode" and CHECKS.get("corrupt_data"):
        extra["faults"] = {"corrupt_data": CHECKS["corrupt_data"], "seed": rank + len(rooms)}
    return rank_spec(role, rank, tp, rooms, backend, **(MODE["fields"] | extra | kw))


def declared_lost(log: str) -> list[str]:
    """The log lines of a rank declaring a peer lost on its own (peers.py's warning), not those
    of a peer that said goodbye (it closed, or it was told it had been declared lost)."""
    msgs = [ln.split(" WARNING ", 1)[1] for ln in log.splitlines() if " WARNING " in ln]
    return [m for m in msgs if m.startswith("peer ") and " lost: " in m and "it said goodbye" not in m]


def epoch(rng: random.Random, backend: str, first: int, fault: str, tally: dict) -> None:
    """One epoch; a room failed in an epoch without a fault and not aborted on purpose is one that
    no fault touched (tally["failed_untouched"]); an aborted one must fail as aborted."""
    n1, n2 = rng.randint(6, 14), rng.randint(6, 14)
    first_half, second_half = make_rooms(rng, first, n1, slow=True), make_rooms(rng, first + n1, n2, slow=False)
    started = tempfile.mktemp(prefix="kvstage-soak-")
    both = first_half + second_half
    pages_of = {r["room"]: r["pages"] for r in both}
    aborted = {r["room"] for r in both if "abort_after_chunks" in r or "abort_after_s" in r}
    with Cluster() as cl:
        # a rank that will be killed runs only the first half; its restarted self runs the second
        p0_rooms = first_half if fault == "kill_prefill" else both
        d_rooms = first_half if fault == "kill_decode" else both
        p0 = cl.launch([spec("prefill", 0, 2, p0_rooms, backend)], "p0")
        cl.launch([spec("prefill", 1, 2, both, backend)], "p1")
        decode = cl.launch([spec("decode", 0, 1, d_rooms, backend, started_file=started)], "d0")
        victim = p0 if fault == "kill_prefill" else decode if fault == "kill_decode" else None
        deadline = time.monotonic() + 120
        while not os.path.exists(started) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(rng.uniform(0.2, 1.0))
        if fault in ("kill_prefill", "kill_decode"):
            victim.kill()
            role, rank, tp = ("prefill", 0, 2) if fault == "kill_prefill" else ("decode", 0, 1)
            cl.launch([spec(role, rank, tp, second_half, backend)], f"{role}-restarted")
        elif fault == "freeze_decode":
            decode.proc.send_signal(signal.SIGSTOP)
            time.sleep(MODE["lease"] * 2)
            decode.proc.send_signal(signal.SIGCONT)
        elif fault == "restart_bootstrap":
            cl.restart_server(down_s=1.0)
        procs = cl.wait(MODE["fields"]["run_timeout_s"] + 120)
        for p in procs:
            for line in declared_lost(p.log(tail=10**7)):
                tally["peers_lost"] += 1
                tally["loss_reasons"][line.split(" lost: ", 1)[1].split(" (", 1)[0]] += 1
                if fault == "none":
                    tally["lost_untouched"] += 1
                    tally["problems"].append(f"epoch {first} {fault}: {os.path.basename(p.log_path)}: {line}")
            if p.proc.returncode not in (0, -9):
                tally["hangs"] += 1
                tally["problems"].append(f"epoch {first} {fault}: {p.log_path} exited {p.proc.returncode}")
            for res in p.result():
                stats = res.get("stats", {})
                if res["role"] == "decode":
                    tally["corrupted_rooms"] += stats.get("corrupted_rooms", 0)
                for key in LATENESS:
                    if key in stats:
                        tally[key] = max(tally.get(key, 0.0), stats[key])
                if res.get("error"):
                    tally["problems"].append(f"epoch {first} {fault}: {res['name']}: {res['error']}")
                for r in res.get("rooms", []):
                    if r.get("kind") == "driver_timeout":
                        tally["hangs"] += 1
                        tally["problems"].append(f"epoch {first} {fault}: {res['name']} room {r['room']} hung: "
                                                 f"{r['state']} {r.get('age_s', 0):.0f} s after it started "
                                                 f"({r.get('failure')}), log {os.path.dirname(p.log_path)}")
                    if res["role"] != "decode":
                        continue
                    if r["state"] == "Success":
                        if r["verified"]:
                            tally["rooms_completed"] += 1
                            tally["bytes_verified"] += pages_of[r["room"]] * PAGE_BYTES
                        else:
                            tally["corruptions"] += 1
                            tally["problems"].append(f"epoch {first} {fault}: CORRUPT room {r['room']}: {r.get('error')}")
                    else:
                        tally["rooms_failed"] += 1
                        tally["failed_by_kind"][r.get("kind") or "unknown"] += 1
                        if fault != "none":
                            continue
                        if r["room"] not in aborted:
                            tally["failed_untouched"] += 1
                            tally["problems"].append(f"epoch {first} {fault}: room {r['room']} failed, no fault "
                                                     f"touched it: {r.get('kind')}: {r.get('failure')}")
                        elif r.get("kind") not in ("aborted", "remote_aborted"):
                            tally["untrue_reasons"] += 1
                            tally["problems"].append(f"epoch {first} {fault}: aborted room {r['room']} failed as "
                                                     f"{r.get('kind')}: {r.get('failure')}")
    try:
        os.unlink(started)
    except OSError:
        pass


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10)
    p.add_argument("--backend", default="nixl", choices=["nixl", "mooncake"])
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json")
    p.add_argument("--verify", action="store_true", help="end-to-end digests on every rank (EngineConfig(verify=True))")
    p.add_argument("--corrupt-data", type=float, default=0.0,
                   help="decode rank: probability a landed write gets a byte flipped (needs --verify to be caught)")
    p.add_argument("--starve", action="store_true",
                   help="a GIL-hogging thread in every rank process, 4 x cpu_count() CPU burners, production deadlines")
    p.add_argument("--faults", default=",".join(FAULTS), help=f"the faults to draw from (default: all: {','.join(FAULTS)})")
    p.add_argument("--no-aborts", action="store_true", help="no request is aborted on purpose")
    p.add_argument("--epochs", type=int, default=0, help="stop after this many epochs (0: only --minutes counts)")
    a = p.parse_args(argv)
    faults = a.faults.split(",")
    if not set(faults) <= set(FAULTS):
        p.error(f"--faults: unknown {sorted(set(faults) - set(FAULTS))}")
    if a.starve:
        from kvstage.transfer import Timeouts  # the ranks' own (env KVSTAGE_TIMEOUT_LEASE included)
        MODE.update(fields=STARVED_FIELDS, lease=Timeouts.from_env().lease)
    MODE["aborts"] = not a.no_aborts
    burners = start_burners(4 * (os.cpu_count() or 1)) if a.starve else []
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # the finally below stops the burners
    try:
        return soak(a, faults, burners)
    finally:
        stop_burners(burners)


def soak(a: argparse.Namespace, faults: list[str], burners: list) -> int:
    CHECKS.update(verify=a.verify, corrupt_data=a.corrupt_data)
    rng = random.Random(a.seed)
    tally = {"epochs": 0, "rooms_completed": 0, "rooms_failed": 0, "bytes_verified": 0, "corruptions": 0,
             "hangs": 0, "failed_by_kind": collections.Counter(), "faults": collections.Counter(), "problems": [],
             "corrupted_rooms": 0, "peers_lost": 0, "lost_untouched": 0, "loss_reasons": collections.Counter(), "failed_untouched": 0, "untrue_reasons": 0}
    end = time.monotonic() + a.minutes * 60
    t0 = time.time()
    room = 1
    while time.monotonic() < end and not (a.epochs and tally["epochs"] >= a.epochs):
        fault = rng.choice(faults)
        epoch(rng, a.backend, room, fault, tally)
        tally["epochs"] += 1
        tally["faults"][fault] += 1
        room += 100
        print(f"[{time.time() - t0:6.0f}s] epoch {tally['epochs']:3d} {fault:18s} completed {tally['rooms_completed']:5d} "
              f"failed {tally['rooms_failed']:4d} verified {tally['bytes_verified'] / 2**30:7.2f} GiB "
              f"corruptions {tally['corruptions']} hangs {tally['hangs']}", flush=True)
    print()
    print(f"soak {a.minutes:g} min, {a.backend}{', starved' if a.starve else ''}: {tally['epochs']} epochs, "
          f"faults {dict(tally['faults'])}")
    if a.starve:
        print(f"  starved: a GIL hog in every rank process, {len(burners)} CPU burners on {os.cpu_count()} cores, "
              f"production deadlines (lease {MODE['lease']:g} s)")
    print(f"  peers declared lost {tally['peers_lost']} {dict(tally['loss_reasons'])} "
          f"({tally['lost_untouched']} in epochs without a fault), failed that no fault touched {tally['failed_untouched']}, "
          f"aborted rooms failed for another reason {tally['untrue_reasons']}, "
          f"control loop, max over ranks: tick late {tally.get('ctrl_tick_late_max_s', 0):.3f} s, "
          f"round {tally.get('ctrl_round_max_s', 0):.3f} s, backend step {tally.get('backend_step_max_s', 0):.3f} s, "
          f"since a peer was last heard {tally.get('heard_gap_max_s', 0):.3f} s "
          f"(its silence as judged: {tally.get('silence_max_s', 0):.3f} s)")
    print(f"  rooms completed (bit-exact) {tally['rooms_completed']}, rooms failed {tally['rooms_failed']} "
          f"{dict(tally['failed_by_kind'])}")
    print(f"  bytes verified {tally['bytes_verified']:,} ({tally['bytes_verified'] / 2**30:.2f} GiB), "
          f"corruptions found {tally['corruptions']}, hangs {tally['hangs']}")
    if a.verify:
        caught = tally["failed_by_kind"].get("corrupt", 0)
        print(f"  verify on, corrupt_data {a.corrupt_data:g}: requests with a flipped byte {tally['corrupted_rooms']}, "
              f"failed as corrupt {caught} (false alarms: {max(0, caught - tally['corrupted_rooms'])}), "
              f"reported Success with wrong bytes {tally['corruptions']}")
    for line in tally["problems"][:20]:
        print("  ! " + line)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({**tally, "failed_by_kind": dict(tally["failed_by_kind"]), "faults": dict(tally["faults"]),
                       "minutes": a.minutes, "backend": a.backend, "seed": a.seed, "verify": a.verify,
                       "loss_reasons": dict(tally["loss_reasons"]),
                       "corrupt_data": a.corrupt_data, "starve": a.starve, "burners": len(burners),
                       "cpu_count": os.cpu_count(), "lease": MODE["lease"], "faults_drawn_from": faults,
                       "aborts": MODE["aborts"], "argv": sys.argv[1:]}, f, indent=1)
    ok = tally["corruptions"] == 0 and tally["hangs"] == 0 and tally["failed_untouched"] == 0 \
        and tally["untrue_reasons"] == 0 and tally["lost_untouched"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
