"""``etcd://host1:2379,host2:2379/namespace?ttl=10``: where the etcd rendezvous is, checked before
anything is created.

Secrets never go in the address (it is logged and shown by ``status``): the etcd user and password
and the TLS files come from the environment (docs/bootstrap.md, "etcd"). A bad value is a
ValueError naming the option or variable and what is wrong.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qsl

from .address import split_host_port

SCHEME = "etcd://"
DEFAULT_PORT = 2379
DEFAULT_NAMESPACE = "kvstage"
DEFAULT_TTL_S = 10
MAX_TTL_S = 3600

USER_ENV = "KVSTAGE_ETCD_USER"
PASSWORD_ENV = "KVSTAGE_ETCD_PASSWORD"
PASSWORD_FILE_ENV = "KVSTAGE_ETCD_PASSWORD_FILE"
CA_ENV = "KVSTAGE_ETCD_CA_CERT"        # a CA bundle: the endpoints are https, verified with it
CERT_ENV = "KVSTAGE_ETCD_CERT"         # a client certificate (with KVSTAGE_ETCD_KEY)
KEY_ENV = "KVSTAGE_ETCD_KEY"

_SEGMENT = re.compile(r"[A-Za-z0-9._-]{1,64}\Z")


def is_etcd(addr: object) -> bool:
    return isinstance(addr, str) and addr.startswith(SCHEME)


@dataclass(frozen=True, kw_only=True)
class EtcdConfig:
    endpoints: tuple[str, ...]                 # "host:port", IPv6 hosts in brackets
    namespace: str = DEFAULT_NAMESPACE
    ttl_s: int = DEFAULT_TTL_S                 # each rank's lease
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    ca_cert: str | None = None
    cert: str | None = None
    key: str | None = None

    @property
    def secure(self) -> bool:
        return self.ca_cert is not None or self.cert is not None

    @property
    def urls(self) -> list[str]:
        scheme = "https" if self.secure else "http"
        return [f"{scheme}://{e}" for e in self.endpoints]

    @property
    def display(self) -> str:
        """The address without secrets (logs, errors, status)."""
        return f"{SCHEME}{','.join(self.endpoints)}/{self.namespace}"


def parse_etcd_url(addr: object, name: str = "bootstrap", env: Mapping[str, str] | None = None) -> EtcdConfig:
    """The EtcdConfig of an ``etcd://`` address plus the environment's credentials and TLS files."""
    env = os.environ if env is None else env
    if not is_etcd(addr):
        raise ValueError(f"{name}={addr!r} is not an etcd address (etcd://host:port[,host:port...][/namespace])")
    rest = addr[len(SCHEME):]
    rest, _, query = rest.partition("?")
    hosts, _, namespace = rest.partition("/")
    if "@" in hosts:
        raise ValueError(f"{name}: no user or password in an etcd address (it is logged); set {USER_ENV} and "
                         f"{PASSWORD_ENV} (or {PASSWORD_FILE_ENV})")
    endpoints = tuple(_endpoint(name, addr, h) for h in hosts.split(","))
    namespace = namespace.strip("/") or DEFAULT_NAMESPACE
    bad = next((s for s in namespace.split("/") if not _SEGMENT.match(s)), None)
    if bad is not None:
        raise ValueError(f"{name}={addr!r}: the namespace segment {bad!r} must be 1 to 64 letters, digits, "
                         "'.', '_' or '-'")
    ttl = DEFAULT_TTL_S
    for k, v in parse_qsl(query, keep_blank_values=True):
        if k != "ttl":
            raise ValueError(f"{name}={addr!r}: unknown option {k!r} (the only one is ttl=SECONDS)")
        if not v.isdigit() or not 1 <= int(v) <= MAX_TTL_S:
            raise ValueError(f"{name}={addr!r}: ttl must be whole seconds in 1..{MAX_TTL_S}, got {v!r}")
        ttl = int(v)
    user, password = _credentials(env)
    ca, cert, key = (_file(env, v) for v in (CA_ENV, CERT_ENV, KEY_ENV))
    if (cert is None) != (key is None):
        raise ValueError(f"{CERT_ENV} and {KEY_ENV} go together (a client certificate and its key)")
    return EtcdConfig(endpoints=endpoints, namespace=namespace, ttl_s=ttl, user=user, password=password,
                      ca_cert=ca, cert=cert, key=key)


def with_namespace(addr: str, namespace: str) -> str:
    """The same etcd address (endpoints, options) with `namespace` appended to its own."""
    base, _, query = addr.partition("?")
    hosts, _, ns = base[len(SCHEME):].partition("/")
    ns = "/".join(x for x in (ns.strip("/") or DEFAULT_NAMESPACE, namespace.strip("/")) if x)
    out = f"{SCHEME}{hosts}/{ns}" + (f"?{query}" if query else "")
    parse_etcd_url(out, "namespace", env={})
    return out


def _endpoint(name: str, addr: str, text: str) -> str:
    if not text:
        raise ValueError(f"{name}={addr!r}: an empty endpoint (etcd://host:port[,host:port...][/namespace])")
    has_port = text.rpartition(":")[2].isdigit() and (not text.startswith("[") or "]:" in text)
    host, port = split_host_port(name, text if has_port else f"{text}:{DEFAULT_PORT}")
    return f"{host}:{port}"


def _credentials(env: Mapping[str, str]) -> tuple[str | None, str | None]:
    user = env.get(USER_ENV) or None
    password = env.get(PASSWORD_ENV) or None
    path = env.get(PASSWORD_FILE_ENV) or None
    if password is not None and path is not None:
        raise ValueError(f"set {PASSWORD_ENV} or {PASSWORD_FILE_ENV}, not both")
    if path is not None:
        try:
            password = Path(path).read_text().splitlines()[0] if Path(path).read_text() else ""
        except OSError as exc:
            raise ValueError(f"{PASSWORD_FILE_ENV}={path!r}: {exc}") from None
        if not password:
            raise ValueError(f"{PASSWORD_FILE_ENV}={path!r}: the file is empty")
    if (user is None) != (password is None):
        raise ValueError(f"{USER_ENV} and a password ({PASSWORD_ENV} or {PASSWORD_FILE_ENV}) go together")
    return user, password


def _file(env: Mapping[str, str], var: str) -> str | None:
    path = env.get(var) or None
    if path is not None and not os.path.isfile(path):
        raise ValueError(f"{var}={path!r} is not a file")
    return path
