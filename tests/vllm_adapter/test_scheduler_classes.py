"""kvstage's connector between vLLM's real Scheduler and worker-side calls, without servers
(harness.py): a prefill instance (TP 1) and a decode instance (TP 1: direct, TP 2: staged), each
a vLLM `Scheduler` with the connector in its role and one process per TP worker over real kvstage
(NIXL) on CPU caches in vLLM's CPU layout. Checked: the prefill's scheduler holds each request's
blocks after it finished (delay free) and frees them once kvstage's sends ended; the decode's
scheduler waits for the KV, then computes one token per request (it did not recompute the
prompt) and finishes it; every KV byte landed in the decode's blocks; a receive that fails
reaches vLLM as load errors and vLLM fails the request; kvstage's counters arrive through vLLM's
connector stats (KVOutputAggregator -> scheduler stats). The prefill runs chunked (48 tokens a
step, chunks ending inside pages) and sends layer-wise: each send is one layer of the pages the
step completed, made from that layer's save_kv_layer before the next layer's, and kvstage writes
one unit per layer (KVSTAGE_LAYER_GROUP=1, KVSTAGE_LAYERWISE_MIN_TOKENS=0)."""

from __future__ import annotations

import pytest
import torch
from harness import BLOCK, HEAD_DIM, KV_HEADS, LAYERS, Engine, write_model
from harness_worker import kv_page

from kvstage.support.cluster import free_port

PROMPTS = {"a": list(range(3, 36)), "b": list(range(40, 97)), "c": list(range(5, 11)) * 13}
EXTENDED = PROMPTS["b"][:BLOCK] + list(range(200, 250))     # 82 tokens: 3 pages, the first one "b"'s
CHUNK = 48                                                  # prefill tokens per step: chunks end inside pages
LAYERWISE = {"KVSTAGE_LAYER_GROUP": "1", "KVSTAGE_LAYERWISE_MIN_TOKENS": "0",   # a write per layer
             "KVSTAGE_LAYER_BATCHING": "0"}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("tiny-llama-config"))


def expected(req_id: str, pages: int, rank: int, tp: int) -> torch.Tensor:
    local = KV_HEADS // tp
    return torch.stack([torch.stack([kv_page(req_id, p, layer, KV_HEADS, BLOCK, HEAD_DIM)[rank * local:(rank + 1) * local]
                                     for p in range(pages)]) for layer in range(LAYERS)])


def assert_layer_wise(events: list[tuple], params: dict[str, dict], prompts: dict[str, list[int]]) -> None:
    """The prefill worker's log: every send was one layer, made from that layer's save_kv_layer
    (after it, before the next layer's and before wait_for_save), and every layer of every page
    of every request went out that way; some request's pages left over several steps."""
    layer, step = None, 0
    pages: dict[tuple[int, int], int] = {}
    steps: dict[int, set[int]] = {}
    for ev in events:
        if ev[0] == "save":
            layer = ev[1]
        elif ev[0] == "wait":
            layer, step = None, step + 1
        else:
            _, room, layers, n = ev
            assert layer is not None and layers == (layer, layer + 1), f"send {ev} not from save_kv_layer({layer})"
            pages[room, layer] = pages.get((room, layer), 0) + n
            steps.setdefault(room, set()).add(step)
    for req_id, prompt in prompts.items():
        room = params[req_id]["kvstage_room"]
        for lay in range(LAYERS):
            assert pages.get((room, lay), 0) == -(-len(prompt) // BLOCK), (req_id, lay, pages)
    assert any(ev[0] == "send" and ev[2] == (0, 1) for ev in events)   # before the last layer's save
    assert max(len(s) for s in steps.values()) > 1, steps              # chunked: sends over several steps


def prefill_all(prefill: Engine, prompts: dict[str, list[int]]) -> dict[str, dict]:
    for req_id, prompt in prompts.items():
        prefill.add(req_id, prompt, 1, {"do_remote_decode": True})
    prefill.run_until(lambda: set(prompts) <= set(prefill.finished), "prefill requests finished")
    params = {}
    for req_id in prompts:
        fin = prefill.finished[req_id]
        assert fin.reason == "length" and len(fin.tokens) == 1, fin
        params[req_id] = fin.kv_transfer_params
        assert params[req_id]["do_remote_prefill"] is True and params[req_id]["kvstage_tp_size"] == 1
    # delay free: the scheduler still holds every request's prompt blocks for kvstage's sends
    assert prefill.used_blocks() >= sum(-(-len(p) // BLOCK) for p in prompts.values())
    return params


@pytest.mark.timeout(600)
@pytest.mark.parametrize("decode_tp,path", [(1, "direct"), (2, "staged")], ids=["P1-D1-direct", "P1-D2-staged"])
def test_prefill_to_decode(model, decode_tp, path):
    prefill = Engine("prefill", model, producer=True, tp=1, rendezvous_port=free_port(), chunk=CHUNK,
                     env=LAYERWISE)
    decode = Engine("decode", model, producer=False, tp=decode_tp, rendezvous_port=free_port())
    try:
        params = prefill_all(prefill, PROMPTS)
        assert_layer_wise(prefill.events(0), params, PROMPTS)
        landed = {}
        for req_id, prompt in PROMPTS.items():
            decode.add(req_id, prompt, 3, params[req_id])

        def all_landed():
            prefill.step()    # the prefill's engine keeps stepping: its workers push
            for r in PROMPTS:
                if r in decode.first_scheduled and r not in landed:
                    landed[r] = decode.block_ids(r)   # read below, while the request still holds them
                    pages = -(-len(PROMPTS[r]) // BLOCK)
                    for rank in range(decode_tp):
                        got = decode.read(rank, landed[r][:pages])
                        assert torch.equal(got, expected(r, pages, rank, decode_tp)), f"{r}: rank {rank} KV differs"
            return set(PROMPTS) <= set(decode.finished)
        decode.run_until(all_landed, "decode requests finished")
        for req_id in PROMPTS:
            # the KV came from the prefill: the decode computed only the last prompt token itself
            assert decode.first_scheduled[req_id] == 1, decode.first_scheduled
            fin = decode.finished[req_id]
            assert fin.reason == "length" and len(fin.tokens) == 3, fin
        # the prefill freed the blocks once its sends ended
        prefill.run_until(lambda: prefill.used_blocks() == 0, "prefill blocks freed")

        # a decode prefix-cache hit: "d" starts with "b"'s first page, which the decode holds
        # from "b"; the prefill (no prefix cache) computed all of "d", but sends only the pages
        # past the decode's prefix: the cached page keeps "b"'s KV
        prefill.events(0)
        params = prefill_all(prefill, {"d": EXTENDED})
        assert_layer_wise(prefill.events(0), params, {"d": EXTENDED})
        decode.add("d", EXTENDED, 3, params["d"])

        def extended_landed():
            prefill.step()
            if "d" in decode.first_scheduled and "d" not in landed:
                landed["d"] = decode.block_ids("d")
                for rank in range(decode_tp):
                    got = decode.read(rank, landed["d"][:3])
                    want = expected("d", 3, rank, decode_tp)
                    want[:, 0] = expected("b", 1, rank, decode_tp)[:, 0]
                    assert torch.equal(got, want), f"d: rank {rank} KV differs"
            return "d" in decode.finished
        decode.run_until(extended_landed, "the prefix-hit request finished")
        assert landed["d"][0] == landed["b"][0] and decode.first_scheduled["d"] == 1
        prefill.run_until(lambda: prefill.used_blocks() == 0, "prefill blocks freed")
        n = len(PROMPTS) + 1
        for eng, tp in ((prefill, 1), (decode, decode_tp)):
            total = {k: sum(s.get(k, 0) for s in eng.stats) for k in ("succeeded", "failed", path, "bytes")}
            assert total["succeeded"] == n * tp and total["failed"] == 0, (eng.name, eng.stats)
            assert total[path] == n * tp and total["bytes"] > 0, (eng.name, eng.stats)
    finally:
        decode.close()
        prefill.close()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layerwise", [True, False], ids=["layer-wise", "chunk-wise"])
def test_failed_receive_fails_the_request(model, layerwise):
    """A decode request whose prompt is one page longer than the prefill's: kvstage fails the
    room on both sides (page counts differ); the decode reports its blocks as load errors and
    vLLM (kv_load_failure_policy "fail") ends the request with an error; the prefill frees its
    blocks (a layer-wise sender failed before vLLM reported the request finished is held until
    it did); each side's stats count the failure. Chunk-wise: the connector's `layerwise` off."""
    prefill = Engine("prefill", model, producer=True, tp=1, rendezvous_port=free_port(), layerwise=layerwise)
    decode = Engine("decode", model, producer=False, tp=1, rendezvous_port=free_port())
    try:
        prompts = {"ok": PROMPTS["a"], "bad": PROMPTS["b"]}
        params = prefill_all(prefill, prompts)
        decode.add("ok", prompts["ok"], 2, params["ok"])
        decode.add("bad", prompts["bad"] + list(range(300, 340)), 2, params["bad"])

        def both_finished():
            prefill.step()
            return {"ok", "bad"} <= set(decode.finished)
        decode.run_until(both_finished, "decode requests finished")
        # layer-wise: a send per layer; chunk-wise: one send of every layer, after the request finished
        sends = [ev for ev in prefill.events(0) if ev[0] == "send"]
        assert len(sends) == (LAYERS if layerwise else 1) * 2, sends
        assert all((ev[2] is not None) == layerwise for ev in sends), sends
        assert decode.finished["ok"].reason == "length", decode.finished
        assert decode.finished["bad"].reason == "error", decode.finished
        prefill.run_until(lambda: prefill.used_blocks() == 0, "prefill blocks freed")
        for eng in (prefill, decode):
            assert sum(s.get("failed", 0) for s in eng.stats) == 1, (eng.name, eng.stats)
            assert sum(s.get("succeeded", 0) for s in eng.stats) == 1, (eng.name, eng.stats)
    finally:
        decode.close()
        prefill.close()
