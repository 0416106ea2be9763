"""The vLLM connector's scheduler-side decisions (adapters/vllm/plan.py, params.py), pure: no
vLLM needed. What the prefill returns to the client, which pages each side moves (the decode's
local prefix skipped), blocks held until the transfer ends, aborts reaching the other side,
and bad parameters refused naming the key."""

from __future__ import annotations

import pytest

from kvstage.adapters.vllm.params import RENDEZVOUS, ROOM, ConnectorSettings, remote_prefill
from kvstage.adapters.vllm.plan import PrefillIdentity, SchedulerPlan

IDENT = PrefillIdentity(rendezvous="10.0.0.1:18998", dp_rank=0, engine="vllm-prefill@10.0.0.1:18998", tp_size=2)


def prefill_plan():
    return SchedulerPlan(is_prefill=True, block_size=32, identity=IDENT, new_room=iter([7, 8, 9]).__next__)


def test_prefill_holds_blocks_and_returns_where_the_kv_is():
    plan = prefill_plan()
    delay, params = plan.finished("a", 70, {"do_remote_decode": True}, [4, 9, 2, 11], completed=True)
    assert delay is True
    assert params == {"do_remote_prefill": True, "do_remote_decode": False, ROOM: 7, RENDEZVOUS: "10.0.0.1:18998",
                      "kvstage_dp_rank": 0, "kvstage_engine": "vllm-prefill@10.0.0.1:18998", "kvstage_tp_size": 2}
    orders = plan.take_orders()
    assert [(o.req_id, o.room, o.pages) for o in orders.sends] == [("a", 7, (4, 9, 2))]   # 70 tokens: 3 pages
    assert not plan.take_orders() and plan.in_flight == 1
    plan.sent({"a"})
    assert plan.in_flight == 0


def test_prefill_without_decode_or_aborted_frees_at_once():
    plan = prefill_plan()
    assert plan.finished("a", 70, None, [1, 2, 3], completed=True) == (False, None)
    assert plan.finished("b", 70, {"do_remote_decode": True}, [1, 2, 3], completed=False) == (False, None)
    assert not plan.take_orders()


def decode_params(room=7):
    return {"do_remote_prefill": True, ROOM: room, RENDEZVOUS: "10.0.0.1:18998", "kvstage_dp_rank": 0}


def test_decode_loads_every_prompt_token_past_its_prefix_once():
    plan = SchedulerPlan(is_prefill=False, block_size=32)
    params = decode_params()
    assert plan.matched_tokens("r", 70, params, 32) == (38, True)
    plan.allocated("r", 70, params, [5, 6, 7, 8], 38)
    (o,) = plan.take_orders().recvs
    assert (o.pages, o.prefix_pages, o.source.room) == ((6, 7), 1, 7)
    plan.allocated("r", 70, params, [5, 6, 7, 8], 38)       # vLLM's second call after the load
    assert not plan.take_orders()
    plan.received({"r"})
    assert plan.finished("r", 70, params, [5, 6, 7], completed=True) == (False, None)


def test_decode_abort_reaches_the_prefill_and_holds_blocks_until_released():
    plan = SchedulerPlan(is_prefill=False, block_size=32)
    params = decode_params()
    plan.matched_tokens("r", 70, params, 0)
    plan.allocated("r", 70, params, [5, 6, 7], 70)
    plan.take_orders()
    assert plan.finished("r", 70, params, [5, 6, 7], completed=False) == (True, None)
    (a,) = plan.take_orders().aborts
    assert a.req_id == "r" and a.source is None
    # a request that ended before it had blocks: an abort naming the prefill's room
    fresh = decode_params(room=9)
    plan.matched_tokens("s", 70, fresh, 0)
    assert plan.finished("s", 70, fresh, [], completed=False) == (False, None)
    (b,) = plan.take_orders().aborts
    assert b.source.room == 9 and b.source.rendezvous == "10.0.0.1:18998"


def test_bad_params_and_settings_are_refused_naming_the_key():
    with pytest.raises(ValueError, match="lacks kvstage_room"):
        remote_prefill({"do_remote_prefill": True, RENDEZVOUS: "h:1"})
    with pytest.raises(ValueError, match="kvstage_rendezvous must be 'host:port'"):
        remote_prefill({"do_remote_prefill": True, ROOM: 1, RENDEZVOUS: "nohost"})
    with pytest.raises(ValueError, match=r"kvstage_room must be an int in \[0, 2\*\*64\)"):
        remote_prefill({"do_remote_prefill": True, ROOM: -1, RENDEZVOUS: "h:1"})
    with pytest.raises(ValueError, match="rendezvous_port must be a port number"):
        ConnectorSettings.parse({}, "127.0.0.1")
    with pytest.raises(ValueError, match="unknown key"):
        ConnectorSettings.parse({"rendezvous_port": 1, "stagin": True}, "127.0.0.1")
    with pytest.raises(ValueError, match="backend must be one of nixl, mooncake"):
        ConnectorSettings.parse({"rendezvous_port": 1, "backend": "ucx"}, "127.0.0.1")
    s = ConnectorSettings.parse({"rendezvous_port": 18998}, "::1")
    assert s.rendezvous == "[::1]:18998"
