"""Real etcd members on this machine, on free localhost ports in a temporary directory.

Used by the etcd rendezvous tests and the rendezvous benchmark (examples/bench_rendezvous.py):
Debian's etcd-server (`make apt` installs it), one process per member, started together as one
cluster. Each member dies with the process that started it (PR_SET_PDEATHSIG), so a test that is
killed leaves no etcd behind.
"""

from __future__ import annotations

import base64
import ctypes
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from kvstage.support.cluster import free_port, scratch_dir

ETCD = shutil.which("etcd") or "/usr/bin/etcd"
# fast elections on localhost: heartbeat 50 ms, election 500 ms (etcd's shortest lease TTL follows
# from them: about 1 s)
TIMING = ["--heartbeat-interval", "50", "--election-timeout", "500"]


def _die_with_parent() -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG


@dataclass
class Member:
    name: str
    client_port: int
    peer_port: int
    data_dir: str
    log_path: str
    proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class EtcdCluster:
    """`size` members; a context manager (stops them all)."""

    size: int = 3
    args: list[str] = field(default_factory=list)   # more etcd flags for every member
    workdir: str = field(default_factory=lambda: scratch_dir("kvstage-etcd-"))
    members: list[Member] = field(default_factory=list)

    def __post_init__(self):
        if not os.path.exists(ETCD):
            raise RuntimeError("etcd is not installed: run `make apt` (Debian package etcd-server)")
        for i in range(self.size):
            name = f"m{i}"
            self.members.append(Member(name, free_port(), free_port(), os.path.join(self.workdir, name),
                                       os.path.join(self.workdir, f"{name}.log")))

    # ---- life ---------------------------------------------------------------------------------
    def start(self, timeout_s: float = 60.0) -> EtcdCluster:
        for m in self.members:
            self._spawn(m, "new")
        self.wait_healthy(timeout_s)
        return self

    def _spawn(self, m: Member, state: str) -> None:
        initial = ",".join(f"{x.name}=http://127.0.0.1:{x.peer_port}" for x in self.members)
        cmd = [ETCD, "--name", m.name, "--data-dir", m.data_dir,
               "--listen-client-urls", f"http://127.0.0.1:{m.client_port}",
               "--advertise-client-urls", f"http://127.0.0.1:{m.client_port}",
               "--listen-peer-urls", f"http://127.0.0.1:{m.peer_port}",
               "--initial-advertise-peer-urls", f"http://127.0.0.1:{m.peer_port}",
               "--initial-cluster", initial, "--initial-cluster-state", state,
               "--initial-cluster-token", os.path.basename(self.workdir), *TIMING, *self.args]
        log = open(m.log_path, "a")
        m.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  preexec_fn=_die_with_parent)
        log.close()

    def wait_healthy(self, timeout_s: float = 60.0) -> None:
        """Until every running member says it is healthy (it has a leader)."""
        deadline = time.monotonic() + timeout_s
        for m in self.members:
            while m.alive:
                try:
                    with urllib.request.urlopen(f"http://{m.endpoint}/health", timeout=1) as r:
                        if json.loads(r.read()).get("health") == "true":
                            break
                except (OSError, ValueError):
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"etcd member {m.name} not healthy after {timeout_s} s:\n{self.log(m)}")
                time.sleep(0.05)
            if not m.alive:
                raise RuntimeError(f"etcd member {m.name} exited:\n{self.log(m)}")

    def kill(self, i: int) -> Member:
        """SIGKILL member i."""
        m = self.members[i]
        if m.alive:
            m.proc.kill()
            m.proc.wait()
        return m

    def restart(self, i: int) -> None:
        """Start member i again on its ports and data (it rejoins the cluster)."""
        assert not self.members[i].alive
        self._spawn(self.members[i], "existing")

    def stop(self) -> None:
        """SIGKILL every member (a graceful stop hands leadership around for seconds) and remove
        their data."""
        for m in self.members:
            if m.alive:
                m.proc.kill()
        for m in self.members:
            if m.proc is not None:
                m.proc.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- addresses and set-up --------------------------------------------------------------------
    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    def url(self, namespace: str = "kvstage", ttl: int | None = None) -> str:
        return f"etcd://{','.join(self.endpoints)}/{namespace}" + (f"?ttl={ttl}" if ttl else "")

    def log(self, m: Member, tail: int = 3000) -> str:
        try:
            return Path(m.log_path).read_text()[-tail:]
        except OSError:
            return ""

    def gateway(self, path: str, body: dict, token: str | None = None) -> dict:
        """POST to the first live member's v3 gateway (the tests' etcdctl)."""
        m = next(x for x in self.members if x.alive)
        req = urllib.request.Request(f"http://{m.endpoint}/v3/{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **({"Authorization": token}
                                                                                     if token else {})})
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"etcd {path}: HTTP {exc.code} {exc.read()[:300]!r}") from None

    def enable_auth(self, user: str, password: str) -> None:
        """A root user with this password, and auth on: from now on every request needs a user."""
        self.gateway("auth/user/add", {"name": user, "password": password})
        self.gateway("auth/role/add", {"name": "root"})
        self.gateway("auth/user/grant", {"user": user, "role": "root"})
        self.gateway("auth/enable", {})

    def keys(self, prefix: str, token: str | None = None) -> list[str]:
        """The keys under `prefix` now."""
        end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
        rep = self.gateway("kv/range", {"key": base64.b64encode(prefix.encode()).decode(),
                                        "range_end": base64.b64encode(end.encode()).decode(), "keys_only": True},
                           token)
        return [base64.b64decode(kv["key"]).decode() for kv in rep.get("kvs", [])]
