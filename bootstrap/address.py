"""Host and "host:port" syntax, checked before anything is created.

A bad address must fail the caller with a ValueError naming the option, not later as a raw
zmq "Invalid argument" from a socket, a bind or a connect (docs/configuration.md). Accepted
hosts: an IPv4 literal, an IPv6 literal (bracketed inside "host:port": "[::1]:8998"), or a
DNS name (RFC 1123 labels). Whether a name resolves is not checked here: that is the network's
answer, given as a bootstrap failure with its reason.
"""

from __future__ import annotations

import ipaddress
import re

__all__ = ["host_error", "split_host_port", "check_host"]

_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)\Z")


def host_error(host: object) -> str | None:
    """Why `host` is not a usable host name or address literal, or None when it is."""
    if not isinstance(host, str) or not host:
        return "it is empty" if host == "" else f"it is a {type(host).__name__}, not a string"
    bracketed = host.startswith("[") and host.endswith("]")
    try:
        ipaddress.ip_address(host[1:-1] if bracketed else host)
        return None
    except ValueError:
        pass
    if bracketed or ":" in host:
        return "it is not a valid IPv6 address"
    if len(host) > 253:
        return "a host name has at most 253 characters"
    if all(part.isdigit() for part in host.split(".")):
        return "it is not a valid IPv4 address"
    bad = next((label for label in host.rstrip(".").split(".") if not _LABEL.match(label)), None)
    if bad is not None:
        return (f"the label {bad!r} is not a host name label (letters, digits and '-', 1 to 63 characters, "
                f"not starting or ending with '-')")
    return None


def check_host(name: str, host: object) -> str:
    """`host` unchanged, or ValueError naming the option and what is wrong."""
    why = host_error(host)
    if why is not None:
        raise ValueError(f"{name}={host!r} is not a host name or IP address: {why}")
    return host  # type: ignore[return-value]


def split_host_port(name: str, addr: object) -> tuple[str, int]:
    """("host", port) of "host:port" or "[v6]:port" (an optional "tcp://" prefix is dropped),
    port 1..65535; ValueError naming the option otherwise. The host keeps its brackets, so it
    goes into a zmq endpoint as it is."""
    if isinstance(addr, str):
        text = addr[len("tcp://"):] if addr.startswith("tcp://") else addr
        host, sep, num = text.rpartition(":")
        if sep and host and num.isdigit() and 0 < int(num) < 65536:
            if ":" in host and not host.startswith("["):
                raise ValueError(f"{name}={addr!r}: an IPv6 address goes in brackets, e.g. '[{host}]:{num}'")
            why = host_error(host)
            if why is not None:
                raise ValueError(f"{name}={addr!r}: the host {host!r} is not a host name or IP address: {why}")
            return host, int(num)
    raise ValueError(f"{name} must be a 'host:port' string with port 1..65535, got {addr!r}")
