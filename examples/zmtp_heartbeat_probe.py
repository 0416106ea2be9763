"""What libzmq's own heartbeats (ZMTP PING/PONG, ZMQ_HEARTBEAT_IVL/_TIMEOUT) see of a peer process
that is GIL-starved, frozen (SIGSTOP) or killed: the evidence behind docs/operations.md's "Leases
under starvation". Not part of kvstage; a measurement.

    python examples/zmtp_heartbeat_probe.py [--ivl 0.25] [--timeout 1.0]

A peer process binds a ROUTER (as a kvstage rank does) and then runs only a pure-Python loop that
always holds the GIL and never reads its socket. This process connects a DEALER with ZMTP
heartbeats on and watches its socket monitor: while the peer's Python is starved, its libzmq I/O
thread (native, no GIL) still answers the PINGs and the connection stays up; once the peer is
SIGSTOPped, the PINGs go unanswered and libzmq drops the connection after the timeout; a killed
peer's kernel closes the TCP connection at once.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

PEER = r"""
import sys, threading, zmq
ctx = zmq.Context()
r = ctx.socket(zmq.ROUTER)
r.setsockopt(zmq.LINGER, 0)
port = r.bind_to_random_port("tcp://127.0.0.1")
print(port, flush=True)
def hog():
    n = 0
    while True:
        n += 1
threading.Thread(target=hog, daemon=True).start()
n = 0
while True:       # the main thread wants the GIL too, and never reads the socket
    n += 1
"""

NAMES = {getattr(zmq, n): n for n in dir(zmq) if n.startswith("EVENT_") and isinstance(getattr(zmq, n), int)}


def watch(mon: zmq.Socket, seconds: float, t0: float, log: list) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if mon.poll(50):
            ev = recv_monitor_message(mon)
            log.append((time.monotonic() - t0, NAMES.get(ev["event"], ev["event"])))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ivl", type=float, default=0.25, help="ZMQ_HEARTBEAT_IVL, seconds")
    p.add_argument("--timeout", type=float, default=1.0, help="ZMQ_HEARTBEAT_TIMEOUT, seconds")
    p.add_argument("--starved-s", type=float, default=5.0)
    p.add_argument("--frozen-s", type=float, default=4.0)
    a = p.parse_args()
    peer = subprocess.Popen([sys.executable, "-c", PEER], stdout=subprocess.PIPE, text=True)
    try:
        port = int(peer.stdout.readline())
        ctx = zmq.Context()
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.setsockopt(zmq.HEARTBEAT_IVL, int(a.ivl * 1000))
        d.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(a.timeout * 1000))
        d.setsockopt(zmq.HEARTBEAT_TTL, int(a.timeout * 1000))
        mon = d.get_monitor_socket()
        t0 = time.monotonic()
        log: list = []
        d.connect(f"tcp://127.0.0.1:{port}")
        watch(mon, a.starved_s, t0, log)
        print(f"zmq {zmq.zmq_version()}, heartbeat ivl {a.ivl:g} s, timeout {a.timeout:g} s")
        print(f"peer GIL-starved (a hog thread and a busy main thread, socket never read) for {a.starved_s:g} s:")
        for t, e in log:
            print(f"  {t:7.3f} s {e}")
        log.clear()
        stopped = time.monotonic()
        os.kill(peer.pid, signal.SIGSTOP)
        watch(mon, a.frozen_s, stopped, log)
        print(f"peer SIGSTOPped at 0 s, for {a.frozen_s:g} s:")
        for t, e in log:
            print(f"  {t:7.3f} s {e}")
        log.clear()
        os.kill(peer.pid, signal.SIGCONT)
        watch(mon, 2.0, time.monotonic(), log)
        print("peer SIGCONTed at 0 s, for 2 s:")
        for t, e in log:
            print(f"  {t:7.3f} s {e}")
        log.clear()
        killed = time.monotonic()
        peer.kill()
        watch(mon, 2.0, killed, log)
        print("peer SIGKILLed at 0 s, for 2 s:")
        for t, e in log:
            print(f"  {t:7.3f} s {e}")
        d.disable_monitor()
        mon.close(0)
        d.close(0)
        ctx.term()
    finally:
        if peer.poll() is None:
            os.kill(peer.pid, signal.SIGCONT)
            peer.kill()
        peer.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
