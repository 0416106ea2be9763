"""EngineConfig and Timeouts: every bad value is a ValueError naming the option or variable,
and every good value comes back unchanged (nothing silently replaced by a default); the resolved
configuration has a value in every field, and the core reads only KVSTAGE_* variables."""

from __future__ import annotations

import dataclasses
import math
import types
import typing

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstage.transfer.config import (
    BUFFER_MB_ENV,
    CTRL_PORT_ENV,
    PIECE_MB_ENV,
    RING_MB_ENV,
    STAGING_ENV,
    WORKERS_ENV,
    EngineConfig,
    ResolvedConfig,
    Timeouts,
)
from kvstage.transfer.protocol.kinds import Role
from kvstage.transfer.protocol.path_choice import PathMode

MAX_MB = 1 << 20
# SGLang's names for the staging switch and the ring's size: its adapter reads them, never the core
SGLANG_ENVS = ("SGLANG_DISAGG_STAGING_BUFFER", "SGLANG_DISAGG_STAGING_POOL_SIZE_MB")
ENVS = (STAGING_ENV, RING_MB_ENV, WORKERS_ENV, BUFFER_MB_ENV, PIECE_MB_ENV, CTRL_PORT_ENV, *SGLANG_ENVS)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ENVS:
        monkeypatch.delenv(name, raising=False)
    for f in Timeouts.__dataclass_fields__:
        monkeypatch.delenv(f"KVSTAGE_TIMEOUT_{f.upper()}", raising=False)


def cfg(**kw) -> EngineConfig:
    base = dict(role="prefill", engine_id="e", bootstrap="127.0.0.1:8998")
    return EngineConfig(**(base | kw))


@pytest.mark.parametrize("option, value", [
    ("staging_workers", 0), ("staging_workers", -1), ("staging_workers", 1.5), ("staging_workers", True),
    ("staging_workers", "2"),
    ("ring_mb", 0), ("ring_mb", -1.0), ("ring_mb", math.nan), ("ring_mb", math.inf), ("ring_mb", True), ("ring_mb", 2.0 * MAX_MB),
    ("staging_buffer_mb", 0), ("staging_buffer_mb", math.nan), ("staging_piece_mb", 0.0),
    ("staging_piece_mb", -math.inf),
    ("staging", "maybe"), ("staging", 2), ("layer_batching", "sometimes"), ("layer_batching", 2),
    ("ctrl_port", 70000), ("ctrl_port", -1), ("ctrl_port", 1.5), ("ctrl_port", True),
    ("bootstrap", 8998), ("bootstrap", "localhost"), ("bootstrap", "h:0"), ("bootstrap", "h:70000"),
    ("bootstrap", ":8998"), ("bootstrap", "bad host!:8998"), ("bootstrap", "a..b:1"), ("bootstrap", "-h:1"),
    ("bootstrap", "1.2.3.256:1"), ("bootstrap", "::1:8998"), ("bootstrap", "[::zz]:1"), ("bootstrap", "[h]:1"),
    ("bootstrap", "x" * 64 + ":1"),
    ("backend_options", "x"), ("backend_options", [("a", 1)]),
    ("host", ""), ("host", 127), ("host", "bad host!"), ("host", "10.0.0.300"), ("host", "[::1"), ("host", "h_1"),
    ("timeouts", {"connect": 1.0}),
])
def test_bad_option_is_a_value_error_naming_it(option, value):
    with pytest.raises(ValueError, match=option):
        cfg(**{option: value}).resolved()


@pytest.mark.parametrize("name, value", [(n, v) for n in ("connect", "bootstrap", "lease", "heartbeat")
                                         for v in (0, -1.0, math.nan, math.inf, -math.inf, True, "5")])
def test_bad_timeout_names_it(name, value):
    with pytest.raises(ValueError, match=f"timeouts.{name}"):
        cfg(timeouts=Timeouts(**{name: value})).resolved()


@pytest.mark.parametrize("heartbeat, lease", [(1.0, 1.0), (2.0, 1.0), (10.0, 0.5)])
def test_heartbeat_not_shorter_than_the_lease_names_both(heartbeat, lease):
    with pytest.raises(ValueError, match=r"timeouts.heartbeat=.* timeouts.lease="):
        Timeouts(heartbeat=heartbeat, lease=lease)


def test_heartbeat_shorter_than_the_lease_is_fine_from_env_too(monkeypatch):
    assert Timeouts(heartbeat=0.99, lease=1.0).heartbeat == 0.99
    monkeypatch.setenv("KVSTAGE_TIMEOUT_LEASE", "0.5")
    with pytest.raises(ValueError, match="timeouts.heartbeat=1 must be shorter than timeouts.lease=0.5"):
        Timeouts.from_env()


@pytest.mark.parametrize("value", [-2.0, -0.5, math.nan, math.inf])
def test_bad_quarantine(value):
    with pytest.raises(ValueError, match="timeouts.quarantine"):
        Timeouts(quarantine=value)


@pytest.mark.parametrize("value", [-1, 0, 0.0, 2.5])
def test_quarantine_minus_one_or_non_negative(value):
    assert Timeouts(quarantine=value).quarantine == value


@pytest.mark.parametrize("var, raw", [
    (WORKERS_ENV, "1.5"), (WORKERS_ENV, "0"), (WORKERS_ENV, "-1"), (WORKERS_ENV, "two"),
    (RING_MB_ENV, "nan"), (RING_MB_ENV, "inf"), (RING_MB_ENV, "0"), (RING_MB_ENV, "-3"), (RING_MB_ENV, "x"),
    (BUFFER_MB_ENV, "NaN"), (PIECE_MB_ENV, "-inf"),
    (STAGING_ENV, "maybe"), (STAGING_ENV, "2"), ("KVSTAGE_LAYER_BATCHING", "auto"),
    ("KVSTAGE_TIMEOUT_CONNECT", "nan"), ("KVSTAGE_TIMEOUT_CONNECT", "inf"), ("KVSTAGE_TIMEOUT_LEASE", "0"),
    ("KVSTAGE_TIMEOUT_ROOM", "-1"), ("KVSTAGE_TIMEOUT_QUARANTINE", "-2"), ("KVSTAGE_TIMEOUT_QUARANTINE", "nan"),
])
def test_bad_env_names_the_variable(monkeypatch, var, raw):
    monkeypatch.setenv(var, raw)
    with pytest.raises(ValueError, match=var):
        cfg().resolved()


@pytest.mark.parametrize("raw, want", [("1", True), ("TRUE", True), ("On", True), ("yes", True),
                                       ("0", False), ("false", False), ("OFF", False), ("No", False)])
def test_flag_words(monkeypatch, raw, want):
    assert cfg(staging=raw).resolved().staging is want
    monkeypatch.setenv(STAGING_ENV, raw)
    assert cfg().resolved().staging is want


def test_layer_batching_is_on_unless_turned_off(monkeypatch):
    assert cfg().resolved().layer_batching is True
    assert cfg(layer_batching="off").resolved().layer_batching is False
    monkeypatch.setenv("KVSTAGE_LAYER_BATCHING", "0")
    assert cfg().resolved().layer_batching is False
    assert cfg(layer_batching=True).resolved().layer_batching is True   # the argument wins


def test_quarantine_env_zero_is_allowed(monkeypatch):
    monkeypatch.setenv("KVSTAGE_TIMEOUT_QUARANTINE", "0")
    assert cfg().resolved().timeouts.quarantine == 0


def test_defaults_and_env(monkeypatch):
    r = cfg().resolved()
    assert (r.staging, r.staging_workers, r.ring_mb, r.staging_buffer_mb, r.staging_piece_mb) == (False, 2, 256, 64, 32)
    assert r.backend_options == {} and r.timeouts == Timeouts()
    monkeypatch.setenv(WORKERS_ENV, "3")
    monkeypatch.setenv(RING_MB_ENV, "0.5")
    r = cfg().resolved()
    assert (r.staging_workers, r.ring_mb) == (3, 0.5)
    assert cfg(backend_options=None).resolved().backend_options == {}


@given(st.integers(min_value=-10, max_value=100))
def test_workers_kept_or_refused(n):
    try:
        got = cfg(staging_workers=n).resolved().staging_workers
    except ValueError as exc:
        assert "staging_workers" in str(exc) and not 1 <= n <= 64
    else:
        assert got == n and 1 <= n <= 64


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_ring_mb_kept_or_refused(x):
    try:
        got = cfg(ring_mb=x).resolved().ring_mb
    except ValueError as exc:
        assert "ring_mb" in str(exc) and not 0 < x <= MAX_MB
    else:
        assert got == x and 0 < x <= MAX_MB


@given(st.integers(min_value=-100_000, max_value=200_000))
def test_ctrl_port_kept_or_refused(p):
    try:
        got = cfg(ctrl_port=p).resolved().ctrl_port
    except ValueError as exc:
        assert "ctrl_port" in str(exc) and not 0 <= p <= 65535
    else:
        assert got == p and 0 <= p <= 65535


def test_ctrl_port_from_the_environment_unless_given(monkeypatch):
    assert cfg().resolved().ctrl_port == 0                  # unset: a free port
    monkeypatch.setenv(CTRL_PORT_ENV, "24123")              # a restarted rank comes back on it
    assert cfg().resolved().ctrl_port == 24123
    assert cfg(ctrl_port=0).resolved().ctrl_port == 0       # the argument wins
    monkeypatch.setenv(CTRL_PORT_ENV, "70000")
    with pytest.raises(ValueError, match=CTRL_PORT_ENV):
        cfg().resolved()


def test_kv_manager_validates_before_starting_anything():
    from kvstage.transfer import KVManager
    with pytest.raises(ValueError, match="ctrl_port"):
        KVManager(cfg(ctrl_port=70000), None, None)  # no layout needed: validation comes first


@pytest.mark.parametrize("value", [-1, 1025, 1.0, True, "0"])
def test_bad_dp_rank_names_it(value):
    with pytest.raises(ValueError, match="dp_rank"):
        cfg(dp_rank=value).resolved()


@pytest.mark.parametrize("addr", ["127.0.0.1:8998", "localhost:1", "node-7.cluster.local:65535", "[::1]:8998",
                                  "[fe80::1%eth0]:5", "tcp://10.0.0.1:8998", "trailing.dot.:2"])
def test_good_bootstrap_addresses_are_kept(addr):
    assert cfg(bootstrap=addr).resolved().bootstrap == addr


@pytest.mark.parametrize("host, kept", [("127.0.0.1", "127.0.0.1"), ("::1", "::1"), ("[::1]", "::1"),
                                        ("node-7", "node-7")])
def test_good_hosts_are_kept_ipv6_without_brackets(host, kept):
    assert cfg(host=host).resolved().host == kept


def test_a_bad_bootstrap_host_says_what_is_wrong():
    with pytest.raises(ValueError, match=r"bootstrap='bad host!:8998': the host 'bad host!' is not a host name"):
        cfg(bootstrap="bad host!:8998").resolved()
    with pytest.raises(ValueError, match=r"an IPv6 address goes in brackets, e\.g\. '\[::1\]:8998'"):
        cfg(bootstrap="::1:8998").resolved()


@pytest.mark.parametrize("kernels, staging, match", [
    ("bogus", False, "KVSTAGE_STAGING_KERNELS='bogus': expected one of"),
    ("bogus", True, "KVSTAGE_STAGING_KERNELS='bogus': expected one of"),
    ("triton", True, "KVSTAGE_STAGING_KERNELS=triton needs a CUDA KV cache"),
])
def test_kv_manager_checks_the_kernel_choice_before_creating_anything(monkeypatch, kernels, staging, match):
    """Before any socket or backend exists (a bootstrap at port 9 is never contacted)."""
    import torch

    from kvstage.staging import kernels as kernels_module
    from kvstage.transfer import KVBuffers, KVLayout, KVManager
    from kvstage.transfer.engine import manager
    monkeypatch.setenv("KVSTAGE_STAGING_KERNELS", kernels)
    # the CPU interpreter the test session runs under would make triton acceptable on the CPU
    monkeypatch.setattr(kernels_module, "_triton_module", lambda device, required: _Compiled())
    monkeypatch.setattr(manager, "create_backend", lambda *a, **k: pytest.fail("a backend was created"))
    layout = KVLayout(num_layers=1, total_kv_heads=1, head_dim=8, dtype=torch.float32, page_size=4, tp_size=1,
                      tp_rank=0)
    for role in ("prefill", "decode"):
        with pytest.raises(ValueError, match=match):
            KVManager(cfg(role=role, staging=staging), layout, KVBuffers([torch.zeros(16, 1, 8)], [torch.zeros(16, 1, 8)]))


def test_torch_kernels_on_a_staged_cpu_rank_pass_the_check(monkeypatch):
    import torch

    from kvstage.transfer import KVBuffers, KVLayout
    from kvstage.transfer.engine.manager import check_kernels
    layout = KVLayout(num_layers=1, total_kv_heads=1, head_dim=8, dtype=torch.float32, page_size=4, tp_size=1,
                      tp_rank=0)
    buffers = KVBuffers([torch.zeros(16, 1, 8)], [torch.zeros(16, 1, 8)]).validate(layout)
    for value in ("torch", "auto", ""):
        monkeypatch.setenv("KVSTAGE_STAGING_KERNELS", value)
        check_kernels(cfg(staging=True).resolved(), layout, buffers)   # raises on a wrong verdict


class _Compiled:
    """Stands in for the Triton kernels module as it is on a machine without the interpreter."""

    @staticmethod
    def interpreted() -> bool:
        return False


@pytest.mark.parametrize("option, env", [("credits", "CREDITS_ENV"), ("copy_streams", "COPY_STREAMS_ENV")])
def test_on_by_default_flags_turn_off_by_option_then_variable(monkeypatch, option, env):
    """Ring credits (on since their finding of 2026-11-27 was fixed: docs/protocol.md, "Ring
    credits") and each copying thread on a CUDA stream of its own (staging/copy_streams.py): on
    unless the option, then its variable, turns them off; a word that is not a flag is refused."""
    from kvstage.transfer import config

    name = getattr(config, env)
    monkeypatch.delenv(name, raising=False)
    assert getattr(cfg().resolved(), option) is True
    assert getattr(cfg(**{option: False}).resolved(), option) is False
    monkeypatch.setenv(name, "0")
    assert getattr(cfg().resolved(), option) is False
    assert getattr(cfg(**{option: True}).resolved(), option) is True
    with pytest.raises(ValueError, match=option):
        cfg(**{option: "sometimes"}).resolved()


def test_the_core_reads_its_own_variables_not_sglangs(monkeypatch):
    """KVSTAGE_STAGING and KVSTAGE_RING_MB set what SGLang's variables set before; SGLang's, even
    bad values, change nothing (adapters/sglang/plugin.py maps them onto EngineConfig's arguments)."""
    monkeypatch.setenv("SGLANG_DISAGG_STAGING_BUFFER", "1")
    monkeypatch.setenv("SGLANG_DISAGG_STAGING_POOL_SIZE_MB", "16")
    r = cfg().resolved()
    assert (r.staging, r.ring_mb) == (False, 256.0)
    monkeypatch.setenv("SGLANG_DISAGG_STAGING_POOL_SIZE_MB", "nan")
    assert cfg().resolved().ring_mb == 256.0
    monkeypatch.setenv("KVSTAGE_STAGING", "1")
    monkeypatch.setenv("KVSTAGE_RING_MB", "16")
    r = cfg().resolved()
    assert (r.staging, r.ring_mb) == (True, 16.0)
    with pytest.raises(ValueError, match=r"staging on \(KVSTAGE_STAGING / EngineConfig.staging\)"):
        cfg(staging=False, path="staged").resolved()


# the fields of the resolved configuration where None is a value of its own, not "unset"
NONE_MEANS = {"auth_token": "no shared secret", "faults": "no injected faults", "metrics_port": "no metrics server"}


def test_the_resolved_configuration_has_a_value_in_every_field():
    """Frozen and keyword-only; None only where it is a value (NONE_MEANS), each other field of
    EngineConfig resolved to a concrete type: the engine never asks "was this given?"."""
    hints = typing.get_type_hints(ResolvedConfig)
    optional = {name for name, hint in hints.items()
                if isinstance(hint, types.UnionType) and type(None) in typing.get_args(hint)}
    assert optional == set(NONE_MEANS)
    assert {f.name for f in dataclasses.fields(ResolvedConfig)} == {f.name for f in dataclasses.fields(EngineConfig)}
    params = ResolvedConfig.__dataclass_params__
    assert params.frozen and all(f.kw_only for f in dataclasses.fields(ResolvedConfig))
    r = cfg(role="decode").resolved()
    assert isinstance(r, ResolvedConfig) and r.role is Role.DECODE and r.path is PathMode.AUTO
    for name, hint in hints.items():
        if name not in NONE_MEANS:
            assert isinstance(getattr(r, name), typing.get_origin(hint) or hint), name
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.staging = True


def test_lease_mode_from_the_option_or_the_environment(monkeypatch):
    from kvstage.transfer.config import LEASES_ENV
    from kvstage.transfer.protocol.engine_leases import LeaseMode
    from kvstage.transfer.timeouts import Timeouts
    monkeypatch.delenv(LEASES_ENV, raising=False)
    assert cfg().resolved().leases is LeaseMode.RANK                  # the default: rank-pair leases
    monkeypatch.setenv(LEASES_ENV, "Engine")
    assert cfg().resolved().leases is LeaseMode.ENGINE
    assert cfg(leases="rank").resolved().leases is LeaseMode.RANK     # the argument wins
    monkeypatch.setenv(LEASES_ENV, "ranks")
    with pytest.raises(ValueError, match=LEASES_ENV):
        cfg().resolved()
    with pytest.raises(ValueError, match="leases='pair'"):
        cfg(leases="pair").resolved()
    # engine-pair beats must fit in the lease: heartbeat <= lease / 8, said in the options' names
    with pytest.raises(ValueError, match="timeouts.heartbeat <= timeouts.lease / 8"):
        cfg(leases="engine", timeouts=Timeouts(heartbeat=1.0, lease=6.0)).resolved()
    assert cfg(leases="engine", timeouts=Timeouts(heartbeat=0.25, lease=2.0)).resolved().leases is LeaseMode.ENGINE
