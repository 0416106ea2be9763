"""Backend write bandwidth, side by side in one run: one large range vs the same bytes as many
small ranges, for NIXL (UCX default transports), NIXL with UCX_TLS=tcp and Mooncake tcp.

    .venv/bin/python examples/bench_backend.py                  # all configurations
    .venv/bin/python examples/bench_backend.py --json out.json  # also write the results
    .venv/bin/python examples/bench_backend.py --faults         # also: frozen and killed peers

Each configuration runs a writer and a target in two fresh processes of this script (the
environment of both gets the configuration's variables, e.g. UCX_TLS=tcp). One write moves
`--mib` MiB from the writer's registered buffer into the target's: as ONE range, as 64 KiB
ranges and as 4 KiB ranges. Small ranges are the same bytes cut in pieces; the destination
pieces are in a shuffled order so that no backend can merge neighbours back into one range.
Patterns run interleaved for `--rounds` rounds after one warm-up write each; the table shows
the median (and best) of:
  write    post_write() until poll_write() says DONE on the writer (post cost included)
  tag      post_write() on the writer until drain_tags() returns the tag on the target (the
           same CLOCK_MONOTONIC on one host; includes the target's polling interval, ~0.1 ms)
  GB/s     bytes / write time;  us/range: write time / ranges;  x-one: time / one-range time
Both sides poll with 20 us sleeps, like the engine's backend thread when busy.

--faults adds, per backend: a write to a SIGSTOPped target (how long it stays PENDING, what
release_write does), and a SIGKILLed target under a stream of writes (kill -> first FAILED).
"""

from __future__ import annotations

import argparse
import base64
import datetime
import json
import os
import platform
import queue
import select
import signal
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 1 << 20
POLL_SLEEP = 20e-6

CONFIGS = {
    "nixl": ("nixl", {}, "NIXL, UCX default transports (cma for data on one host)"),
    "nixl-tcp": ("nixl", {"UCX_TLS": "tcp"}, "NIXL, UCX_TLS=tcp"),
    "mooncake": ("mooncake", {}, "Mooncake TransferEngine, tcp"),
}
PATTERNS = [("1 x whole", 0), ("64 KiB", 64 << 10), ("4 KiB", 4 << 10)]


# =============================================================================== child process
def _child() -> int:
    sys.path.insert(0, ROOT)
    from kvstage.transfer.backends import MemRegion, WriteState, create_backend

    backend = None
    buf = None
    tags: list[tuple[str, float]] = []
    out = sys.stdout

    def reply(**kw) -> None:
        out.write("@@ " + json.dumps(kw) + "\n")
        out.flush()

    idle_since = time.monotonic()
    while True:
        sleep = POLL_SLEEP if time.monotonic() - idle_since < 0.05 else 1e-3
        ready, _, _ = select.select([sys.stdin], [], [], 0 if backend is not None else None)
        if not ready:
            if backend is not None:
                got = backend.drain_tags()
                if got:
                    now = time.monotonic()
                    tags.extend((base64.b64encode(t.tag).decode(), now) for t in got)
                    idle_since = now
            time.sleep(sleep)
            continue
        line = sys.stdin.readline()
        if not line:
            break
        cmd = json.loads(line)
        op = cmd["op"]
        idle_since = time.monotonic()
        if op == "init":
            backend = create_backend(cmd["kind"], f"bench-{cmd['role']}", "127.0.0.1", **cmd.get("options", {}))
            size = cmd["size"]
            pattern = np.arange(1 << 20, dtype=np.uint64).astype(np.uint8)
            if cmd.get("device", "cpu") == "cuda":   # VRAM of GPU 0, the same pattern
                import torch
                buf = torch.from_numpy(np.resize(pattern, size)).to("cuda:0")
                torch.cuda.synchronize()
                base_addr, region = int(buf.data_ptr()), MemRegion(addr=int(buf.data_ptr()), length=size, kind="VRAM")
            else:
                buf = np.empty(size, dtype=np.uint8)
                for lo in range(0, size, 1 << 20):  # pre-faulted, with a non-trivial pattern
                    buf[lo:lo + (1 << 20)] = pattern[:min(1 << 20, size - lo)]
                base_addr, region = int(buf.ctypes.data), MemRegion(addr=buf.ctypes.data, length=size)
            backend.register([region])
            reply(name=backend.name, identity=base64.b64encode(backend.identity()).decode(), addr=base_addr)
        elif op == "connect":
            reply(peer=backend.connect(base64.b64decode(cmd["identity"])))
        elif op == "tags":
            reply(tags=tags)
            tags = []
        elif op == "write":
            # One timed write per entry of `plan`; the descriptor arrays are built before timing.
            base = int(buf.data_ptr()) if hasattr(buf, "data_ptr") else int(buf.ctypes.data)
            results = []
            for item in cmd["plan"]:
                piece, total = item["piece"], item["bytes"]
                if piece == 0:
                    src = np.array([[base, total, 0]], dtype=np.uint64)
                    dst = np.array([[cmd["peer_addr"], total, 0]], dtype=np.uint64)
                else:
                    n = total // piece
                    offs = np.arange(n, dtype=np.uint64) * np.uint64(piece)
                    perm = np.random.default_rng(n).permutation(n).astype(np.uint64)
                    src = np.stack([base + offs, np.full(n, piece, np.uint64), np.zeros(n, np.uint64)], 1)
                    dst = np.stack(
                        [cmd["peer_addr"] + offs[perm], np.full(n, piece, np.uint64), np.zeros(n, np.uint64)], 1
                    )
                t0 = time.monotonic()
                try:
                    h = backend.post_write(cmd["peer"], src, dst, item["tag"].encode())
                except Exception as exc:  # noqa: BLE001 - reported
                    results.append({"tag": item["tag"], "state": "post_error", "reason": str(exc), "t0": t0,
                                    "t_end": time.monotonic()})
                    continue
                t_posted = time.monotonic()
                deadline = t0 + item.get("timeout", 60.0)
                while backend.poll_write(h) is WriteState.PENDING and time.monotonic() < deadline:
                    time.sleep(POLL_SLEEP)
                t_end = time.monotonic()
                state = h.state.value
                reason = h.reason
                r = {"tag": item["tag"], "state": state, "reason": reason, "t0": t0, "t_posted": t_posted,
                     "t_end": t_end}
                if state == "pending" and item.get("release_pending"):
                    t1 = time.monotonic()
                    backend.release_write(h)
                    r["release_s"] = time.monotonic() - t1
                    r["after_release"] = h.state.value
                    r["release_reason"] = h.reason
                    r["may_touch_memory"] = bool(h.extra.get("may_touch_memory"))
                else:
                    backend.release_write(h)
                results.append(r)
                if state == "failed" and item.get("stop_on_failure"):
                    break
            reply(results=results)
        elif op == "close":
            backend.close()
            reply(closed=True)
            break
    return 0


# =============================================================================== orchestrator
class Proc:
    def __init__(self, role: str, env_extra: dict):
        env = dict(os.environ)
        env.update(env_extra)
        env.setdefault("MC_LOG_LEVEL", "ERROR")
        self.role = role
        self.p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child"], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL if not VERBOSE else None,
                                  text=True, env=env)
        self.q: queue.Queue[dict | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.p.stdout:
            if line.startswith("@@ "):
                self.q.put(json.loads(line[3:]))
        self.q.put(None)

    def call(self, wait: float = 120.0, **cmd) -> dict:
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()
        msg = self.q.get(timeout=wait)
        if msg is None:
            raise RuntimeError(f"{self.role} exited with {self.p.wait()}")
        return msg

    def close(self) -> int:
        if self.p.poll() is None:
            try:
                self.call(op="close", wait=60)
            except Exception:  # noqa: BLE001
                pass
        try:
            return self.p.wait(60)
        finally:
            self.kill()

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()


VERBOSE = False
DEVICE = "cpu"   # where both sides' buffers are: host memory, or VRAM of GPU 0 (--device cuda)


def start_pair(kind: str, env: dict, size: int, options: dict | None = None) -> tuple[Proc, Proc, dict, dict, str]:
    writer, target = Proc("writer", env), Proc("target", env)
    wi = writer.call(op="init", kind=kind, role="writer", size=size, options=options or {}, device=DEVICE)
    ti = target.call(op="init", kind=kind, role="target", size=size, options=options or {}, device=DEVICE)
    peer = writer.call(op="connect", identity=ti["identity"])["peer"]
    return writer, target, wi, ti, peer


def bench_config(key: str, nbytes: int, rounds: int, patterns: list | None = None) -> dict:
    """Median write time of `nbytes` moved in each of `patterns` (default: all of PATTERNS)."""
    PATTERNS = patterns or globals()["PATTERNS"]  # noqa: N806 - shadows the module default
    kind, env, label = CONFIGS[key]
    writer, target, wi, ti, peer = start_pair(kind, env, nbytes)
    try:
        samples: dict[str, list[dict]] = {p: [] for p, _ in PATTERNS}
        for r in range(rounds + 1):  # round 0 is the warm-up
            plan = [{"piece": piece, "bytes": nbytes, "tag": f"{key}/{name}/{r}"} for name, piece in PATTERNS]
            res = writer.call(op="write", peer=peer, peer_addr=ti["addr"], plan=plan)["results"]
            time.sleep(0.05)
            arrived = dict(target.call(op="tags")["tags"])
            for (name, piece), x in zip(PATTERNS, res):
                if x["state"] != "done":
                    raise RuntimeError(f"{key} {name}: {x}")
                t_tag = arrived.get(base64.b64encode(x["tag"].encode()).decode())
                if r == 0:
                    continue
                samples[name].append({
                    "write_s": x["t_end"] - x["t0"],
                    "post_s": x["t_posted"] - x["t0"],
                    "tag_s": (t_tag - x["t0"]) if t_tag is not None else None,
                })
        out = {"config": key, "label": label, "env": env, "bytes": nbytes, "rounds": rounds, "patterns": []}
        for name, piece in PATTERNS:
            s = samples[name]
            w = [x["write_s"] for x in s]
            tags = [x["tag_s"] for x in s if x["tag_s"] is not None]
            ranges = 1 if piece == 0 else nbytes // piece
            med = statistics.median(w)
            out["patterns"].append({
                "pattern": name, "piece": piece or nbytes, "ranges": ranges,
                "write_s_median": med, "write_s_best": min(w),
                "post_s_median": statistics.median(x["post_s"] for x in s),
                "tag_s_median": statistics.median(tags) if tags else None,
                "gbps_median": nbytes / med / 1e9, "gbps_best": nbytes / min(w) / 1e9,
                "us_per_range": med / ranges * 1e6,
                "tags_seen": len(tags), "samples": s,
            })
        one = out["patterns"][0]["write_s_median"]
        for p in out["patterns"]:
            p["x_one"] = p["write_s_median"] / one
        wrc, trc = writer.close(), target.close()
        out["exit_codes"] = [wrc, trc]
        return out
    finally:
        writer.kill()
        target.kill()


def fault_frozen(key: str, options: dict, wait_s: float) -> dict:
    """SIGSTOP the target, then post a write: how long PENDING, and what release_write does."""
    kind, env, label = CONFIGS[key]
    writer, target, wi, ti, peer = start_pair(kind, env, 16 * MIB, options)
    try:
        writer.call(op="write", peer=peer, peer_addr=ti["addr"], plan=[{"piece": 0, "bytes": 16 * MIB, "tag": "warm"}])
        target.p.send_signal(signal.SIGSTOP)
        plan = [{"piece": 0, "bytes": 16 * MIB, "tag": "frozen", "timeout": wait_s, "release_pending": True}]
        res = writer.call(op="write", peer=peer, peer_addr=ti["addr"], plan=plan, wait=wait_s + 120)["results"][0]
        res["pending_or_failed_after_s"] = res["t_end"] - res["t0"]
        t0 = time.monotonic()
        wrc = writer.close()  # the target is still frozen: how long does close() take?
        close_s = time.monotonic() - t0
        target.p.send_signal(signal.SIGCONT)
        target.kill()
        return {"config": key, "options": options, "label": label, "wait_s": wait_s, "result": res,
                "writer_close_s": close_s, "writer_exit": wrc}
    finally:
        target.p.send_signal(signal.SIGCONT) if target.p.poll() is None else None
        writer.kill()
        target.kill()


def fault_killed(key: str) -> dict:
    """A stream of 1 MiB writes; SIGKILL the target in the middle: kill -> first FAILED."""
    kind, env, label = CONFIGS[key]
    writer, target, wi, ti, peer = start_pair(kind, env, 16 * MIB)
    try:
        plan = [{"piece": 0, "bytes": MIB, "tag": f"s{i}", "timeout": 10, "stop_on_failure": True}
                for i in range(20000)]
        box: dict = {}
        th = threading.Thread(target=lambda: box.update(writer.call(op="write", peer=peer, peer_addr=ti["addr"],
                                                                    plan=plan, wait=120)))
        th.start()
        time.sleep(1.0)
        t_kill = time.monotonic()
        target.p.send_signal(signal.SIGKILL)
        target.p.wait()
        th.join(60)
        res = box.get("results", [])
        failed = [r for r in res if r["state"] != "done"]
        first = failed[0] if failed else None
        wrc = writer.close()
        return {"config": key, "label": label, "writes_before": len(res) - len(failed),
                "first_failure": first,
                "kill_to_failed_s": (first["t_end"] - t_kill) if first else None,
                "writer_exit": wrc}
    finally:
        writer.kill()
        target.kill()


def print_table(results: list[dict]) -> None:
    print()
    print(f"{'config':<10} {'pattern':<10} {'ranges':>7} {'write ms':>9} {'best ms':>8} {'post ms':>8} "
          f"{'tag ms':>8} {'GB/s':>6} {'us/range':>9} {'x-one':>6}")
    for res in results:
        for p in res["patterns"]:
            tag = f"{p['tag_s_median'] * 1e3:8.2f}" if p["tag_s_median"] is not None else f"{'-':>8}"
            print(f"{res['config']:<10} {p['pattern']:<10} {p['ranges']:>7} {p['write_s_median'] * 1e3:9.2f} "
                  f"{p['write_s_best'] * 1e3:8.2f} {p['post_s_median'] * 1e3:8.2f} {tag} {p['gbps_median']:6.2f} "
                  f"{p['us_per_range']:9.2f} {p['x_one']:6.1f}")
    print()
    for name, _ in PATTERNS:
        row = {r["config"]: next(p for p in r["patterns"] if p["pattern"] == name) for r in results}
        if "nixl" in row:
            ratios = ", ".join(f"{k}/nixl = {v['write_s_median'] / row['nixl']['write_s_median']:.1f}x"
                               for k, v in row.items() if k != "nixl")
            print(f"time ratios, {name}: {ratios}")


def _pieces(text: str) -> list[tuple[str, int]]:
    """"0,16M,4M,64K" -> [("1 x whole", 0), ("16 MiB", 16 << 20), ...]."""
    units = {"K": (10, "KiB"), "M": (20, "MiB")}
    out = []
    for word in (w.strip().upper() for w in text.split(",") if w.strip()):
        if word == "0":
            out.append(("1 x whole", 0))
        elif word[-1] in units and word[:-1].isdigit() and int(word[:-1]) > 0:
            shift, name = units[word[-1]]
            out.append((f"{int(word[:-1])} {name}", int(word[:-1]) << shift))
        else:
            raise argparse.ArgumentTypeError(f"{word!r}: a range size is 0 or a number with K or M")
    if not out or out[0][1] != 0:
        raise argparse.ArgumentTypeError("the first size must be 0 (one range: the ratios' base)")
    return out


def main() -> int:
    global VERBOSE, DEVICE
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mib", type=int, default=64, help="bytes per write, MiB (default 64)")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds per pattern (default 5)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {list(CONFIGS)}")
    ap.add_argument("--faults", action="store_true", help="also measure frozen (SIGSTOP) and killed peers")
    ap.add_argument("--json", metavar="PATH", help="write all results as JSON")
    ap.add_argument("--verbose", action="store_true", help="show the children's stderr (library logs)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="both buffers in host memory or in VRAM of GPU 0 (NIXL: UCX cuda_ipc on one GPU)")
    ap.add_argument("--pieces", type=_pieces, default=None,
                    help="range sizes to compare, e.g. 0,16M,4M,1M (0: one range; default 0,64K,4K)")
    args = ap.parse_args()
    if args.child:
        return _child()
    VERBOSE, DEVICE = args.verbose, args.device
    if args.pieces is not None:
        PATTERNS[:] = args.pieces
    keys = [k for k in args.configs.split(",") if k]
    for k in keys:
        if k not in CONFIGS:
            ap.error(f"unknown config {k!r}")
    meta = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "loadavg_start": os.getloadavg(),
        "command": " ".join(
            [os.path.relpath(sys.executable, ROOT) if sys.executable.startswith(ROOT) else sys.executable]
            + [os.path.relpath(os.path.abspath(sys.argv[0]), ROOT)]
            + sys.argv[1:]
        ),
    }
    meta["device"] = DEVICE
    print(
        f"# {meta['date']}  {meta['cpus']} CPUs  {args.mib} MiB per write  {args.rounds} rounds  loopback, {DEVICE}"
        f"  load average {meta['loadavg_start'][0]:.2f} (the machine must be otherwise idle)"
    )
    results = []
    for k in keys:
        t0 = time.monotonic()
        results.append(bench_config(k, args.mib * MIB, args.rounds))
        print(f"  {k}: {CONFIGS[k][2]} ({time.monotonic() - t0:.1f} s)", flush=True)
    print_table(results)
    faults = []
    if args.faults:
        print("\nfaults:")
        for k in keys:
            kind = CONFIGS[k][0]
            # Mooncake: until Mooncake gives up (default, and stall_timeout_s=2), then released
            # after 1 s while still inside Mooncake (close() then waits for Mooncake to return).
            runs = [({}, 3.0)] if kind == "nixl" else [({}, 60.0), ({"stall_timeout_s": 2}, 60.0), ({}, 1.0)]
            for options, wait in runs:
                f = fault_frozen(k, options, wait)
                r = f["result"]
                faults.append({"kind": "frozen", **f})
                extra = ""
                if "release_s" in r:
                    extra = (
                        f"; release_write took {r['release_s'] * 1e3:.2f} ms -> {r['after_release']}"
                        f" (may_touch_memory={r['may_touch_memory']})"
                    )
                print(
                    f"  {k} {options or ''} SIGSTOP target: after {r['pending_or_failed_after_s']:.2f} s the write"
                    f" is {r['state'].upper()}{extra}; writer close()+exit (target still frozen) {f['writer_close_s']:.2f} s,"
                    f" exit {f['writer_exit']}",
                    flush=True,
                )
            f = fault_killed(k)
            faults.append({"kind": "killed", **f})
            kf = f["kill_to_failed_s"]
            print(
                f"  {k} SIGKILL target under a stream of 1 MiB writes: first FAILED {kf * 1e3:.1f} ms after the kill"
                if kf is not None
                else f"  {k}: no failure seen",
                f"({f['writes_before']} writes done before); reason: "
                f"{(f['first_failure'] or {}).get('reason')}; writer exit {f['writer_exit']}",
                flush=True,
            )
    meta["loadavg_end"] = os.getloadavg()
    print(f"# load average at the end: {meta['loadavg_end'][0]:.2f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"meta": meta, "results": results, "faults": faults}, fh, indent=1)
        print(f"\nwrote {args.json}")
    bad = [r["config"] for r in results if r["exit_codes"] != [0, 0]]
    if bad:
        print(f"non-zero child exit codes: {bad}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
