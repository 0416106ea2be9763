"""Start a bootstrap server and rank processes on this machine, and collect their results.

Used by the PD demo, the benchmark and the integration tests, so all of them exercise the same
real processes: `python -m kvstage.bootstrap` and `examples/pd_rank.py`.
"""

from __future__ import annotations

import atexit
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

CRASH_CODES = {-signal.SIGSEGV, -signal.SIGABRT, -signal.SIGBUS, -signal.SIGILL, -signal.SIGFPE}
ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"   # the rank script (pd_rank.py) the clusters start


def scratch_dir(prefix: str) -> str:
    """A fresh directory for one cluster's specs, results and logs, removed when this process
    exits (the tests and benchmarks read what they need while it runs); KVSTAGE_KEEP_WORKDIRS=1
    keeps it, to read the rank logs of a run afterwards."""
    path = tempfile.mkdtemp(prefix=prefix)
    if not os.environ.get("KVSTAGE_KEEP_WORKDIRS"):
        atexit.register(shutil.rmtree, path, True)
    return path


_PORT_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST_PORT = 20000


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on host now, for something that binds it later: below Linux's ephemeral range.

    A port picked by binding port 0 comes from the ephemeral range, and before the later bind
    anything running (a warm-up manager, UCX and Mooncake listeners, zmq, an etcd member's
    connections to its peers) may take that very port for a socket of its own. The kernel hands
    a port below that range to nobody who did not ask for it by number, and such picks are drawn
    at random here."""
    try:
        top = int(_PORT_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        top = 32768   # where Linux's default range starts
    top = max(top, _LOWEST_PORT + 1000)
    rnd = random.Random()
    for _ in range(500):
        port = rnd.randrange(_LOWEST_PORT, top)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port on {host} in {_LOWEST_PORT}-{top}")


def rank_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.setdefault("UCX_MODULES", "^ib")        # FACTS: otherwise UCX crashes at exit
    env.setdefault("GLOG_minloglevel", "2")     # Mooncake logs a lot through glog
    env.setdefault("MC_LOG_LEVEL", "ERROR")
    env.setdefault("OMP_NUM_THREADS", "1")      # many rank processes share 2 cores: no intra-op threads
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(EXAMPLES)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update(extra or {})
    return env


def rank_spec(role: str, rank: int, tp: int, rooms: list, backend: str, *, prefill_engine: str = "pf",
              decode_engine: str = "dc", **fields) -> dict:
    """One pd_rank.py manager spec of a single prefill/decode engine pair: the engine names and,
    for a decode rank, the prefill engine it reads from; `fields` add or override the rest."""
    spec = {"role": role, "rank": rank, "tp": tp, "backend": backend, "rooms": rooms,
            "engine": prefill_engine if role == "prefill" else decode_engine}
    if role == "decode":
        spec["peer_engine"] = prefill_engine
    spec.update(fields)
    return spec


@dataclass
class Server:
    proc: subprocess.Popen
    addr: str

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


def start_bootstrap(host: str = "127.0.0.1", port: int = 0, env: dict | None = None, args: list | None = None,
                    netns: str | None = None) -> Server:
    cmd = [sys.executable, "-m", "kvstage.bootstrap", "--host", host, "--port", str(port)] + (args or [])
    if netns:
        cmd = ["ip", "netns", "exec", netns] + cmd
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=rank_env(env), text=True)
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        raise RuntimeError(f"bootstrap server did not start: {line!r}")
    addr = line.strip().rsplit("tcp://", 1)[1]
    return Server(proc, addr)


@dataclass(kw_only=True)
class RankProc:
    proc: subprocess.Popen
    spec_path: str
    result_path: str
    log_path: str

    def kill(self) -> None:
        """SIGKILL: the process dies with no chance to say goodbye."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def result(self) -> list:
        try:
            return json.load(open(self.result_path))
        except (OSError, ValueError):
            return []

    def log(self, tail: int = 4000) -> str:
        try:
            return Path(self.log_path).read_text()[-tail:]
        except OSError:
            return ""


@dataclass(kw_only=True)
class Cluster:
    """A bootstrap server plus rank processes; use as a context manager (kills everything).
    With `rendezvous` (e.g. an etcd:// address) the ranks use it and no server is started."""

    env: dict | None = None
    server_args: list | None = None
    server_host: str = "127.0.0.1"
    server_netns: str | None = None
    workdir: str = field(default_factory=lambda: scratch_dir("kvstage-"))
    server: Server | None = None
    procs: list = field(default_factory=list)
    rendezvous: str | None = None

    def __enter__(self) -> Cluster:
        if self.rendezvous is not None:
            return self
        self.server = start_bootstrap(host=self.server_host, env=self.env, args=self.server_args,
                                      netns=self.server_netns)
        return self

    def restart_server(self, down_s: float = 0.5) -> None:
        """Kill the bootstrap server (SIGKILL) and start a new one on the same port."""
        self.kill_server()
        time.sleep(down_s)
        self.start_server_again()

    def kill_server(self) -> None:
        """SIGKILL the bootstrap server; start_server_again() brings one back on its port."""
        self.server.kill()

    def start_server_again(self) -> None:
        """Start a new bootstrap server on the port of the one kill_server() killed."""
        assert self.server.proc.poll() is not None, "the bootstrap server is still running"
        host, port = self.server.addr.rsplit(":", 1)
        for _ in range(50):
            try:
                self.server = start_bootstrap(host=host, port=int(port), env=self.env, args=self.server_args)
                return
            except RuntimeError:
                time.sleep(0.1)
        raise RuntimeError("could not restart the bootstrap server on its port")

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            if p.proc.poll() is None:
                p.proc.kill()
                p.proc.wait()
        if self.server is not None:
            self.server.stop()

    @property
    def addr(self) -> str:
        return self.rendezvous if self.rendezvous is not None else self.server.addr

    def launch(self, managers: list[dict], name: str, env: dict | None = None, netns: str | None = None,
               log_level: str = "WARNING", bootstrap: str | None = None) -> RankProc:
        """Start one rank process hosting `managers` (pd_rank.py specs)."""
        n = len(self.procs)
        spec_path = os.path.join(self.workdir, f"{n:03d}-{name}.json")
        result_path = spec_path.replace(".json", ".result.json")
        log_path = spec_path.replace(".json", ".log")
        spec = {"bootstrap": bootstrap or self.addr, "managers": managers, "result": result_path,
                "log_level": log_level}
        Path(spec_path).write_text(json.dumps(spec))
        cmd = [sys.executable, str(EXAMPLES / "pd_rank.py"), spec_path]
        if netns:
            cmd = ["ip", "netns", "exec", netns] + cmd
        log = open(log_path, "w")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=rank_env({**(self.env or {}),
                                                                                         **(env or {})}))
        rp = RankProc(proc=proc, spec_path=spec_path, result_path=result_path, log_path=log_path)
        self.procs.append(rp)
        return rp

    def barrier(self, count: int | None = None, timeout_s: float = 60) -> dict:
        """A spec entry making ranks wait for each other before closing (count: managers)."""
        d = os.path.join(self.workdir, "barrier")
        os.makedirs(d, exist_ok=True)
        return {"dir": d, "count": count, "timeout_s": timeout_s}

    def wait(self, timeout: float) -> list[RankProc]:
        """Wait for every rank process; kill stragglers. Returns the processes.

        A process that crashes (SIGSEGV, SIGABRT, SIGBUS, SIGILL, SIGFPE; not the SIGKILL a test
        deals on purpose) can never reach the barrier: the others are told to stop waiting for it
        (`barrier_abort`), so a crash fails the run in seconds rather than at the deadline.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(p.proc.poll() is None for p in self.procs):
            if any(p.proc.returncode in CRASH_CODES for p in self.procs):
                self.barrier_abort()
            time.sleep(0.1)
        for p in self.procs:
            if p.proc.poll() is None:
                p.proc.kill()
                p.proc.wait()
        return self.procs

    def barrier_abort(self) -> None:
        """Make every rank waiting at the barrier go on (pd_rank.barrier watches this file)."""
        d = os.path.join(self.workdir, "barrier")
        if os.path.isdir(d):
            Path(d, "abort").touch()
