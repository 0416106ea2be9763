"""The scheduler-class harness's driver: starts the rank processes of a scenario (rank.py, each
forked from a process with SGLang imported: rank_launcher.py), waits for them, and checks their
reports. Used by the scheduler-class tests of this folder; the
fixtures (a model config, SGLang's bootstrap server) are in conftest.py. `device`: where the
ranks' KV caches live, "cpu" or "cuda" (rank.py; the CUDA tests are test_cuda_*.py, collected
only on a machine with a CUDA device)."""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

from rank_launcher import RankProcess

import kvstage
from kvstage.support.cluster import free_port

HERE = Path(__file__).resolve().parent
SHIMS = HERE / "shims"
TIMEOUT_S = 240


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
                    "abort": overrides.get("abort", {}).get(i), "swa_short": i in overrides.get("swa_short", ()),
                    "early_event": i in overrides.get("early_event", ()), "host": i in overrides.get("host", ()),
                    "late_meta": i in overrides.get("late_meta", ())})
    return out


def run(tmp_path, model_dir, port, prefill_tp, decode_tp, reqs, *, backend="nixl", staging=False,
        die_at_room=None, extra_env=None, state=None, mla=False, hold=None, queue=False, prefill_dp=1,
        decode_dp=1, draft=None, prefill_pp=1, decode_pp=1, layers=2, device="cpu", host=False,
        prefill_cp=1, decode_dcp=1, switch=None, prefill_complete=False, kv_shard=False, prefill_dcp=1,
        layer_split=False) -> dict:
    """`prefill_cp`: a prefill with attention context parallelism, its `prefill_tp` ranks CP x
    attention TP (`layer_split`: SGLang's DSA cache layer split, each CP rank holding its range of
    the layers); `decode_dcp`: a decode with decode context parallel of that size (MLA; its
    requests name their "tokens"); `prefill_dcp`: the prefill's DCP size (N -> N: its requests'
    "pages" are virtual pages of page_size x N tokens, their "prefix" in pages of page_size); `switch`: a PD role switch, the
    requests each process plays in its second role (rank.run_switch; its first role's report is
    the process's report file plus ".1"); `prefill_complete`: SGLang's prefill_complete allocation
    policy on both sides ("decode": on the decode only) (a request's "mark_after": rooms the decode must finish before the
    prefill completes it); `kv_shard`: the prefill's MLA pages sharded over its attention TP ranks
    (SGLang's --enable-kv-cache-sharding; `model_dir` an MLA model's config); `prefill_pp`: a PP prefill, prefill_tp x prefill_pp processes (world ranks); `decode_pp`
    likewise a PP decode (its results keyed by world rank); `layers`: the
    model's, as in `model_dir`'s config; `host`: the decode ranks also hold a host KV pool
    (host KV destinations), where requests made with `host=` indices get their KV."""
    sc = {"page_size": 4, "layers": layers, "heads": 4, "head_dim": 8, "num_pages": 64, "model": model_dir,
          "bootstrap_port": port, "http_port": free_port(), "deadline_s": 120, "requests": reqs,
          "die_at_room": die_at_room, "state": state, "mla": mla, "release": str(tmp_path / "release"),
          "hold": hold, "queue": queue, "gloo": str(tmp_path / "gloo"), "prefill_dp": prefill_dp,
          "decode_dp": decode_dp, "draft": draft, "prefill_pp": prefill_pp, "decode_pp": decode_pp, "device": device,
          "host": host, "sync": str(tmp_path / "sync"), "prefill_tp": prefill_tp, "prefill_cp": prefill_cp,
          "decode_dcp": decode_dcp, "prefill_dcp": prefill_dcp, "switch": {"requests": switch} if switch else None,
          "prefill_complete": prefill_complete, "kv_shard": kv_shard, "layer_split": layer_split}
    (tmp_path / "sync").mkdir(exist_ok=True)
    (tmp_path / "scenario.json").write_text(json.dumps(sc))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SHIMS), os.environ.get("PYTHONPATH", "")]),
               KVSTAGE_SGLANG_BACKEND=backend, SGLANG_DISAGG_STAGING_BUFFER="1" if staging else "0",
               HF_HUB_OFFLINE="1", SGLANG_HOST_IP="127.0.0.1", **(extra_env or {}))
    procs = {}
    try:
        for role, tp, ranks in (("prefill", prefill_tp, prefill_tp * prefill_pp),
                                ("decode", decode_tp, decode_tp * decode_pp)):
            for rank in range(ranks):
                out = tmp_path / f"{role}{rank}.json"
                procs[(role, rank)] = (RankProcess(
                    ["--role", role, "--tp", str(tp), "--rank", str(rank),
                     "--scenario", str(tmp_path / "scenario.json"), "--out", str(out)],
                    env, tmp_path / f"{role}{rank}.log", fresh=device == "cuda"), out)
        deadline = time.monotonic() + TIMEOUT_S
        for key in sorted(procs, key=lambda k: k[0] != "decode"):   # decode ranks first, then
            if key[0] == "prefill":                                  # the prefill ranks may go
                (tmp_path / "release").touch()
            procs[key][0].wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
    results = {}
    for key, (proc, out) in procs.items():
        tail = (tmp_path / f"{key[0]}{key[1]}.log").read_text()[-3000:]
        if die_at_room is not None and key[0] == "prefill":
            results[key] = {"rc": proc.returncode}
            continue
        assert out.exists(), f"{key} wrote no report (rc {proc.returncode}):\n{tail}"
        rep = json.loads(out.read_text())
        assert "crash" not in rep, f"{key} crashed:\n{rep.get('crash')}\n{tail}"
        if "rank" in rep:    # the rank drove this checkout's kvstage, on the scenario's device
            assert rep["rank"]["kvstage"] == kvstage.__file__, (key, rep["rank"])
            assert rep["rank"]["kv_device"].split(":")[0] == device and rep["rank"]["aux_device"] == "cpu", rep["rank"]
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
