"""kvstage inside SGLang's transfer interface, between real processes.

Each rank is a process (rank.py) that drives SGLang's real scheduler-facing classes, obtained
through SGLang's plugin loader and get_kv_class exactly as a server gets them, over real kvstage
on real NIXL or Mooncake, with SGLang's real bootstrap server (kvstage's subclass of it) running
in this test process. Every room's outcome is checked on both sides; decode checks every KV byte
it received, its aux row (SGLang's MetadataBuffers: first output ids and bootstrap_room), and
that no page outside a successful room was written.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SHIMS = HERE / "shims"
TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """SGLang's ServerArgs reads a model config; the harness never loads weights."""
    d = tmp_path_factory.mktemp("model")
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 2,
        "vocab_size": 256, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16",
        "bos_token_id": 1, "eos_token_id": 2}))
    return str(d)


@pytest.fixture
def bootstrap_server():
    """The prefill instance's SGLang bootstrap server, as SGLang's launcher starts it: the class
    comes from get_kv_class for backend kvstage (it also runs kvstage's rendezvous server)."""
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class
    import requests

    port = free_port()
    server = get_kv_class(TransferBackend("kvstage"), KVClassType.BOOTSTRAP_SERVER)("127.0.0.1", port)
    deadline = time.monotonic() + 30
    while True:
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                break
        except requests.RequestException:
            pass
        assert time.monotonic() < deadline, "the SGLang bootstrap server never answered /health"
        time.sleep(0.1)
    yield port
    server.close()


def requests_for(seed: int, n: int, **overrides) -> list[dict]:
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        pages = rnd.randint(2, 6)
        prefix = overrides.get("prefix", {}).get(i, 0)
        suffix = pages - prefix
        cut = rnd.randint(1, suffix) if suffix > 1 else suffix
        chunks = [c for c in (cut, suffix - cut) if c]
        out.append({"room": rnd.randrange(1, 1 << 63), "pages": pages, "prefix": prefix, "chunks": chunks,
                    "abort": overrides.get("abort", {}).get(i), "swa_short": i in overrides.get("swa_short", ())})
    return out


def run(tmp_path, model_dir, port, prefill_tp, decode_tp, reqs, *, backend="nixl", staging=False,
        die_at_room=None, extra_env=None, state=None, mla=False) -> dict:
    sc = {"page_size": 4, "layers": 2, "heads": 4, "head_dim": 8, "num_pages": 64, "model": model_dir,
          "bootstrap_port": port, "http_port": free_port(), "deadline_s": 120, "requests": reqs,
          "die_at_room": die_at_room, "state": state, "mla": mla, "release": str(tmp_path / "release")}
    (tmp_path / "scenario.json").write_text(json.dumps(sc))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SHIMS), os.environ.get("PYTHONPATH", "")]),
               KVSTAGE_SGLANG_BACKEND=backend, SGLANG_DISAGG_STAGING_BUFFER="1" if staging else "0",
               HF_HUB_OFFLINE="1", SGLANG_HOST_IP="127.0.0.1", **(extra_env or {}))
    procs = {}
    try:
        for role, tp in (("prefill", prefill_tp), ("decode", decode_tp)):
            for rank in range(tp):
                out = tmp_path / f"{role}{rank}.json"
                log = open(tmp_path / f"{role}{rank}.log", "w")
                procs[(role, rank)] = (subprocess.Popen(
                    [sys.executable, str(HERE / "rank.py"), "--role", role, "--tp", str(tp), "--rank", str(rank),
                     "--scenario", str(tmp_path / "scenario.json"), "--out", str(out)],
                    env=env, stdout=log, stderr=subprocess.STDOUT), out)
        deadline = time.monotonic() + TIMEOUT_S
        for key in sorted(procs, key=lambda k: k[0] != "decode"):   # decode ranks first, then
            if key[0] == "prefill":                                  # the prefill ranks may go
                (tmp_path / "release").touch()
            procs[key][0].wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    results = {}
    for key, (proc, out) in procs.items():
        tail = (tmp_path / f"{key[0]}{key[1]}.log").read_text()[-3000:]
        if die_at_room is not None and key[0] == "prefill":
            results[key] = {"rc": proc.returncode}
            continue
        assert out.exists(), f"{key} wrote no report (rc {proc.returncode}):\n{tail}"
        rep = json.loads(out.read_text())
        assert "crash" not in rep, f"{key} crashed:\n{rep.get('crash')}\n{tail}"
        results[key] = rep
    return results


def expect(results, reqs, outcome) -> None:
    """Every room ends `outcome(i)` on every rank of both sides; decode's bytes all check out."""
    for key, rep in results.items():
        if "rooms" not in rep:
            continue
        assert rep["errors"] == [], f"{key}: {rep['errors'][:5]}"
        for i, q in enumerate(reqs):
            row = rep["rooms"][str(q["room"])]
            assert row.get("result") == outcome(i), f"{key} room #{i} {q}: {row}"
            if key[0] == "decode" and row["result"] == "Success":
                assert row["bytes"] > 0 and row["latency"] is not None
                assert row["aux_room"] == q["room"] and row["aux_ids_ok"], f"aux row of room #{i}: {row}"
            if row["result"] == "Failed":
                assert "KVTransferError" in row.get("error", ""), row


@pytest.mark.parametrize("prefill_tp,decode_tp,staging", [(2, 1, False), (2, 1, True), (1, 2, True)],
                         ids=["P2-D1-direct", "P2-D1-staged", "P1-D2-staged"])
def test_chunked_requests_with_a_prefix_hit(tmp_path, model_dir, bootstrap_server, prefill_tp, decode_tp, staging):
    reqs = requests_for(7, 6, prefix={2: 1, 4: 3})
    results = run(tmp_path, model_dir, bootstrap_server, prefill_tp, decode_tp, reqs, staging=staging)
    expect(results, reqs, lambda i: "Success")
    paths = {row["path"] for rank in range(decode_tp) for row in results[("decode", rank)]["rooms"].values()}
    assert paths == {"staged" if staging else "direct"}
    for rank in range(prefill_tp):   # the prefill learned each decode prefix through pop_decode_prefix_len
        rooms = results[("prefill", rank)]["rooms"]
        assert [rooms[str(q["room"])]["prefix_seen"] for q in reqs] == [q["prefix"] for q in reqs]


def test_mooncake_backend(tmp_path, model_dir, bootstrap_server):
    reqs = requests_for(11, 4, prefix={1: 2})
    results = run(tmp_path, model_dir, bootstrap_server, 2, 1, reqs, backend="mooncake", staging=True)
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
                                                              (2, 2, False, "gdn"), (1, 2, False, "mla-dsa")],
                         ids=["P2-D1-staged", "P1-D2-direct", "P2-D2-direct-gdn", "P1-D2-mla-dsa"])
def test_state_components(tmp_path, model_dir, bootstrap_server, prefill_tp, decode_tp, staging, kind):
    """Mamba slots (TP-sharded, rows before the TP axis, replicated, GDN conv) and SWA window
    pages, or an MLA model's DSA indexer pages (the whole suffix; one prefill rank, as a prefill
    rank that writes nothing under MLA ends its rooms without comparing pool items), move with the request, every
    byte checked on decode at indices other than prefill's; a request whose two sides name
    different page counts fails on both sides."""
    reqs = requests_for(13, 6, prefix={2: 1}, swa_short={4})
    dsa = kind == "mla-dsa"
    results = run(tmp_path, model_dir, bootstrap_server, prefill_tp, decode_tp, reqs, staging=staging, mla=dsa,
                  state={"slots": 12, "swa_pages": 99 if dsa else 2, "gdn": kind == "gdn", "dsa": dsa})
    expect(results, reqs, lambda i: "Failed" if i == 4 else "Success")
    for key, rep in results.items():
        rooms = rep["rooms"]
        assert "pool items differ" in rooms[str(reqs[4]["room"])]["error"], (key, rooms[str(reqs[4]["room"])])
        if key[0] == "decode":
            assert all(rooms[str(q["room"])]["state_bad"] == [] for i, q in enumerate(reqs) if i != 4)
            assert {rooms[str(q["room"])]["path"] for i, q in enumerate(reqs) if i != 4} == {
                "staged" if staging else "direct"}


def test_gdn_state_across_tp_sizes_is_refused(tmp_path, model_dir, bootstrap_server):
    """GDN conv state cannot be split across different TP sizes by kvstage: every request fails
    on both sides, the decode side naming the feature, and no byte lands anywhere."""
    reqs = requests_for(17, 3)
    results = run(tmp_path, model_dir, bootstrap_server, 2, 1, reqs, staging=True,
                  state={"slots": 12, "swa_pages": 2, "gdn": True})
    expect(results, reqs, lambda i: "Failed")
    for q in reqs:
        assert "GDN conv state" in results[("decode", 0)]["rooms"][str(q["room"])]["error"]
