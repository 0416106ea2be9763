"""The vLLM connector's scheduler-side decisions (adapters/vllm/plan.py, params.py), pure: no
vLLM needed. What the prefill returns to the client, which pages each side moves (the decode's
local prefix skipped), blocks held until the transfer ends, aborts reaching the other side,
layer-wise streaming (which pages each step gives, a room per run of a preempted request), and
bad parameters refused naming the key."""

from __future__ import annotations

import pytest

from kvstage.adapters.vllm.params import RENDEZVOUS, ROOM, ConnectorSettings, remote_prefill
from kvstage.adapters.vllm.plan import PrefillIdentity, Scheduled, SchedulerPlan

IDENT = PrefillIdentity(rendezvous="10.0.0.1:18998", dp_rank=0, engine="vllm-prefill@10.0.0.1:18998", tp_size=2)


def prefill_plan(layerwise=True):
    return SchedulerPlan(is_prefill=True, block_size=32, identity=IDENT, new_room=iter([7, 8, 9]).__next__,
                         layerwise=layerwise)


BLOCKS = {"a": [4, 9, 2, 11], "b": [6, 1, 3]}


def streams(plan, preempted=(), **scheduled):
    """One step of the listed requests ({req: (computed, count)}): its stream orders as tuples."""
    plan.step({r: Scheduled(computed=c, count=n) for r, (c, n) in scheduled.items() if plan.streams(r)},
              lambda r: BLOCKS[r], preempted)
    orders = plan.take_orders()
    return ([(o.req_id, o.room, o.num_pages, o.open, o.before, o.pages) for o in orders.streams],
            [(d.req_id, d.room) for d in orders.drops])


def test_prefill_streams_each_page_from_the_step_that_completes_it():
    plan = prefill_plan()
    params = {"do_remote_decode": True}
    plan.allocated("a", 70, params, BLOCKS["a"], 0)
    assert plan.streams("a")
    # 20 tokens end inside page 0: the sender opens, no page is complete yet
    assert streams(plan, a=(0, 20)) == ([("a", 7, 3, True, (), ())], [])
    assert streams(plan, a=(20, 28)) == ([("a", 7, 3, False, (), (4,))], [])     # tokens 20-48: page 0
    assert streams(plan, a=(48, 22)) == ([("a", 7, 3, False, (), (9, 2))], [])   # the prompt's end: pages 1, 2
    assert streams(plan, a=(70, 1)) == ([], [])                                 # decoding: nothing more
    delay, out = plan.finished("a", 70, params, BLOCKS["a"], completed=True)
    assert delay is True and out[ROOM] == 7 and out["do_remote_prefill"] is True
    assert not plan.take_orders() and plan.in_flight == 1      # no chunk-wise SendOrder: it streamed
    plan.sent({"a"})
    assert plan.in_flight == 0


def test_prefill_prefix_hit_pages_go_at_once_and_preemption_opens_a_new_room():
    plan = prefill_plan()
    plan.allocated("b", 70, {"do_remote_decode": True}, BLOCKS["b"], 0)
    # 64 tokens from the prefill's own prefix cache: pages 0 and 1 every layer at once, page 2 layer-wise
    assert streams(plan, b=(64, 6)) == ([("b", 7, 3, True, (6, 1), (3,))], [])
    plan2 = prefill_plan()
    plan2.allocated("b", 70, {"do_remote_decode": True}, BLOCKS["b"], 0)
    assert streams(plan2, b=(0, 40)) == ([("b", 7, 3, True, (), (6,))], [])
    # preempted: its blocks were freed, its room (never published) is dropped; it runs again
    # from the start in a new room
    assert streams(plan2, preempted={"b"}) == ([], [("b", 7)])
    assert streams(plan2, b=(0, 70)) == ([("b", 8, 3, True, (), (6, 1, 3))], [])
    assert plan2.finished("b", 70, {"do_remote_decode": True}, BLOCKS["b"], completed=True)[1][ROOM] == 8


def test_prefill_stream_aborted_mid_prefill_holds_blocks_until_released():
    plan = prefill_plan()
    plan.allocated("a", 70, {"do_remote_decode": True}, BLOCKS["a"], 0)
    streams(plan, a=(0, 40))
    assert plan.finished("a", 70, {"do_remote_decode": True}, BLOCKS["a"], completed=False) == (True, None)
    (a,) = plan.take_orders().aborts
    assert a.req_id == "a" and plan.in_flight == 1


def test_prefill_chunk_wise_when_layerwise_is_off_or_not_asked():
    plan = prefill_plan(layerwise=False)
    plan.allocated("a", 70, {"do_remote_decode": True}, BLOCKS["a"], 0)
    assert not plan.streams("a")
    plan2 = prefill_plan()
    plan2.allocated("a", 70, None, BLOCKS["a"], 0)                # no remote decode: nothing to stream
    assert not plan2.streams("a")
    assert plan.finished("a", 70, {"do_remote_decode": True}, BLOCKS["a"], completed=True)[0] is True
    (o,) = plan.take_orders().sends
    assert o.pages == (4, 9, 2)


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
    with pytest.raises(ValueError, match="layerwise must be true or false"):
        ConnectorSettings.parse({"rendezvous_port": 1, "layerwise": "no"}, "127.0.0.1")
    s = ConnectorSettings.parse({"rendezvous_port": 18998}, "::1")
    assert s.rendezvous == "[::1]:18998" and s.layerwise is True
