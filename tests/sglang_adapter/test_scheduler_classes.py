"""kvstage inside SGLang's transfer interface, between real processes.

Each rank is a process (rank.py) that drives SGLang's real scheduler-facing classes, obtained
through SGLang's plugin loader and get_kv_class exactly as a server gets them, over real kvstage
on real NIXL or Mooncake, with SGLang's real bootstrap server (kvstage's subclass of it) running
in this test process. Every room's outcome is checked on both sides; decode checks every KV byte
it received, its aux row (SGLang's MetadataBuffers: first output ids and bootstrap_room), and
that no page outside a successful room was written.

Each test takes the KV device as an argument with a default (`device="cpu"`; pytest passes no
fixture for it): test_cuda_scheduler_classes.py calls some of them with "cuda" on a machine with a
CUDA device.
"""

from __future__ import annotations

import json

import pytest
from scenario import expect, requests_for, run


@pytest.mark.parametrize("prefill_tp,decode_tp,staging", [(2, 1, False), (2, 1, True), (1, 2, True)],
                         ids=["P2-D1-direct", "P2-D1-staged", "P1-D2-staged"])
def test_chunked_requests_with_a_prefix_hit(tmp_path, model_dir, bootstrap_server, prefill_tp, decode_tp, staging,
                                            device="cpu"):
    """Also SGLang's host receive (--disaggregation-decode-host-receive-threshold below 1): the
    decode ranks are given host KV buffers (host_kv_data_ptrs) and say they support host
    destinations; requests #0 and #5 go to the host pool (destination HOST) and get every byte
    there, the others in the device cache, on the same path, and no other page of either is
    written (rank.py checks both)."""
    reqs = requests_for(7, 6, prefix={2: 1, 4: 3}, early_event={1, 2}, host={0, 5})
    results = run(tmp_path, model_dir, bootstrap_server, prefill_tp, decode_tp, reqs, staging=staging, host=True,
                  device=device)
    expect(results, reqs, lambda i: "Success")
    for rank in range(decode_tp):
        assert all(row["supports_host"] for row in results[("decode", rank)]["rooms"].values())
    for rank in range(prefill_tp):   # the overlap schedule's event: waited on off the scheduler's thread
        rooms = results[("prefill", rank)]["rooms"]
        assert [rooms[str(q["room"])].get("event_thread") for q in reqs] == [
            "kvstage-send-gate" if q["early_event"] else None for q in reqs]
        if device == "cuda":   # a real CUDA event, still pending when SGLang sent the chunk
            assert [rooms[str(q["room"])].get("event_pending") for q in reqs] == [
                True if q["early_event"] else None for q in reqs]
    paths = {row["path"] for rank in range(decode_tp) for row in results[("decode", rank)]["rooms"].values()}
    assert paths == {"staged" if staging else "direct"}
    for rank in range(prefill_tp):   # the prefill learned each decode prefix through pop_decode_prefix_len
        rooms = results[("prefill", rank)]["rooms"]
        assert [rooms[str(q["room"])]["prefix_seen"] for q in reqs] == [q["prefix"] for q in reqs]


def test_mooncake_backend(tmp_path, model_dir, bootstrap_server, device="cpu"):
    reqs = requests_for(11, 4, prefix={1: 2})
    results = run(tmp_path, model_dir, bootstrap_server, 2, 1, reqs, backend="mooncake", staging=True, device=device)
    expect(results, reqs, lambda i: "Success")


def test_abort_on_either_side(tmp_path, model_dir, bootstrap_server):
    reqs = requests_for(3, 5, abort={1: "prefill", 3: "decode"})
    results = run(tmp_path, model_dir, bootstrap_server, 2, 1, reqs, staging=True)
    expect(results, reqs, lambda i: "Failed" if i in (1, 3) else "Success")


def test_killed_prefill_fails_the_decode_side(tmp_path, model_dir, bootstrap_server):
    reqs = requests_for(5, 4)
    results = run(tmp_path, model_dir, bootstrap_server, 1, 1, reqs, die_at_room=reqs[2]["room"],
                  extra_env={"KVSTAGE_TIMEOUT_LEASE": "3", "KVSTAGE_TIMEOUT_HEARTBEAT": "0.5"})
    assert results[("prefill", 0)]["rc"] == -9
    assert set(results) == {("prefill", 0), ("decode", 0)} and "rooms" in results[("decode", 0)]
    # it died once the rooms before #2 had ended and before it sent anything of #2 or #3: those
    # fail, the first two succeed with every byte and their aux rows, and no other page was written
    expect(results, reqs, lambda i: "Failed" if i >= 2 else "Success")
    rooms = results[("decode", 0)]["rooms"]
    for q in reqs[2:]:
        assert rooms[str(q["room"])]["bytes"] == 0 and "(peer_lost)" in rooms[str(q["room"])]["error"], rooms


@pytest.mark.parametrize("prefill_tp,decode_tp,staging,kind", [(2, 1, True, "hybrid"), (1, 2, False, "hybrid"),
                                                              (2, 1, True, "gdn"), (1, 2, False, "gdn"),
                                                              (1, 2, False, "mla-dsa")],
                         ids=["P2-D1-staged", "P1-D2-direct", "P2-D1-staged-gdn", "P1-D2-direct-gdn",
                              "P1-D2-mla-dsa"])
def test_state_components(tmp_path, model_dir, bootstrap_server, prefill_tp, decode_tp, staging, kind, device="cpu"):
    """Mamba slots (TP-sharded, rows before the TP axis, replicated, GDN conv) and SWA window
    pages, or an MLA model's DSA indexer pages (the whole suffix; one prefill rank, as a prefill
    rank that writes nothing under MLA ends its rooms without comparing pool items), move with the request, every
    byte checked on decode at indices other than prefill's; a request whose two sides name
    different page counts fails on both sides. The KV streams: a request's first write leaves
    before its last send, which names its state."""
    reqs = requests_for(13, 6, prefix={2: 1}, swa_short={4})
    dsa = kind == "mla-dsa"
    results = run(tmp_path, model_dir, bootstrap_server, prefill_tp, decode_tp, reqs, staging=staging, mla=dsa,
                  state={"slots": 12, "swa_pages": 99 if dsa else 2, "gdn": kind == "gdn", "dsa": dsa}, device=device)
    expect(results, reqs, lambda i: "Failed" if i == 4 else "Success")
    for key, rep in results.items():
        rooms = rep["rooms"]
        assert "pool items differ" in rooms[str(reqs[4]["room"])]["error"], (key, rooms[str(reqs[4]["room"])])
        if key[0] == "prefill":   # the KV streams chunk by chunk; the state goes with the last send
            multi = [str(q["room"]) for i, q in enumerate(reqs) if i != 4 and len(q["chunks"]) > 1]
            assert multi and all(rooms[room]["streamed"] is True for room in multi), (key, rooms)
        if key[0] == "decode":
            assert all(rooms[str(q["room"])]["state_bad"] == [] for i, q in enumerate(reqs) if i != 4)
            assert {rooms[str(q["room"])]["path"] for i, q in enumerate(reqs) if i != 4} == {
                "staged" if staging else "direct"}


@pytest.mark.parametrize("prefill_tp,decode_tp,backend", [(2, 2, "nixl"), (1, 2, "mooncake")],
                         ids=["P2-D2-nixl", "P1-D2-mooncake"])
def test_a_kimi_linear_pool_moves_its_mamba_slots_beside_mla_layers(tmp_path, model_dir, bootstrap_server,
                                                                     prefill_tp, decode_tp, backend):
    """A hybrid MLA pool (Kimi Linear: SGLang's is_hybrid_mla_backend, is_mla_backend False): its
    MLA layers' KV and its Mamba slots (units sharded over attention TP, rows before the TP axis,
    replicated) move with each request, every byte checked on decode at a slot other than the
    prefill's, no other slot written. At equal TP each decode rank's KV and state come from the
    prefill rank of its TP rank; from TP 1, both from the one prefill rank."""
    reqs = requests_for(29 + prefill_tp, 5, prefix={2: 1})
    results = run(tmp_path, model_dir, bootstrap_server, prefill_tp, decode_tp, reqs, backend=backend, mla=True,
                  state={"slots": 12, "swa_pages": 0, "mamba_only": True})
    expect(results, reqs, lambda i: "Success")
    for r in range(decode_tp):
        rooms = results[("decode", r)]["rooms"]
        assert all(rooms[str(q["room"])]["state_bad"] == [] for q in reqs), rooms


EAGLE = {"layers": 1, "heads": 4, "head_dim": 8}     # the target's geometry (4 heads of 8 bf16)


def draft_model_dir(tmp_path, kv_heads: int) -> str:
    """A draft model's config (what SGLang sizes the draft's KV pool by: its KV heads)."""
    d = tmp_path / "draft-model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": kv_heads, "num_hidden_layers": 1, "vocab_size": 256,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "bos_token_id": 1,
        "eos_token_id": 2}))
    return str(d)


@pytest.mark.parametrize("prefill_tp,decode_tp,staging,mla,draft", [
    (2, 1, True, False, EAGLE), (1, 2, False, False, EAGLE),
    (1, 2, False, True, {"layers": 1, "head_dim": 8}),
    (1, 1, False, False, dict(EAGLE, prefill=False)),
    (2, 1, False, False, {"layers": 2, "heads": 2, "head_dim": 8}),
    (1, 2, True, False, {"layers": 1, "heads": 1, "head_dim": 16}),    # replicated on the decode
], ids=["P2-D1-staged-eagle", "P1-D2-direct-eagle", "P1-D2-mla-mtp", "P1-D1-decode-only", "P2-D1-direct-2-heads",
        "P1-D2-staged-1-head-dim-16"])
def test_speculative_decoding_draft_kv(tmp_path, model_dir, bootstrap_server, prefill_tp, decode_tp, staging, mla,
                                       draft, device="cpu"):
    """A draft model's KV (SGLang appends its entries after the target's, num_draft_entries) moves
    with the target's pages, every byte of both checked on decode: EAGLE-style (the target's
    geometry), an MLA model's MTP latent, and a draft model of its own geometry (other heads or
    head_dim: its head count from its config, speculative_draft_model_path, which sizes alone
    cannot replace once the draft's heads are replicated; it moves with each request's last
    piece); the aux row carries the draft's hidden states and top-k. Decode-only
    speculation (the prefill has no draft): the decode's draft pages stay untouched and every
    request succeeds."""
    if not mla and (draft["heads"], draft["head_dim"]) != (EAGLE["heads"], EAGLE["head_dim"]):
        draft = dict(draft, model=draft_model_dir(tmp_path, draft["heads"]))
    reqs = requests_for(17, 5, prefix={1: 1})
    results = run(tmp_path, model_dir, bootstrap_server, prefill_tp, decode_tp, reqs, staging=staging, mla=mla,
                  draft=draft, device=device)
    expect(results, reqs, lambda i: "Success")
    for rank in range(decode_tp):
        rooms = results[("decode", rank)]["rooms"]
        assert all(rooms[str(q["room"])]["aux_spec_ok"] for q in reqs), rooms
        assert {row["path"] for row in rooms.values()} == {"staged" if staging else "direct"}

