"""Which rendezvous a rank uses, chosen by its address: ``host:port`` is a bootstrap server
(bootstrap/client.py, the default), ``etcd://host:port[,host:port...][/namespace]`` an etcd
cluster (bootstrap/etcd_client.py). Both behave as `Rendezvous` says, so the engine holds one
without knowing which (docs/bootstrap.md, "Choosing a rendezvous").

The etcd client is imported only when an etcd address is used: a bootstrap-server deployment
needs neither etcd3gw nor requests.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Protocol

from .address import split_host_port
from .client import BootstrapClient, RankInfo, RankRecord
from .etcd_config import is_etcd, parse_etcd_url
from .etcd_records import RankGone

BOOTSTRAP_ENV = "KVSTAGE_BOOTSTRAP"

__all__ = ["Rendezvous", "RankGone", "BOOTSTRAP_ENV", "check_address", "rendezvous_key", "open_rendezvous",
           "is_etcd"]


class Rendezvous(Protocol):
    addr: str

    def register(self, info: RankInfo) -> RankRecord: ...

    def lookup(self, engine_id: str, timeout_s: float = 30.0) -> list[RankRecord]: ...

    def deregister(self, engine_id: str, tp_rank: int, incarnation: int) -> None: ...

    def start_keepalive(self, info: RankInfo, interval_s: float = 1.0) -> None: ...

    def on_gone(self, callback: Callable[[RankGone], None]) -> None:
        """Tell `callback` about looked-up ranks the rendezvous no longer holds (as soon as it
        knows: etcd's watch; the bootstrap server tells nothing, peers' own leases do)."""

    def status(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


def check_address(name: str, addr: object) -> str:
    """`addr` unchanged when it is a rendezvous address, else ValueError naming `name`."""
    if is_etcd(addr):
        parse_etcd_url(addr, name, env={})   # the address alone; the environment is read when connecting
        return addr  # type: ignore[return-value]
    try:
        split_host_port(name, addr)
    except ValueError as exc:
        raise ValueError(f"{exc} (or an etcd://host:port[,host:port...][/namespace] address)") from None
    return addr  # type: ignore[return-value]


def rendezvous_key(addr: str) -> str:
    """One name per rendezvous, however its address is spelled (clients are shared by it)."""
    if is_etcd(addr):
        cfg = parse_etcd_url(addr, env={})
        return f"{cfg.display}?ttl={cfg.ttl_s}"
    host, port = split_host_port("bootstrap", addr)
    return f"tcp://{host}:{port}"


def from_env(value: str | None) -> str:
    """An explicit address, else $KVSTAGE_BOOTSTRAP; ValueError when there is neither."""
    if value is not None:
        return value
    env = os.environ.get(BOOTSTRAP_ENV) or None
    if env is None:
        raise ValueError(f"bootstrap is required: pass bootstrap='host:port' (or an etcd:// address), or set "
                         f"{BOOTSTRAP_ENV}")
    return check_address(BOOTSTRAP_ENV, env)


def open_rendezvous(addr: str, token: bytes | None = None, request_timeout_s: float = 2.0) -> Rendezvous:
    """A client of the rendezvous at `addr`. `token` authenticates frames to a bootstrap server;
    etcd takes its user and password from the environment instead (bootstrap/etcd_config.py)."""
    if is_etcd(addr):
        from .etcd_client import EtcdRendezvous  # etcd3gw only for those who use etcd
        return EtcdRendezvous(addr, request_timeout_s=request_timeout_s)
    return BootstrapClient(addr, token=token, request_timeout_s=request_timeout_s)
