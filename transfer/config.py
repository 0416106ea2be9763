"""Engine configuration: the public input `EngineConfig`, and `ResolvedConfig`, what the engine
reads (its deadlines, `Timeouts`, are in timeouts.py and exported here too).

Every knob has a documented default (docs/configuration.md); an explicit argument wins over the
environment, which wins over the default. `EngineConfig.resolved()` applies that order once and
validates: the `ResolvedConfig` it returns has a concrete value in every field, so nothing past
it asks "was this given?" again.

The core reads only `KVSTAGE_*` variables. A serving framework's own names for the same knobs
(SGLang's staging switch and ring size) are the adapter's to read and pass as arguments
(adapters/sglang/plugin.py `engine_options`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ..bootstrap.address import check_host
from ..bootstrap.rendezvous import check_address
from ..bootstrap.rendezvous import from_env as from_bootstrap_env
from . import config_values as check
from .config_values import from_env
from .deprecation import accepts_old_positional
from .protocol.engine_leases import LeaseMode, check_engine_timeouts
from .protocol.kinds import Role
from .protocol.path_choice import PathMode
from .timeouts import Timeouts

__all__ = ["EngineConfig", "ResolvedConfig", "Timeouts", "env_flag"]

STAGING_ENV = "KVSTAGE_STAGING"
VERIFY_ENV = "KVSTAGE_VERIFY"
RING_MB_ENV = "KVSTAGE_RING_MB"
WORKERS_ENV = "KVSTAGE_STAGING_WORKERS"
BUFFER_MB_ENV = "KVSTAGE_STAGING_BUFFER_MB"
PIECE_MB_ENV = "KVSTAGE_STAGING_PIECE_MB"
TOKEN_ENV = "KVSTAGE_AUTH_TOKEN"
METRICS_PORT_ENV = "KVSTAGE_METRICS_PORT"
CTRL_PORT_ENV = "KVSTAGE_CTRL_PORT"
LAYER_GROUP_ENV = "KVSTAGE_LAYER_GROUP"
LAYERWISE_MIN_TOKENS_ENV = "KVSTAGE_LAYERWISE_MIN_TOKENS"
LAYER_BATCHING_ENV = "KVSTAGE_LAYER_BATCHING"
INLINE_SCATTER_KB_ENV = "KVSTAGE_INLINE_SCATTER_KB"
INLINE_GATHER_KB_ENV = "KVSTAGE_INLINE_GATHER_KB"
PATH_ENV = "KVSTAGE_PATH"             # auto | staged | direct (protocol/path_choice.py)
CALIBRATE_ENV = "KVSTAGE_CALIBRATE"   # measure the path costs at start (on by default)
CREDITS_ENV = "KVSTAGE_CREDITS"       # staged: ring credits instead of a grant per chunk (on by default)
LEASES_ENV = "KVSTAGE_LEASES"         # rank | engine: one lease per pair of ranks or of engines
COPY_STREAMS_ENV = "KVSTAGE_COPY_STREAMS"   # CUDA: each copying thread on a stream of its own (on by default)
DEFAULT_INLINE_SCATTER_KB = 256    # decode: pieces up to this size are scattered on the control thread
DEFAULT_INLINE_GATHER_KB = 256     # prefill: pieces up to this size are gathered and posted by the control thread
DEFAULT_LAYER_GROUP = 4            # layers per write of a layer-wise send (docs/journal/benchmarks-2026-11.md)
DEFAULT_LAYERWISE_MIN_TOKENS = 512  # shorter requests go per chunk (ibid.)
MAX_LAYERS = 1 << 16

MAX_WORKERS = 64
MAX_MB = 1 << 20  # 1 TiB: any larger staging size is a typo


def env_flag(name: str, default: bool = False) -> bool:
    return from_env(name, default, str, check.flag)


@accepts_old_positional("role", "engine_id", "bootstrap", "backend", "staging", "host", "auth_token", "ctrl_port",
                        "staging_workers", "staging_buffer_mb", "ring_mb", "staging_piece_mb", "timeouts",
                        "backend_options", "faults", "dp_rank", "metrics_port", "verify")
@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """How one rank process embeds kvstage (README, "Embedding it"; docs/configuration.md)."""

    role: str                                # "prefill" or "decode" (resolved: a Role)
    engine_id: str                           # the TP group this rank belongs to
    bootstrap: str | None = None             # the rendezvous: "host:port" of a bootstrap server, or
                                             # "etcd://host:port[,...][/namespace]"; None: KVSTAGE_BOOTSTRAP
    backend: str = "nixl"                    # or "mooncake"
    staging: bool | None = None              # None: read KVSTAGE_STAGING
    host: str = "127.0.0.1"                  # address this rank binds and advertises
    auth_token: str | None = None            # None: read KVSTAGE_AUTH_TOKEN
    ctrl_port: int | None = None             # control-plane port (0 picks a free one); None: env
                                             # KVSTAGE_CTRL_PORT, unset: 0. A fixed port lets a restarted
                                             # rank come back on its old address (docs/operations.md)
    staging_workers: int | None = None       # prefill transfer workers; env KVSTAGE_STAGING_WORKERS, 2
    staging_buffer_mb: float | None = None   # per-worker buffer; env KVSTAGE_STAGING_BUFFER_MB, 64
    ring_mb: float | None = None             # decode ring; env KVSTAGE_RING_MB, 256
    staging_piece_mb: float | None = None    # largest writer part of one piece (pipelining); env
                                             # KVSTAGE_STAGING_PIECE_MB, 32
    timeouts: Timeouts | None = None         # None: Timeouts.from_env()
    backend_options: dict[str, object] = field(default_factory=dict)
    faults: dict[str, object] | None = None               # tests and drills only: transfer.backends.faults.FaultPlan
    dp_rank: int = 0                         # prefill: data-parallel rank of this engine in its serving
                                             # instance (decode ranks may name it by rendezvous server + DP rank)
    metrics_port: int | None = None          # Prometheus /metrics on host:port (0: any free port); None: env
                                             # KVSTAGE_METRICS_PORT, unset: no metrics (needs prometheus-client)
    verify: bool | None = None               # end-to-end digests of every write; None: read KVSTAGE_VERIFY
    layer_group: int | None = None           # prefill: layers per write of a layer-wise send (0: every layer
                                             # at once); env KVSTAGE_LAYER_GROUP, 4
    layerwise_min_tokens: int | None = None  # prefill: shorter requests are sent per chunk whatever layers
                                             # send() names; env KVSTAGE_LAYERWISE_MIN_TOKENS, 512
    layer_batching: bool | None = None       # prefill, direct path: layer-wise writes size themselves (one
                                             # layer while the transfer keeps up, merged behind a write in
                                             # flight) instead of layer_group; env KVSTAGE_LAYER_BATCHING, on
    inline_scatter_kb: int | None = None     # decode, staged: a landed piece of at most this many KiB is
                                             # scattered by the control thread that read its tag, not handed
                                             # to the scatter thread (0: never); env KVSTAGE_INLINE_SCATTER_KB, 256
    inline_gather_kb: int | None = None      # prefill, staged: a piece of at most this many KiB whose layers are
                                             # written is gathered and posted by the control thread that hands it
                                             # out, not by a transfer worker (0: never); env KVSTAGE_INLINE_GATHER_KB, 256
    path: str | None = None                  # decode: "auto" (the cheaper predicted path per request),
                                             # "staged" or "direct" (forced); prefill: "direct" offers no
                                             # staging; env KVSTAGE_PATH, auto (docs/path_choice.md)
    calibrate: bool | None = None            # measure write, gather and scatter costs at start for the
                                             # "auto" choice (off: the fixed rule); env KVSTAGE_CALIBRATE, on
    credits: bool | None = None              # staged: ring credits (decode: offers them; prefill: takes them)
                                             # instead of asking ring space per chunk; env KVSTAGE_CREDITS, on
    copy_streams: bool | None = None         # CUDA caches, staged: each thread that gathers or scatters queues
                                             # its copies on a non-blocking stream of its own, not the legacy
                                             # default stream (staging/copy_streams.py); env KVSTAGE_COPY_STREAMS, on

    leases: str | None = None                # "rank" (one lease per pair of connected ranks) or "engine" (one
                                             # per pair of engines, the ranks of an engine vouching for each
                                             # other: docs/scale.md#engine-pair-leases); env KVSTAGE_LEASES, rank

    def resolved(self) -> ResolvedConfig:
        """Every None filled from the environment or the default, validated: a bad value raises
        ValueError naming the option or variable, never turns into another value."""
        if self.role not in tuple(Role):
            raise ValueError(f"role must be 'prefill' or 'decode', got {self.role!r}")
        if not self.engine_id or not isinstance(self.engine_id, str):
            raise ValueError("engine_id must be a non-empty string")
        if self.backend not in ("nixl", "mooncake"):
            raise ValueError(f"backend must be 'nixl' or 'mooncake', got {self.backend!r}")
        bootstrap = check_address("bootstrap", from_bootstrap_env(self.bootstrap))
        host = check_host("host", self.host).strip("[]")   # an IPv6 literal is kept without brackets
        ctrl_port = (from_env(CTRL_PORT_ENV, 0, int, check.port) if self.ctrl_port is None
                     else check.port("ctrl_port", self.ctrl_port))
        if isinstance(self.dp_rank, bool) or not isinstance(self.dp_rank, int) or not 0 <= self.dp_rank <= 1024:
            raise ValueError(f"dp_rank must be an int in 0..1024, got {self.dp_rank!r}")
        token = self.auth_token if self.auth_token is not None else (os.environ.get(TOKEN_ENV) or None)
        if token is not None and (not isinstance(token, str) or not token):
            raise ValueError("auth_token must be a non-empty string or None")
        options = {} if self.backend_options is None else self.backend_options
        if not isinstance(options, dict) or not all(isinstance(k, str) for k in options):
            raise ValueError(f"backend_options must be a dict with str keys, got {self.backend_options!r}")
        if self.faults is not None and not isinstance(self.faults, dict):
            raise ValueError(f"faults must be a dict or None, got {self.faults!r}")
        timeouts = Timeouts.from_env() if self.timeouts is None else self.timeouts
        if not isinstance(timeouts, Timeouts):
            raise ValueError(f"timeouts must be a Timeouts instance or None, got {timeouts!r}")
        staging = env_flag(STAGING_ENV) if self.staging is None else check.flag("staging", self.staging)
        path = self._path(staging)
        leases = self._leases(timeouts)
        return ResolvedConfig(
            role=Role(self.role),
            engine_id=self.engine_id,
            backend=self.backend,
            staging=staging,
            path=path,
            leases=leases,
            calibrate=(env_flag(CALIBRATE_ENV, True) if self.calibrate is None
                       else check.flag("calibrate", self.calibrate)),
            verify=env_flag(VERIFY_ENV) if self.verify is None else check.flag("verify", self.verify),
            credits=env_flag(CREDITS_ENV, True) if self.credits is None else check.flag("credits", self.credits),
            copy_streams=(env_flag(COPY_STREAMS_ENV, True) if self.copy_streams is None
                          else check.flag("copy_streams", self.copy_streams)),
            layer_batching=(env_flag(LAYER_BATCHING_ENV, True) if self.layer_batching is None
                            else check.flag("layer_batching", self.layer_batching)),
            auth_token=token,
            bootstrap=bootstrap,
            host=host,
            ctrl_port=ctrl_port,
            staging_workers=self._count("staging_workers", WORKERS_ENV, 2),
            staging_buffer_mb=self._mb("staging_buffer_mb", BUFFER_MB_ENV, 64.0),
            ring_mb=self._mb("ring_mb", RING_MB_ENV, 256.0),
            staging_piece_mb=self._mb("staging_piece_mb", PIECE_MB_ENV, 32.0),
            layer_group=self._natural("layer_group", LAYER_GROUP_ENV, DEFAULT_LAYER_GROUP, MAX_LAYERS),
            layerwise_min_tokens=self._natural("layerwise_min_tokens", LAYERWISE_MIN_TOKENS_ENV,
                                               DEFAULT_LAYERWISE_MIN_TOKENS, 1 << 40),
            inline_scatter_kb=self._natural("inline_scatter_kb", INLINE_SCATTER_KB_ENV, DEFAULT_INLINE_SCATTER_KB,
                                            MAX_MB << 10),
            inline_gather_kb=self._natural("inline_gather_kb", INLINE_GATHER_KB_ENV, DEFAULT_INLINE_GATHER_KB,
                                           MAX_MB << 10),
            backend_options=options,
            timeouts=timeouts,
            faults=self.faults,
            dp_rank=self.dp_rank,
            metrics_port=(from_env(METRICS_PORT_ENV, None, int, check.port) if self.metrics_port is None
                          else check.port("metrics_port", self.metrics_port)),
        )

    def _path(self, staging: bool) -> PathMode:
        """auto, staged or direct; "staged" needs staging on (the decode side's ring, the prefill
        side's buffers): a ValueError naming both options otherwise."""
        explicit = self.path is not None
        value = self.path if explicit else os.environ.get(PATH_ENV, "auto").strip().lower() or "auto"
        option = "path" if explicit else PATH_ENV
        if value not in ("auto", "staged", "direct"):
            raise ValueError(f"{option}={value!r} must be 'auto', 'staged' or 'direct'")
        if value == "staged" and not staging:
            raise ValueError(f"{option}='staged' needs staging on ({STAGING_ENV} / EngineConfig.staging): "
                             f"without it this rank has no {'staging ring' if self.role == Role.DECODE else 'staging buffers'}")
        return PathMode(value)

    def _leases(self, timeouts: Timeouts) -> LeaseMode:
        """rank or engine; engine needs its beats to fit in the lease (a ValueError naming both)."""
        explicit = self.leases is not None
        value = self.leases if explicit else os.environ.get(LEASES_ENV, "rank").strip().lower() or "rank"
        option = "leases" if explicit else LEASES_ENV
        if value not in tuple(LeaseMode):
            raise ValueError(f"{option}={value!r} must be 'rank' or 'engine'")
        mode = LeaseMode(value)
        if mode is LeaseMode.ENGINE:
            check_engine_timeouts(timeouts.heartbeat, timeouts.lease)
        return mode

    def _count(self, option: str, env: str, default: int) -> int:
        def workers(name: str, value: object) -> int:
            return check.count(name, value, 1, MAX_WORKERS)
        value = getattr(self, option)
        return from_env(env, default, int, workers) if value is None else workers(option, value)

    def _natural(self, option: str, env: str, default: int, maximum: int) -> int:
        def natural(name: str, value: object) -> int:
            return check.count(name, value, 0, maximum)
        value = getattr(self, option)
        return from_env(env, default, int, natural) if value is None else natural(option, value)

    def _mb(self, option: str, env: str, default: float) -> float:
        def size(name: str, value: object) -> float:
            return check.positive(name, value, MAX_MB)
        value = getattr(self, option)
        return from_env(env, default, float, size) if value is None else size(option, value)

    @property
    def token_bytes(self) -> bytes | None:
        return self.auth_token.encode() if self.auth_token else None



@dataclass(frozen=True, kw_only=True)
class ResolvedConfig:
    """One rank's configuration as the engine reads it (`KVManager.config`, `EngineContext.cfg`):
    `EngineConfig.resolved()`'s answer, each field given, read from the environment or defaulted,
    and checked (docs/configuration.md says what each means). Frozen; no field means "unset".
    Three may be None because None is one of their values: `auth_token` (no shared secret,
    frames unsigned), `faults` (no injected faults), `metrics_port` (no metrics server). The path
    costs, the other input that may be absent, are measured at start, not configured
    (EngineContext.calibration)."""

    role: Role
    engine_id: str
    bootstrap: str                   # a checked rendezvous address: "host:port" or "etcd://..."
    backend: str                     # "nixl" or "mooncake"
    staging: bool
    host: str                        # an IPv6 literal without brackets
    auth_token: str | None           # None: no shared secret
    ctrl_port: int                   # 0: a free port
    staging_workers: int
    staging_buffer_mb: float
    ring_mb: float
    staging_piece_mb: float
    timeouts: Timeouts
    backend_options: dict[str, Any]
    faults: dict[str, Any] | None    # None: no injected faults
    dp_rank: int
    metrics_port: int | None         # None: no metrics server (0: any free port)
    verify: bool
    layer_group: int
    layerwise_min_tokens: int
    layer_batching: bool
    inline_scatter_kb: int
    inline_gather_kb: int
    path: PathMode
    leases: LeaseMode
    calibrate: bool
    credits: bool
    copy_streams: bool

    @property
    def token_bytes(self) -> bytes | None:
        return self.auth_token.encode() if self.auth_token else None
