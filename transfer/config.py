"""Engine configuration: the public `EngineConfig`, its environment defaults, and deadlines.

Every knob has a documented default (docs/configuration.md); an explicit argument wins over the
environment, which wins over the default.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace

STAGING_ENV = "SGLANG_DISAGG_STAGING_BUFFER"
RING_MB_ENV = "SGLANG_DISAGG_STAGING_POOL_SIZE_MB"
WORKERS_ENV = "KVSTAGE_STAGING_WORKERS"
BUFFER_MB_ENV = "KVSTAGE_STAGING_BUFFER_MB"
PIECE_MB_ENV = "KVSTAGE_STAGING_PIECE_MB"
TOKEN_ENV = "KVSTAGE_AUTH_TOKEN"

_TRUE = {"1", "true", "on", "yes"}
_FALSE = {"0", "false", "off", "no", ""}


def env_flag(name: str, default: bool = False) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    val = raw.strip().lower()
    if val in _TRUE:
        return True
    if val in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r}: use 1/true/on or 0/false/off")


def env_number(name: str, default: float, kind: type = float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        val = kind(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a {kind.__name__}") from None
    if val <= 0:
        raise ValueError(f"{name}={raw!r} must be positive")
    return val


@dataclass(frozen=True)
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

    @classmethod
    def from_env(cls, **overrides: float) -> "Timeouts":
        vals = {}
        for f in fields(cls):
            if f.name == "quarantine" and not os.environ.get("KVSTAGE_TIMEOUT_QUARANTINE"):
                vals[f.name] = f.default
                continue
            vals[f.name] = env_number(f"KVSTAGE_TIMEOUT_{f.name.upper()}", f.default)
        vals.update(overrides)
        t = cls(**vals)
        for f in fields(t):
            if getattr(t, f.name) <= 0 and f.name != "quarantine":
                raise ValueError(f"timeout {f.name} must be positive")
        return t

    def mooncake_stall(self) -> float:
        """How long a Mooncake write may make no progress before it fails: well inside the
        lease, so a stalled write is over before the peer could reuse its memory."""
        return max(1.0, min(self.write, self.lease) / 2)

    def quarantine_for(self, backend: str) -> float:
        if self.quarantine >= 0:
            return self.quarantine
        return self.mooncake_stall() + 1.0 if backend == "mooncake" else 0.0


@dataclass(frozen=True)
class EngineConfig:
    """How one rank process embeds kvstage (DESIGN.md section 3)."""

    role: str                                # "prefill" or "decode"
    engine_id: str                           # the TP group this rank belongs to
    bootstrap: str                           # "host:port" of the rendezvous server
    backend: str = "nixl"                    # or "mooncake"
    staging: bool | None = None              # None: read SGLANG_DISAGG_STAGING_BUFFER
    host: str = "127.0.0.1"                  # address this rank binds and advertises
    auth_token: str | None = None            # None: read KVSTAGE_AUTH_TOKEN
    ctrl_port: int = 0                       # control-plane port; 0 picks a free one
    staging_workers: int | None = None       # prefill transfer workers; env KVSTAGE_STAGING_WORKERS, 2
    staging_buffer_mb: float | None = None   # per-worker buffer; env KVSTAGE_STAGING_BUFFER_MB, 64
    ring_mb: float | None = None             # decode ring; env SGLANG_DISAGG_STAGING_POOL_SIZE_MB, 256
    staging_piece_mb: float | None = None    # largest writer part of one piece (pipelining); env
                                             # KVSTAGE_STAGING_PIECE_MB, 32
    timeouts: Timeouts | None = None         # None: Timeouts.from_env()
    backend_options: dict = field(default_factory=dict)
    faults: dict | None = None               # tests and drills only: transfer.backends.faults.FaultPlan

    def resolved(self) -> "EngineConfig":
        """A copy with every None filled from the environment, validated."""
        if self.role not in ("prefill", "decode"):
            raise ValueError(f"role must be 'prefill' or 'decode', got {self.role!r}")
        if not self.engine_id or not isinstance(self.engine_id, str):
            raise ValueError("engine_id must be a non-empty string")
        if self.backend not in ("nixl", "mooncake"):
            raise ValueError(f"backend must be 'nixl' or 'mooncake', got {self.backend!r}")
        host, sep, port = self.bootstrap.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"bootstrap must be 'host:port', got {self.bootstrap!r}")
        token = self.auth_token if self.auth_token is not None else (os.environ.get(TOKEN_ENV) or None)
        if token is not None and not token:
            raise ValueError("auth_token is empty")
        return replace(
            self,
            staging=env_flag(STAGING_ENV) if self.staging is None else bool(self.staging),
            auth_token=token,
            staging_workers=int(self.staging_workers or env_number(WORKERS_ENV, 2, int)),
            staging_buffer_mb=float(self.staging_buffer_mb or env_number(BUFFER_MB_ENV, 64.0)),
            ring_mb=float(self.ring_mb or env_number(RING_MB_ENV, 256.0)),
            staging_piece_mb=float(self.staging_piece_mb or env_number(PIECE_MB_ENV, 32.0)),
            timeouts=self.timeouts or Timeouts.from_env(),
        )

    @property
    def token_bytes(self) -> bytes | None:
        return self.auth_token.encode() if self.auth_token else None
