"""Where the SGLang adapter's ranks meet: a kvstage bootstrap server per prefill instance (the
default), or one etcd cluster for the whole fleet (``KVSTAGE_BOOTSTRAP=etcd://...`` on every
server). Pure: no SGLang, no sockets (docs/sglang.md, "Rendezvous").

With etcd, each prefill instance takes a namespace of its own under the fleet's (so the engine of
a DP rank is found among that instance's engines only, as at its own server), and publishes that
address where it published its server's port: SGLang's bootstrap server, ``GET
/kvstage/rendezvous``. Decode ranks register in the fleet's namespace itself.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping

from kvstage.bootstrap.etcd_config import is_etcd, with_namespace
from kvstage.bootstrap.rendezvous import BOOTSTRAP_ENV, check_address


def shared_rendezvous(env: Mapping[str, str] | None = None) -> str | None:
    """The fleet's etcd address from KVSTAGE_BOOTSTRAP, None when it is unset. Any other value is
    a ValueError: a bootstrap server is per prefill instance here, started by the adapter."""
    env = os.environ if env is None else env
    addr = env.get(BOOTSTRAP_ENV) or None
    if addr is None:
        return None
    if not is_etcd(addr):
        raise ValueError(f"{BOOTSTRAP_ENV}={addr!r}: with SGLang it names an etcd cluster (etcd://host:port[,...]"
                         "[/namespace]); leave it unset for a kvstage bootstrap server per prefill instance")
    return check_address(BOOTSTRAP_ENV, addr)


def instance_address(fleet: str) -> str:
    """A new prefill instance's own namespace under the fleet's etcd address."""
    return with_namespace(fleet, f"prefill-{secrets.token_hex(6)}")


def route_answer(port: int | None, address: str | None) -> dict:
    """What ``GET /kvstage/rendezvous`` says: its server's port, or its etcd address."""
    return {"address": address} if address is not None else {"port": port}


def address_from_route(bootstrap_addr: str, answer: dict) -> str:
    """The rendezvous address of the prefill instance whose SGLang bootstrap server is
    `bootstrap_addr`, from its route's answer (KeyError/ValueError when it is not one)."""
    if "address" in answer:
        return check_address("rendezvous", str(answer["address"]))
    host = bootstrap_addr.rsplit(":", 1)[0].strip("[]")
    port = int(answer["port"])
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
