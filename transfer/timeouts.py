"""Deadlines of a kvstage engine (`Timeouts`): what the pure protocol's rooms and the engine's
shells time out on. A module of its own, importing nothing of the rendezvous or the backends,
so the protocol (transfer/protocol/) reads them without importing the engine's configuration;
`kvstage.transfer.config` and `kvstage.transfer` export it too."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import cast

from . import config_values as check
from .config_values import from_env
from .deprecation import accepts_old_positional


@accepts_old_positional("bootstrap", "connect", "metadata", "watermark", "write", "arrival", "scatter", "room",
                        "heartbeat", "lease", "close", "quarantine")
@dataclass(frozen=True, kw_only=True)
class Timeouts:
    """Deadlines in seconds. Each can be set by env KVSTAGE_TIMEOUT_<NAME> (e.g. _CONNECT)."""

    bootstrap: float = 30.0     # lookup of a peer engine until all its ranks registered
    connect: float = 10.0       # Hello until HelloAck from a peer
    metadata: float = 120.0     # prefill sender waiting for the decode side's room metadata
    watermark: float = 30.0     # a staged write waiting for its ring region to be free
    write: float = 30.0         # a posted backend write until it completes
    arrival: float = 10.0       # tags still missing after the writer reported its writes done
    scatter: float = 30.0       # a landed piece until it is scattered into the cache
    room: float = 600.0         # decode: init() until every byte is in place
    heartbeat: float = 1.0      # interval between heartbeats to connected peers
    lease: float = 10.0         # a peer silent this long is considered dead
    close: float = 5.0          # close(): waiting for in-flight writes before deregistering
    quarantine: float = -1.0    # decode: hold a silently lost writer's memory this long (-1: the backend's
                                # stall bound: 0 for NIXL, whose release cancels; Mooncake's stall timeout)

    def __post_init__(self) -> None:
        for f in fields(self):
            name, val = f"timeouts.{f.name}", getattr(self, f.name)
            if f.name == "quarantine":
                _quarantine(name, val)
            else:
                check.positive(name, val)
        if self.heartbeat >= self.lease:
            raise ValueError(f"timeouts.heartbeat={self.heartbeat:g} must be shorter than timeouts.lease={self.lease:g}: "
                             f"a peer would be declared lost between two heartbeats (a quarter of the lease or "
                             f"less leaves room for lost ones)")

    @classmethod
    def from_env(cls, **overrides: float) -> Timeouts:
        unknown = set(overrides) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown timeouts: {', '.join(sorted(unknown))}")
        vals: dict[str, float] = {}
        for f in fields(cls):
            checker = _quarantine if f.name == "quarantine" else check.positive
            default = cast(float, f.default)   # every field has a float default
            vals[f.name] = from_env(f"KVSTAGE_TIMEOUT_{f.name.upper()}", default, float, checker)
        vals.update(overrides)
        return cls(**vals)

    def mooncake_stall(self) -> float:
        """How long a Mooncake write may make no progress before it fails: well inside the
        lease, so a stalled write is over before the peer could reuse its memory."""
        return max(1.0, min(self.write, self.lease) / 2)

    def quarantine_for(self, backend: str) -> float:
        if self.quarantine >= 0:
            return self.quarantine
        return self.mooncake_stall() + 1.0 if backend == "mooncake" else 0.0


def _quarantine(name: str, value: object) -> float:
    """-1 (automatic) or a finite number of seconds >= 0."""
    seconds = check.real(name, value)
    if seconds != -1 and not (math.isfinite(seconds) and seconds >= 0):
        raise ValueError(f"{name}={value!r} must be -1 (automatic) or finite and >= 0")
    return seconds
