"""What the plugin changes in SGLang, all through its public plugin hooks (no patch of files):

- `kvstage` becomes a valid ``--disaggregation-transfer-backend`` choice and a member of
  SGLang's TransferBackend enum (added to the existing enum, so every module that already
  imported it sees the member);
- get_kv_class returns the classes of `conn.py` for it (an AROUND hook; other backends pass);
- SGLANG_DISAGG_STAGING_BUFFER, which SGLang refuses for any backend but mooncake and nixl and
  which would also switch on SGLang's own staging machinery, is taken over for backend kvstage
  before SGLang validates its arguments: it becomes KVSTAGE_SGLANG_STAGING, read by this adapter;
- KV cache sharding (`--enable-kv-cache-sharding`), which SGLang's check accepts for mooncake and
  nixl only, is checked for backend kvstage as for mooncake (a wrapper of that resolution step,
  registered through SGLang's `register_resolution_hook`), and so is a DSA model's
  `--enable-dsa-cache-layer-split` (mooncake only; a wrapper of the model-specific step);
- decode context parallel, which SGLang's argument check accepts on a decode only for the
  backends it lists (mooncake, nixl, mori, ascend, fake), is checked for backend kvstage as for
  nixl, and `--disaggregation-decode-allocation-policy prefill_complete`, which it accepts for
  mooncake only, as for mooncake: every other check of that function runs as it would (an
  AROUND hook on handle_pd_disaggregation, which also takes the staging flag over first);
- the request's token count, which SGLang's sender and receiver interfaces do not carry and
  kvstage needs under decode context parallel, is handed to kvstage's sender and receiver by
  BEFORE hooks on the two queue methods that start them (PrefillBootstrapQueue.finalize_bootstrap
  before the sender's init(), DecodePreallocQueue._send_kv_metadata before the receiver's
  send_metadata()); a sender or receiver of another backend is left alone.

kvstage's core reads only KVSTAGE_* variables (transfer/config.py). SGLang's names for its knobs
are read here and passed to EngineConfig as arguments (`engine_options`): the staging switch
(SGLANG_DISAGG_STAGING_BUFFER, or KVSTAGE_SGLANG_STAGING once moved) as `staging`, the decode
ring's size (SGLANG_DISAGG_STAGING_POOL_SIZE_MB) as `ring_mb`. One that is unset is left to the
core (KVSTAGE_STAGING, KVSTAGE_RING_MB, else the default).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from . import BACKEND

STAGING_ENV = "KVSTAGE_SGLANG_STAGING"
SGLANG_STAGING_ENV = "SGLANG_DISAGG_STAGING_BUFFER"
SGLANG_RING_MB_ENV = "SGLANG_DISAGG_STAGING_POOL_SIZE_MB"
_TRUE = ("1", "true", "yes", "y", "on")


def install() -> None:
    from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES, add_disagg_transfer_backend_choices
    from sglang.srt.disaggregation.utils import TransferBackend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if BACKEND not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([BACKEND])
    add_enum_member(TransferBackend, "KVSTAGE", BACKEND)
    HookRegistry.register("sglang.srt.disaggregation.utils.get_kv_class", around_get_kv_class, HookType.AROUND)
    HookRegistry.register("sglang.srt.arg_groups.pd_disaggregation_hook.handle_pd_disaggregation",
                          around_pd_checks, HookType.AROUND)
    HookRegistry.register("sglang.srt.disaggregation.prefill.PrefillBootstrapQueue.finalize_bootstrap",
                          tell_prefill_tokens, HookType.BEFORE)
    HookRegistry.register("sglang.srt.disaggregation.decode.DecodePreallocQueue._send_kv_metadata",
                          tell_decode_tokens, HookType.BEFORE)
    # SGLang's own mechanism for wrapping a step of its argument resolution (the pipeline calls
    # this step by a name it imported early, which HookRegistry's patch would not reach)
    from sglang.srt.arg_groups import resolution_hooks
    for step, hook in ((KV_SHARD_STEP, around_kv_shard_checks), (MODEL_STEP, around_model_adjustments)):
        if hook not in resolution_hooks._HOOKS.get(step, []):
            resolution_hooks.register_resolution_hook(step)(hook)


def add_enum_member(enum_cls, name: str, value: str) -> None:
    """Add `name` = `value` to an existing Enum class in place (idempotent)."""
    if value in enum_cls._value2member_map_:
        return
    member = object.__new__(enum_cls)
    member._name_, member._value_ = name, value
    type.__setattr__(enum_cls, name, member)
    enum_cls._member_map_[name] = member
    enum_cls._value2member_map_[value] = member
    enum_cls._member_names_.append(name)


def is_kvstage(transfer_backend) -> bool:
    return getattr(transfer_backend, "value", transfer_backend) == BACKEND


def around_get_kv_class(original, transfer_backend, class_type):
    from sglang.srt.disaggregation.utils import KVClassType
    if not is_kvstage(transfer_backend) or class_type == KVClassType.KVARGS:
        return original(transfer_backend, class_type)
    from . import conn
    return {KVClassType.MANAGER: conn.KvstageKVManager, KVClassType.SENDER: conn.KvstageKVSender,
            KVClassType.RECEIVER: conn.KvstageKVReceiver,
            KVClassType.BOOTSTRAP_SERVER: conn.KvstageKVBootstrapServer}[class_type]


def tell_prefill_tokens(queue, req, *args, **kwargs):
    """Before SGLang's prefill starts a request's sender (finalize_bootstrap): the request's
    token count, what SGLang counts its pages by (len(origin_input_ids)), for kvstage's sender."""
    sender = getattr(req, "disagg_kv_sender", None)
    if hasattr(sender, "request_tokens"):
        sender.request_tokens = len(req.origin_input_ids)
    return None


def tell_decode_tokens(queue, decode_req, *args, **kwargs):
    """Before SGLang's decode sends a request's metadata (_send_kv_metadata): the tokens the
    prefill computes for it, as SGLang's decode allocates them (its _rebootstrap_prefill_len:
    the prompt, plus the outputs for a request bootstrapped again), for kvstage's receiver."""
    receiver = getattr(decode_req, "kv_receiver", None)
    if hasattr(receiver, "request_tokens"):
        req = decode_req.req
        length = getattr(type(queue), "_rebootstrap_prefill_len", None)
        receiver.request_tokens = int(length(req)) if length is not None else len(req.origin_input_ids)
    return None


#: a backend whose decode DCP SGLang's argument check accepts, and whose checks are otherwise
#: those of any backend but mooncake (SGLang 0.5.23's handle_pd_disaggregation)
DCP_CHECKED_AS = "nixl"
#: the one backend SGLang's argument check accepts the prefill_complete allocation policy for
#: (its _validate_prefill_complete; it also accepts decode DCP)
PREFILL_COMPLETE_CHECKED_AS = "mooncake"


def checked_as(server_args) -> str | None:
    """The backend SGLang's PD argument check should see for backend kvstage: mooncake under the
    prefill_complete allocation policy, nixl on a decode with decode context parallel, None
    (kvstage itself) otherwise or for any other backend."""
    if not is_kvstage(getattr(server_args, "disaggregation_transfer_backend", None)):
        return None
    if getattr(server_args, "disaggregation_decode_allocation_policy", "early") == "prefill_complete":
        return PREFILL_COMPLETE_CHECKED_AS
    mode = getattr(server_args, "disaggregation_mode", None)
    if str(getattr(mode, "value", mode)) == "decode" and int(getattr(server_args, "dcp_size", 1) or 1) > 1:
        return DCP_CHECKED_AS
    return None


def around_pd_checks(original, server_args, *args, **kwargs):
    """SGLang's PD argument check (handle_pd_disaggregation), for backend kvstage: the staging
    flag taken over first (`take_staging_flag`); under the prefill_complete allocation policy, or
    on a decode with decode context parallel (dcp_size above 1), the check runs with the backend
    resolved as the one SGLang accepts that for (`checked_as`), and resolved as the operator's
    kvstage again afterwards, whatever the check did (both through SGLang's declare_resolution:
    resolution never writes the operator's input, and the last declaration wins). Every other
    check of the function runs as written: prefill_complete keeps SGLang's own limits (attention
    TP 1, no CP or PP, no staging buffer, ...). kvstage's own refusals of a DCP rank it does not
    serve come later, when its manager starts (geometry.dcp_problems). Any other backend, or
    neither feature: the check as SGLang wrote it."""
    take_staging_flag(server_args)
    backend = checked_as(server_args)
    if backend is None:
        return original(server_args, *args, **kwargs)
    with resolved_as(server_args, backend, "kvstage plugin: a PD feature SGLang checks per backend"):
        return original(server_args, *args, **kwargs)


@contextmanager
def resolved_as(server_args, backend: str, source: str) -> Iterator[None]:
    """Within it, SGLang's resolution sees the transfer backend as `backend`; as kvstage again
    afterwards, whatever the step did (both through SGLang's declare_resolution: resolution never
    writes the operator's input, and the last declaration wins)."""
    from sglang.srt.arg_groups.overrides import declare_resolution

    declare_resolution(server_args, source, disaggregation_transfer_backend=backend)
    try:
        yield
    finally:
        declare_resolution(server_args, source, disaggregation_transfer_backend=BACKEND)


#: SGLang's resolution step that validates KV cache sharding, and the backend it is checked as
#: for backend kvstage: one of the two it accepts (mooncake, nixl), and the one whose further
#: checks (DSA sharding needs mooncake) leave kvstage's own refusals to name what it does not move
KV_SHARD_STEP = "handle_kv_cache_sharding"
KV_SHARD_CHECKED_AS = "mooncake"


def around_kv_shard_checks(server_args, previous) -> None:
    """SGLang's KV cache sharding check (handle_kv_cache_sharding), for backend kvstage: run with
    the backend resolved as KV_SHARD_CHECKED_AS, and as kvstage again afterwards (SGLang's
    declare_resolution), so its list of backends that route sends through its common sender
    accepts kvstage, which takes SGLang's logical page ids itself (docs/protocol.md, "KV page
    sharding"). Every other check of it stands (the attention backend, MLA over the whole
    attention TP group or GQA over prefill CP, ...); kvstage's manager refuses at start what it
    does not move (geometry.shard_problems). Any other backend: the check as SGLang wrote it."""
    if not is_kvstage(getattr(server_args, "disaggregation_transfer_backend", None)):
        previous(server_args)
        return
    with resolved_as(server_args, KV_SHARD_CHECKED_AS, "kvstage plugin: KV cache sharding"):
        previous(server_args)


#: SGLang's resolution step of model-specific checks, where a DSA model's
#: --enable-dsa-cache-layer-split is accepted for the mooncake backend only
MODEL_STEP = "handle_model_specific_adjustments"
LAYER_SPLIT_CHECKED_AS = "mooncake"


def around_model_adjustments(server_args, previous) -> None:
    """SGLang's model-specific step (handle_model_specific_adjustments), for backend kvstage with
    DSA cache layer split on: run with the backend resolved as LAYER_SPLIT_CHECKED_AS, the one
    backend its layer-split check names (the step reads the backend nowhere else), and as kvstage
    again afterwards (SGLang's declare_resolution); kvstage serves the split's CP ranks as stages
    of their own layers (geometry.layer_split). Its other checks of the feature stand (a DSA model,
    prefill CP with the interleave strategy, a prefill worker, no PP). Otherwise: the step as
    SGLang wrote it."""
    if not (is_kvstage(getattr(server_args, "disaggregation_transfer_backend", None))
            and getattr(server_args, "enable_dsa_cache_layer_split", False)):
        previous(server_args)
        return
    with resolved_as(server_args, LAYER_SPLIT_CHECKED_AS, "kvstage plugin: DSA cache layer split"):
        previous(server_args)


def take_staging_flag(server_args, *args, **kwargs):
    """Before SGLang validates PD flags: for backend kvstage, move the staging switch to
    kvstage's own variable (inherited by the scheduler processes started after this)."""
    if is_kvstage(getattr(server_args, "disaggregation_transfer_backend", None)):
        flag = os.environ.pop(SGLANG_STAGING_ENV, None)
        if flag is not None:
            os.environ[STAGING_ENV] = "1" if flag.strip().lower() in _TRUE else "0"
    return None


def staging_flag() -> bool | None:
    """kvstage's staged path as SGLang's flag says: KVSTAGE_SGLANG_STAGING (where
    take_staging_flag moved it), else SGLANG_DISAGG_STAGING_BUFFER itself (processes that never
    went through SGLang's argument handling, e.g. tests). On for 1/true/yes/y/on (any case), off
    for any other value, as SGLang reads its flag; None when neither is set or both are empty."""
    flag = os.environ.get(STAGING_ENV) or os.environ.get(SGLANG_STAGING_ENV) or ""
    if not flag.strip():
        return None
    return flag.strip().lower() in _TRUE


def ring_mb() -> float | None:
    """The decode ring's size in MB from SGLANG_DISAGG_STAGING_POOL_SIZE_MB, checked as
    EngineConfig.ring_mb is (a finite number in (0, 1048576]; a bad value is a ValueError naming
    the variable); None when unset or empty."""
    from kvstage.transfer import config_values as check
    from kvstage.transfer.config import MAX_MB

    def size(name: str, value: object) -> float:
        return check.positive(name, value, MAX_MB)
    return check.from_env(SGLANG_RING_MB_ENV, None, float, size)


def engine_options() -> dict[str, object]:
    """SGLang's variables as EngineConfig arguments (`staging`, `ring_mb`), only those set: an
    unset one is left to kvstage's own variable or default."""
    options: dict[str, object] = {"staging": staging_flag(), "ring_mb": ring_mb()}
    return {k: v for k, v in options.items() if v is not None}
