"""What one control message costs its sender before the peer's control thread is even involved:
the time of a `send_multipart` of a kvstage-sized frame pair (payload, MAC) from a DEALER, as the
control socket sends it, on an otherwise idle machine and beside busy processes. The evidence
behind docs/trace.md's "Not in the trace: zmq's I/O threads". Not part of kvstage; a measurement.

    python examples/zmq_send_probe.py [--sends 300] [--busy 2] [--gap-ms 1]

libzmq hands every message to an I/O thread of its own (native, no GIL): a send onto an idle
connection wakes that thread (an eventfd write), and on a machine with no idle core the sender
may then wait for the CPU. The sends are spaced by `--gap-ms` so that each one finds the I/O
thread asleep, as a one-page request's few messages do; the same is then measured with `--busy`
processes spinning in pure Python.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import zmq


def measure(dealer: zmq.Socket[bytes], router: zmq.Socket[bytes], sends: int, gap_s: float) -> list[float]:
    payload, mac = b"x" * 200, b"y" * 32   # about a RoomMeta and its HMAC
    out = []
    for _ in range(sends):
        t0 = time.perf_counter()
        dealer.send_multipart([payload, mac], zmq.NOBLOCK)
        out.append(time.perf_counter() - t0)
        time.sleep(gap_s)
        while True:
            try:
                router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
    return sorted(out)


def report(label: str, ts: list[float]) -> None:
    n = len(ts)
    print(f"{label:32s} send_multipart p50 {statistics.median(ts) * 1e6:8.1f} us  p90 {ts[int(n * 0.9)] * 1e6:8.1f} us"
          f"  p99 {ts[int(n * 0.99)] * 1e6:8.1f} us  max {ts[-1] * 1e6:8.1f} us")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sends", type=int, default=300)
    ap.add_argument("--busy", type=int, default=2, help="processes spinning in pure Python for the second run")
    ap.add_argument("--gap-ms", type=float, default=1.0)
    a = ap.parse_args()
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind("tcp://127.0.0.1:*")
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(router.getsockopt_string(zmq.LAST_ENDPOINT))
    measure(dealer, router, 20, a.gap_ms / 1e3)   # connected and warm
    report("idle machine", measure(dealer, router, a.sends, a.gap_ms / 1e3))
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(a.busy)]
    try:
        time.sleep(0.5)
        report(f"{a.busy} busy processes", measure(dealer, router, a.sends, a.gap_ms / 1e3))
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    dealer.close(0)
    router.close(0)
    ctx.term()


if __name__ == "__main__":
    main()
