"""Two "hosts" on one machine: network namespaces joined by a veth pair (needs root)."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass


@dataclass(kw_only=True)
class TwoHosts:
    a: str
    b: str
    dev_a: str
    dev_b: str
    ip_a: str = "10.77.0.1"
    ip_b: str = "10.77.0.2"

    def link(self, up: bool) -> None:
        subprocess.run(["ip", "-n", self.a, "link", "set", self.dev_a, "up" if up else "down"], check=True)


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def make_hosts(tag: str) -> TwoHosts:
    a, b = f"kvs{tag}a", f"kvs{tag}b"
    h = TwoHosts(a=a, b=b, dev_a=f"kvs{tag}va", dev_b=f"kvs{tag}vb")
    delete_hosts(h)
    ip("netns", "add", a)
    ip("netns", "add", b)
    ip("link", "add", h.dev_a, "type", "veth", "peer", "name", h.dev_b)
    ip("link", "set", h.dev_a, "netns", a)
    ip("link", "set", h.dev_b, "netns", b)
    ip("-n", a, "addr", "add", f"{h.ip_a}/24", "dev", h.dev_a)
    ip("-n", b, "addr", "add", f"{h.ip_b}/24", "dev", h.dev_b)
    for ns, dev in ((a, h.dev_a), (b, h.dev_b)):
        ip("-n", ns, "link", "set", dev, "up")
        ip("-n", ns, "link", "set", "lo", "up")
    return h


def delete_hosts(h: TwoHosts) -> None:
    for ns in (h.a, h.b):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def can_make_namespaces() -> str | None:
    """None when this machine can run the multi-host tests, else why not."""
    if os.geteuid() != 0:
        return "needs root for ip netns"
    try:
        h = make_hosts(f"t{os.getpid() % 10000}")
    except (OSError, subprocess.CalledProcessError) as exc:
        return f"ip netns unavailable: {exc}"
    delete_hosts(h)
    return None
