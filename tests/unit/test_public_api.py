"""The public API keeps the call forms its docs show (issue 54), and an old form that changed
keeps working for a release with a DeprecationWarning (docs/api.md, "API stability").

Each documented form is bound against the real signature (`inspect.signature(...).bind`), so a
codemod that makes an argument keyword-only, renames or reorders it fails here."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch

import kvstage
from kvstage import DraftKV, EngineConfig, KVBuffers, KVLayout, KVManager, KVReceiver, KVSender, StatePool, Timeouts

# (callable, positional arguments, keyword arguments) as README.md and docs/ write them
DOCUMENTED_FORMS = [
    (StatePool, ("tensors",), {"sharding": "heads", "heads": 8, "blocks": [2, 2], "own_writes": True}),
    (KVBuffers, ("k", "v"), {"pools": {}, "draft_k": [], "draft_v": []}),
    (KVBuffers.from_pointers, ("layout", "data_ptrs", "data_lens", "item_lens"), {"device": "cpu"}),
    (KVManager, ("config", "layout", "buffers"), {}),
    (KVManager.sender, ("self", 42), {"num_pages": 4, "pool_items": {}}),
    (KVManager.receiver, ("self", 42, "prefill-0"), {}),
    (KVManager.receiver, ("self", 42), {"bootstrap": "h:1", "prefill_dp_rank": 0}),
    (KVSender.init, ("self", 4), {"pool_items": {}}),
    (KVSender.send, ("self", [0, 1]), {"last": True, "layers": range(0, 4), "ready": None, "pool_items": {}}),
    (KVReceiver.init, ("self", [0, 1]), {"prefix_pages": 1, "pool_items": {}}),
    (KVReceiver.wait, ("self",), {"timeout": 30}),
    (KVLayout, (), {"num_layers": 2, "total_kv_heads": 8, "head_dim": 64, "dtype": torch.bfloat16,
                    "page_size": 16, "tp_size": 2, "tp_rank": 0, "mla": False, "pp_size": 1, "pp_rank": 0,
                    "stage": None, "draft": None}),
    (EngineConfig, (), {"role": "prefill", "engine_id": "p", "bootstrap": "h:1", "backend": "nixl", "host": "h",
                        "metrics_port": 0, "dp_rank": 0, "layer_group": 4, "verify": False}),
    (DraftKV, (), {"num_layers": 1, "total_kv_heads": 2, "head_dim": 64}),
]


@pytest.mark.parametrize("func,args,kwargs", DOCUMENTED_FORMS,
                         ids=[f"{f.__qualname__}{len(a)}" for f, a, _ in DOCUMENTED_FORMS])
def test_documented_forms_bind(func, args, kwargs):
    inspect.signature(func).bind(*args, **kwargs)


def test_the_public_names_are_exported():
    for name in ("KVLayout", "KVBuffers", "DraftKV", "EngineConfig", "Timeouts", "KVManager", "KVSender",
                 "KVReceiver", "KVPoll", "KVTransferError", "TransferMetrics", "StatePool"):
        assert getattr(kvstage, name) is getattr(kvstage.transfer, name)


def test_state_pool_takes_its_tensors_by_position_and_its_options_by_keyword():
    t = [torch.zeros(4, 1, dtype=torch.int32)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert StatePool(t).tensors is t and StatePool(tensors=t).tensors is t
    with pytest.raises(TypeError):
        StatePool(t, "heads")


OLD_POSITIONAL = [
    (KVLayout, (4, 8, 64, torch.bfloat16, 16, 2, 1, False),
     {"num_layers": 4, "total_kv_heads": 8, "head_dim": 64, "dtype": torch.bfloat16, "page_size": 16,
      "tp_size": 2, "tp_rank": 1, "mla": False}),
    (EngineConfig, ("decode", "d0", "h:1", "mooncake"),
     {"role": "decode", "engine_id": "d0", "bootstrap": "h:1", "backend": "mooncake"}),
    (Timeouts, (5.0, 2.0), {"bootstrap": 5.0, "connect": 2.0}),
]


@pytest.mark.parametrize("cls,args,kwargs", OLD_POSITIONAL, ids=[c.__name__ for c, _, _ in OLD_POSITIONAL])
def test_the_old_positional_forms_still_work_with_a_deprecation_warning(cls, args, kwargs):
    with pytest.warns(DeprecationWarning, match=f"{cls.__name__}: passing .* by position is deprecated"):
        old = cls(*args)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cls(**kwargs) == old


@pytest.mark.parametrize("cls,args,kwargs", OLD_POSITIONAL, ids=[c.__name__ for c, _, _ in OLD_POSITIONAL])
def test_an_argument_given_both_ways_or_too_many_is_a_type_error(cls, args, kwargs):
    first = next(iter(kwargs))
    with pytest.raises(TypeError, match=f"multiple values for argument '{first}'"):
        cls(*args, **{first: kwargs[first]})
    with pytest.raises(TypeError, match="positional arguments"):
        cls(*args, *([0] * 40))
