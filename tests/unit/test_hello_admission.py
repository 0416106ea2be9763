"""A prefill rank's verdict on a decode rank's Hello (transfer/protocol/hello_admission.py): pure,
one reason per difference, and the decode rank's PP stage."""

from __future__ import annotations

import msgspec
import pytest
import torch

from kvstage.transfer.layout import KVLayout
from kvstage.transfer.pool_spec import PoolSpec
from kvstage.transfer.protocol.hello_admission import PrefillFacts, admit_hello
from kvstage.transfer.protocol.messages import Hello, KVMemory, PoolMemory, RingInfo

LAYOUT = KVLayout(num_layers=4, total_kv_heads=8, head_dim=64, dtype=torch.bfloat16, page_size=16, tp_size=2, tp_rank=0)
POOL = PoolSpec(name="aux", sharding="replicated", heads=0, dtypes=["int32"], rows=[[8]])


def facts(**kw) -> PrefillFacts:
    base = dict(summary=LAYOUT.summary(), tp_size=2, total_kv_heads=8, mla=False, num_layers=4, stage=range(4),
                verify=False, backend="nixl", memory_kinds=("DRAM",))
    return PrefillFacts(**(base | kw))


def hello(**kw) -> Hello:
    kv = KVMemory(k_addrs=[1, 2, 3, 4], v_addrs=[5, 6, 7, 8], num_pages=10, page_stride=8192, token_stride=512)
    base = dict(src=7, engine_id="d", role="decode", tp_size=4, tp_rank=1, ctrl_endpoint="tcp://h:1", backend="nixl",
                backend_identity=b"md", layout=LAYOUT.summary(), kv=kv, ring=RingInfo(addr=99, size=1 << 20, epoch=5),
                staging=True)
    return Hello(**(base | kw))


def test_a_matching_decode_rank_is_admitted_with_no_stage():
    adm = admit_hello(hello(), facts())
    assert adm.ok and adm.problems == () and adm.stage is None


@pytest.mark.parametrize(("msg_kw", "facts_kw", "words"), [
    ({"verify": True}, {}, "verify: off here vs on at peer"),
    ({"backend": "mooncake"}, {}, "backend: 'nixl' here vs 'mooncake' at peer"),
    ({"layout": KVLayout(num_layers=4, total_kv_heads=8, head_dim=64, dtype=torch.float16, page_size=16, tp_size=4,
                         tp_rank=1).summary()}, {}, "dtype"),
    ({"ring": RingInfo(addr=99, size=1 << 20, epoch=5, mem_kind="VRAM")}, {},
     "the peer's staging ring region is VRAM memory, which this nixl build cannot write into"),
    ({"pp_size": 2, "stage_start": 2, "stage_stop": 9}, {}, "which is not a stage of this model's 4 layers"),
], ids=["verify", "backend", "layout", "ring-kind", "stage"])
def test_each_difference_is_one_named_reason(msg_kw, facts_kw, words):
    adm = admit_hello(hello(**msg_kw), facts(**facts_kw))
    assert not adm.ok and len(adm.problems) == 1 and words in adm.problems[0], adm.problems


def test_every_reason_is_told_at_once_and_a_pool_kind_is_named():
    kv = KVMemory(k_addrs=[1], v_addrs=[2], num_pages=10, page_stride=8192, token_stride=512,
                  pools=[PoolMemory(name="aux", addrs=[3], item_strides=[32], head_strides=[0], mem_kind="VRAM")])
    adm = admit_hello(hello(verify=True, backend="mooncake", kv=kv), facts())
    assert [p.split(":")[0] for p in adm.problems] == ["verify", "backend", "the peer's pool 'aux' region is VRAM memory, "
                                                       "which this nixl build cannot write into (it handles DRAM)"]


def test_a_decode_stage_is_read_from_the_hello():
    adm = admit_hello(hello(pp_size=2, tp_size=2, tp_rank=3, stage_start=2, stage_stop=4), facts())
    assert adm.ok and adm.stage is not None and (adm.stage.pp_rank, adm.stage.layers) == (1, range(2, 4))


def test_pools_must_match_before_they_are_weighed():
    with_pool = msgspec.structs.replace(LAYOUT.summary(), pools=[POOL])
    assert "pool 'aux': registered here only" in admit_hello(hello(), facts(summary=with_pool)).problems[0]
    assert admit_hello(hello(layout=with_pool), facts(summary=with_pool)).ok


def test_pools_of_one_layer_are_compared_over_the_layers_both_stages_hold():
    """A prefill stage of layers [0, 2) registers the pools of its layers; a decode rank of no PP
    registers every layer's. Admitted; a decode stage of layers [2, 4) needs none of the
    stage's pools and is admitted too; a decode rank without the pool of layer 1 is not."""
    m = {n: PoolSpec(name=f"m{n}", sharding="replicated", heads=0, dtypes=["int32"], rows=[[8]], layer=n)
         for n in range(4)}
    stage0 = msgspec.structs.replace(LAYOUT.summary(), pools=[m[0], m[1]])
    prefill = facts(summary=stage0, stage=range(0, 2))
    assert admit_hello(hello(layout=msgspec.structs.replace(stage0, pools=list(m.values()))), prefill).ok
    upper = msgspec.structs.replace(stage0, pools=[m[2], m[3]])
    assert admit_hello(hello(layout=upper, pp_size=2, tp_size=2, tp_rank=3, stage_start=2, stage_stop=4), prefill).ok
    (why,) = admit_hello(hello(layout=msgspec.structs.replace(stage0, pools=[m[0], m[2], m[3]])), prefill).problems
    assert why == "pool 'm1': registered here only", why
