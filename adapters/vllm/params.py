"""What travels between the two vLLM instances in `kv_transfer_params`, and the connector's own
settings (`kv_connector_extra_config`). Pure: parsing and checks, each error naming the key."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

#: keys of kv_transfer_params this connector adds to vLLM's do_remote_decode / do_remote_prefill
ROOM, RENDEZVOUS, DP_RANK, ENGINE, TP_SIZE = ("kvstage_room", "kvstage_rendezvous", "kvstage_dp_rank",
                                              "kvstage_engine", "kvstage_tp_size")
BACKENDS = ("nixl", "mooncake")


@dataclass(frozen=True, kw_only=True)
class RemotePrefill:
    """Where a decode request's KV comes from: the prefill instance's room and rendezvous."""

    room: int
    rendezvous: str
    dp_rank: int = 0
    engine: str = ""
    tp_size: int = 0


def remote_prefill(params: dict | None) -> RemotePrefill | None:
    """The prefill a decode request names (None when it names none). ValueError for a request
    that asks for a remote prefill without kvstage's keys, naming what is missing or wrong."""
    if not params or not params.get("do_remote_prefill"):
        return None
    missing = [k for k in (ROOM, RENDEZVOUS) if k not in params]
    if missing:
        raise ValueError(f"kv_transfer_params asks for a remote prefill but lacks {', '.join(missing)} (the "
                         f"prefill response's kv_transfer_params, unchanged, are what the decode request needs)")
    room, addr = params[ROOM], params[RENDEZVOUS]
    if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room < 2 ** 64:
        raise ValueError(f"kv_transfer_params {ROOM} must be an int in [0, 2**64), got {room!r}")
    if not isinstance(addr, str) or ":" not in addr:
        raise ValueError(f"kv_transfer_params {RENDEZVOUS} must be 'host:port', got {addr!r}")
    dp = params.get(DP_RANK, 0)
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 0:
        raise ValueError(f"kv_transfer_params {DP_RANK} must be an int >= 0, got {dp!r}")
    return RemotePrefill(room=room, rendezvous=addr, dp_rank=dp, engine=str(params.get(ENGINE, "")),
                         tp_size=int(params.get(TP_SIZE, 0) or 0))


def wants_remote_decode(params: dict | None) -> bool:
    return bool(params and params.get("do_remote_decode"))


def prompt_pages(num_prompt_tokens: int, block_size: int) -> int:
    """Pages holding a prompt's KV (the decode side loads all of them and recomputes the last
    token itself, as vLLM does for every remote prefill)."""
    return math.ceil(num_prompt_tokens / block_size)


@dataclass(frozen=True, kw_only=True)
class ConnectorSettings:
    """kv_connector_extra_config, checked."""

    rendezvous_port: int
    host: str
    backend: str = "nixl"
    staging: bool = True
    layerwise: bool = True               # prefill: send each layer from save_kv_layer (else per request)
    metrics_port: int | None = None      # Prometheus /metrics of TP rank r on metrics_port + r

    @classmethod
    def parse(cls, extra: dict | None, default_host: str) -> ConnectorSettings:
        extra = dict(extra or {})
        known = {"rendezvous_port", "host", "backend", "staging", "layerwise", "metrics_port"}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"kv_connector_extra_config: unknown key(s) {', '.join(unknown)} for the kvstage "
                             f"connector (known: {', '.join(sorted(known))})")
        port = extra.get("rendezvous_port")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise ValueError(f"kv_connector_extra_config.rendezvous_port must be a port number (the kvstage "
                             f"rendezvous server of this instance; each instance on a host needs its own), "
                             f"got {port!r}")
        backend = str(extra.get("backend", os.environ.get("KVSTAGE_VLLM_BACKEND", "nixl"))).strip().lower()
        if backend not in BACKENDS:
            raise ValueError(f"kv_connector_extra_config.backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        staging, layerwise = extra.get("staging", True), extra.get("layerwise", True)
        for key, flag in (("staging", staging), ("layerwise", layerwise)):
            if not isinstance(flag, bool):
                raise ValueError(f"kv_connector_extra_config.{key} must be true or false, got {flag!r}")
        host = extra.get("host") or default_host
        if not isinstance(host, str) or not host:
            raise ValueError(f"kv_connector_extra_config.host must be an address, got {host!r}")
        metrics = extra.get("metrics_port")
        if metrics is not None and (isinstance(metrics, bool) or not isinstance(metrics, int)
                                    or not 0 < metrics < 65536):
            raise ValueError(f"kv_connector_extra_config.metrics_port must be a port number, got {metrics!r}")
        return cls(rendezvous_port=port, host=host, backend=backend, staging=staging, layerwise=layerwise,
                   metrics_port=metrics)

    @property
    def rendezvous(self) -> str:
        host = self.host
        return f"[{host}]:{self.rendezvous_port}" if ":" in host and not host.startswith("[") else \
            f"{host}:{self.rendezvous_port}"
