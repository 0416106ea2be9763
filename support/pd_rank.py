"""One rank process of the PD demo, the benchmark and the integration tests.

    python examples/pd_rank.py SPEC.json

The spec names the bootstrap server and one or more ranks to host in this process (each its own
KVManager, e.g. the same rank of several test geometries). Every prefill rank fills the pages of
each request with the deterministic pattern (kv_pattern.py) and sends them in chunks; every
decode rank receives into random pages and verifies every byte. Per-request outcomes, latencies
and the managers' stats are written as JSON to spec["result"].

Scenario knobs per room (all optional): abort_after_chunks (prefill: chunks sent before abort()),
abort_after_s (decode: seconds after init before abort()), create_delay_s (prefill: wait before
creating the sender), init_delay_s (decode: wait before init()), abort_before_init (decode: abort
right after creating the receiver), chunk_delay_s (prefill: pause between chunks), hold_last_until
(prefill: send the last chunk only once these files exist), touch_after_abort (decode: create this
file, "{rank}" replaced by its rank, once it aborted), start_after_file (both: do not start the
room, nor any after it, before this file, or each of this list of files, exists), done_file
(both: create this file, "{role}" and "{rank}" replaced, once the room ended and was released),
late_init (prefill: create the sender without a page count and give it with init(): "now" right
after creating it, "wait" once it polls WaitingForInput), infer_last (prefill: send() without last=), abort_at (prefill: abort() as soon
as the sender polls this state, e.g. "Bootstrapping" or "WaitingForInput", instead of sending),
prefix_pages (decode: its first k pages stand for a prefix cache hit: init(rest, prefix_pages=k)),
prefix_pages_by_rank ({"rank": k}: the same, per decode rank), source (decode: where the room's KV
comes from, {"bootstrap": "host:port", "dp_rank": r} or {"engine": id}; default: peer_engine),
pattern_key (both: the bytes' key instead of the room id, so two uses of one room id differ),
layer_sends (prefill: each chunk is sent layer-wise, as these [start, stop) layer ranges in this
order, one send() per step, each with a readiness object whose synchronize() records the thread
that called it; the record's ready_threads names them), abort_after_sends (prefill: layer-wise
sends made before abort(); a PP stage sends the part of each range inside its layers),
ready_fails_at_send (prefill: the readiness object of this layer-wise send, counted from 0,
raises in synchronize(): a forward pass that failed),
pool_items_with_last (prefill: the room's pool items go with its last send, not with the page
count; the record's last_send_at is when that send was made, in time.monotonic() seconds like
the timeline's), send_after_metadata (prefill: the first send waits until the decode side's
metadata is in).
Per manager, pp (prefill or decode): the engine's pipeline-parallel stages, the model's layers split as
evenly as they go (the first stages take one more) or as stage_layers lists ([[0, 2], [2, 6]]);
rank is then the engine rank, pp_rank * tp + tp_rank.
Per manager, layer_group, layerwise_min_tokens and layer_batching: EngineConfig's.
Per manager, path ("auto", "staged", "direct") and calibrate: EngineConfig's (docs/path_choice.md);
leases ("rank", "engine"): EngineConfig.leases (docs/configuration.md).
Per manager, dp_rank is the prefill engine's data-parallel rank (EngineConfig.dp_rank).
Per manager, dcp: the engine's decode context parallel size (KVLayout.dcp_size; MLA geometry).
Per manager, shards (a prefill of MLA geometry): KVLayout.page_shards, the KV pages sharded over its
TP group. Every rank of the engine then draws the same logical pages for a room (its seed leaves
the rank out) from the logical pool of pages x shards, and fills the positions whose page it owns
(logical page l on rank l % shards, local page l // shards).
Geometry draft: draft KV entries (KVLayout.draft) after the layers (with PP on the last stage only,
as SGLang keeps them); a decode rank
fills its draft entries with the byte UNWRITTEN at start, checks only the entries the prefill has
(prefill_draft: the prefill's draft count, default its own) and records per room whether its
other draft entries still hold UNWRITTEN on the room's pages (unwritten_intact). draft_heads and
draft_head_dim give the draft a geometry of its own (draft_pattern.py checks it); a decode rank then
also records whether its draft entries are all still UNWRITTEN on the room's pages
(draft_untouched) and on its prefix pages (draft_prefix_intact).
Per manager, metrics_port serves Prometheus metrics (EngineConfig.metrics_port; 0: any free port)
and metrics_file names a file the driver writes {"port": ...} to once the manager is up;
final_stats names a file it writes {"stats": ..., "rooms": [...]} to once every room ended (and its ring
lends no credits, up to 10 s: settled_stats), and
hold_open_until a file it then waits for (up to run_timeout_s) before closing the manager, so a
test can scrape the finished rank.
Per manager, from_pointers hands the cache to kvstage as raw addresses (KVBuffers.from_pointers),
clear_handles drops every handle with clear() once its room ended, live_stats names
a file the driver rewrites with the manager's stats about three times a second (a test waits on it), and
progress a file it rewrites after every room that ends: {"done": rooms ended, "ok": of them, clean
successes (decode: verified bit-exact)}.
Per manager, gil_hog: true starts, once per process and before any manager, a thread that always
wants the GIL (gil_hog() below): the stand-in for a serving engine's scheduler loop, whose Python
holds the GIL most of the time (examples/soak.py --starve).

With PD_RANK_PROFILE_DIR set in its environment (the benchmarks and clusters pass theirs on), the
process profiles the CPU time of each kvstage thread (cProfile on time.thread_time) and writes
DIR/<pid>-<role>-<thread>-<i>.prof at its end, for `python -m pstats` or
`python -m kvstage.support.profile_report DIR` (docs/trace.md, "CPU per thread").
"""

from __future__ import annotations

import cProfile
import dataclasses
import faulthandler
import functools
import json
import logging
import os
import random
import sys
import threading
import time
import traceback
import zlib
from collections.abc import Callable

import numpy as np
import torch

from kvstage.support import pool_pattern
from kvstage.support.draft_pattern import DraftPattern
from kvstage.support.kv_pattern import KVPattern
from kvstage.transfer import DraftKV, EngineConfig, KVBuffers, KVLayout, KVManager, KVPoll, Timeouts

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
          "float8_e4m3fn": torch.float8_e4m3fn, "int8": torch.int8, "uint8": torch.uint8}
DONE = (KVPoll.Success, KVPoll.Failed)
PREFIX_MARK = 0x5A5A5A5A   # room ^ this: the pattern of decode pages that hold a prefix
UNWRITTEN = 0xC3           # every byte of a draft entry at start: the decode's entries the prefill lacks keep it
_ENGINE_OWNED: list = []   # caches handed over by address (from_pointers): owned here, never by kvstage


def stage_layers(spec: dict, layers: int, pp: int) -> list[range]:
    """Each PP stage's layers: spec["stage_layers"], else split as evenly as they go."""
    if spec.get("stage_layers"):
        return [range(a, b) for a, b in spec["stage_layers"]]
    size, extra = divmod(layers, pp)
    bounds = [0]
    for s in range(pp):
        bounds.append(bounds[-1] + size + (s < extra))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def build(spec: dict, bootstrap: str) -> tuple[KVManager, KVLayout, KVBuffers, KVPattern]:
    g = spec["geometry"]
    pp = spec.get("pp", 1)
    pp_rank, tp_rank = divmod(spec["rank"], spec["tp"])
    draft = g.get("draft") if pp_rank == pp - 1 else 0   # with PP the last stage holds the draft, as in SGLang
    layout = KVLayout(num_layers=g["layers"], total_kv_heads=g["heads"], head_dim=g["head_dim"],
                      dtype=DTYPES[g["dtype"]], page_size=g["page_size"], tp_size=spec["tp"],
                      tp_rank=tp_rank, mla=g.get("mla", False), pp_size=pp, pp_rank=pp_rank,
                      stage=stage_layers(spec, g["layers"], pp)[pp_rank], dcp_size=spec.get("dcp", 1),
                      page_shards=spec.get("shards", 1),
                      draft=DraftKV(num_layers=draft, total_kv_heads=g.get("draft_heads"),
                                    head_dim=g.get("draft_head_dim")) if draft else None)
    shape = (g["pages"] * layout.page_size, layout.local_heads, layout.head_dim)
    # touched at start-up, as a serving engine's KV cache is (fresh pages fault on first write)
    device = torch.device(spec.get("device", "cpu"))   # "cuda:0": a VRAM cache (examples/gpu_check.py)

    def cache(n: int, shape=shape) -> list[torch.Tensor]:
        return [torch.zeros(shape, dtype=layout.dtype, device=device).zero_() for _ in range(n)]

    n, d = len(layout.layers) - layout.draft_layers, layout.draft_entries
    k, v = cache(n), None if layout.mla else cache(n)
    dshape = (shape[0], layout.draft_local_heads, layout.draft.head_dim) if layout.draft else shape
    dk, dv = cache(d, dshape), None if layout.mla or not d else cache(d, dshape)
    for t in dk + (dv or []):
        t.view(torch.uint8).fill_(UNWRITTEN)
    pools = pool_pattern.make_pools(g["pools"], layout) if g.get("pools") else {}
    buffers = KVBuffers(k, v, pools=pools, draft_k=dk, draft_v=dv)
    if spec.get("from_pointers"):  # hand the cache over the way SGLang's KVArgs does: raw addresses
        _ENGINE_OWNED.append((k, v, dk, dv))  # the "serving engine" keeps its memory alive
        owned = k + (v or []) + dk + (dv or [])   # target K, V, then the draft's K, V
        buffers = KVBuffers.from_pointers(layout, [t.data_ptr() for t in owned],
                                          [t.numel() * t.element_size() for t in owned],
                                          [t.numel() * t.element_size() // g["pages"] for t in owned], device=device)
        buffers.pools = pools
    cfg = EngineConfig(role=spec["role"], engine_id=spec["engine"], bootstrap=bootstrap,
                       backend=spec.get("backend", "nixl"), staging=spec.get("staging"),
                       host=spec.get("host", "127.0.0.1"), ctrl_port=spec.get("ctrl_port"),
                       staging_workers=spec.get("workers"),
                       staging_buffer_mb=spec.get("buffer_mb"), ring_mb=spec.get("ring_mb"),
                       staging_piece_mb=spec.get("piece_mb"),
                       timeouts=Timeouts.from_env(**spec.get("timeouts", {})),
                       backend_options=spec.get("backend_options", {}), auth_token=spec.get("token"),
                       faults=spec.get("faults"), dp_rank=spec.get("dp_rank", 0),
                       metrics_port=spec.get("metrics_port"), verify=spec.get("verify"),
                       layer_group=spec.get("layer_group"), layerwise_min_tokens=spec.get("layerwise_min_tokens"),
                       layer_batching=spec.get("layer_batching"), path=spec.get("path"),
                       calibrate=spec.get("calibrate"), credits=spec.get("credits"), leases=spec.get("leases"))
    mgr = KVManager(cfg, layout, buffers)
    pattern = KVPattern(layout, seed=spec.get("pattern_seed", 7))
    pattern.draft = DraftPattern(layout, seed=spec.get("pattern_seed", 7)) if layout.draft_own_geometry else None
    return mgr, layout, buffers, pattern


class Pages:
    """A free list of cache pages with random placement, like a serving engine's allocator
    (or, `contiguous`, the lowest run of consecutive free pages)."""

    def __init__(self, n: int, rng: random.Random, contiguous: bool = False):
        self.free = list(range(n))
        self.rng = rng
        self.contiguous = contiguous

    def take(self, n: int) -> np.ndarray | None:
        if len(self.free) < n:
            return None
        if self.contiguous:
            free = sorted(self.free)
            for i in range(len(free) - n + 1):
                if free[i + n - 1] - free[i] == n - 1:
                    run = free[i:i + n]
                    self.free = free[:i] + free[i + n:]
                    return np.array(run, dtype=np.int64)
            return None
        self.rng.shuffle(self.free)
        out, self.free = self.free[:n], self.free[n:]
        if self.rng.random() < 0.5:
            out.sort()  # half the requests get runs of consecutive pages
        return np.array(out, dtype=np.int64)

    def give(self, pages: np.ndarray) -> None:
        self.free.extend(int(p) for p in pages)


def drive(spec: dict, bootstrap: str, result: dict) -> None:
    mgr, layout, buffers, pattern = build(spec, bootstrap)
    result["rank"] = spec["rank"]
    result["endpoint"] = mgr.endpoint
    result["incarnation"] = mgr.incarnation
    if spec.get("metrics_file"):
        _write_json(spec["metrics_file"], {"port": mgr.metrics_port})
    if spec.get("bench", {}).get("mode") == "latency":
        return drive_latency(mgr, spec, buffers, pattern, result)
    shards = layout.page_shards
    # sharded pages: every rank of the engine draws the same logical pages (SPMD, as a serving engine's allocator)
    rng = random.Random(zlib.crc32(repr((spec.get("seed", 0), spec["engine"],
                                         spec["rank"] if shards == 1 else "shards")).encode()))
    pool = Pages(spec["geometry"]["pages"] * shards, rng, contiguous=spec.get("contiguous", False))
    items = pool_pattern.Items(buffers.pools, rng)
    rooms = list(spec["rooms"])
    window = spec.get("inflight", 16)
    tensors = buffers.tensors()
    active: dict[int, dict] = {}
    out = result["rooms"] = []
    t_start = time.perf_counter()
    deadline = time.monotonic() + spec.get("run_timeout_s", 120)
    next_live = 0.0
    while (rooms or active) and time.monotonic() < deadline:
        if spec.get("live_stats") and time.monotonic() >= next_live:
            _write_json(spec["live_stats"], {**mgr.stats(), "at": time.monotonic()})
            next_live = time.monotonic() + 0.3
        while rooms and len(active) < r_window(rooms[0], window):
            r = rooms[0]
            if not all(map(os.path.exists, _files(r.get("start_after_file")))):
                break
            if r.get("drain_before") and active:
                break
            pages = pool.take(r["pages"])
            if pages is None:
                break
            taken = items.take(room_item_counts(spec, r, buffers.pools))
            if taken is None:
                pool.give(pages)
                break
            rooms.pop(0)
            active[r["room"]] = start_room(mgr, spec, r, pages, pattern, tensors, taken, buffers)
        progressed = False
        for room_id, st in list(active.items()):
            progressed |= advance(mgr, spec, st)
            state = st["handle"].poll()
            if state in DONE and st["handle"].released:
                rec = finish(spec, st, pattern, tensors)
                out.append(rec)
                if spec.get("clear_handles"):
                    st["handle"].clear()
                pool.give(st["pages"])
                items.give(st["items"])
                del active[room_id]
                progressed = True
                if done_file := st["spec"].get("done_file"):
                    open(done_file.format(role=spec["role"], rank=spec["rank"]), "w").close()
                if spec.get("progress"):
                    _write_progress(spec["progress"], spec["role"], out)
        if spec.get("started_file") and not os.path.exists(spec["started_file"]) and active and \
                all(st["handle"].poll() in (KVPoll.Transferring,) for st in active.values()):
            open(spec["started_file"], "w").close()  # tests strike "mid-transfer" after this
        if not progressed:
            time.sleep(0.0005)
    for room_id, st in active.items():  # ran out of time
        out.append({"room": room_id, "state": st["handle"].poll().name, "failure": "driver timeout: "
                    + str(st["handle"].failure), "kind": "driver_timeout", "latency_s": None, "verified": False,
                    "age_s": time.perf_counter() - st["t0"]})
    result["wall_s"] = time.perf_counter() - t_start
    result["stats"] = mgr.stats()
    if (spec.get("faults") or {}).get("corrupt_data"):   # which rooms the fault flipped a byte of (tests)
        result["corrupted_rooms"] = sorted(mgr._loop.ctx.integrity.corrupted_rooms)
    if spec.get("final_stats"):
        result["stats"] = settled_stats(mgr)
        _write_json(spec["final_stats"], {"stats": result["stats"], "rooms": out})
    hold_open(spec)
    barrier(spec.get("barrier"), f"{spec['engine']}-{spec['rank']}")
    if spec.get("linger_s"):
        time.sleep(spec["linger_s"])
    mgr.close()


def settled_stats(mgr: KVManager, limit_s: float = 10.0) -> dict:
    """The manager's stats once its ring lends no credits (a decode rank with ring credits on):
    prefill ranks give theirs back once they have no staged request, after their last room
    ended, so a snapshot taken when the rooms ended may hold one its later readings do not.
    At most `limit_s`; then as they are."""
    deadline = time.monotonic() + limit_s
    st = mgr.stats()
    while st.get("ring_credit_bytes") and time.monotonic() < deadline:
        time.sleep(0.02)
        st = mgr.stats()
    return st


def hold_open(spec: dict) -> None:
    """Keep the manager (and its metrics endpoint) up until the hold_open_until file exists."""
    path = spec.get("hold_open_until")
    deadline = time.monotonic() + spec.get("run_timeout_s", 120)
    while path and not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)


def r_window(r: dict, default: int) -> int:
    return r.get("window", default)


def verifies(spec: dict, room: int) -> bool:
    """Bench runs check only the rooms they name (filling and checking cost more than moving)."""
    bench = spec.get("bench")
    return bench is None or room in bench.get("verify", [])


def drive_latency(mgr: KVManager, spec: dict, buffers: KVBuffers, pattern: KVPattern, result: dict) -> None:
    """Init -> Success of one request at a time, with the prefill side long ready: the decode
    side measures init() until wait() returns Success."""
    tensors = buffers.tensors()
    out = result["rooms"] = []
    handles = []
    if spec["role"] == "prefill":
        for i, r in enumerate(spec["rooms"]):
            pages = np.arange(i, i + r["pages"], dtype=np.int64) % spec["geometry"]["pages"]
            if verifies(spec, r["room"]):
                pattern.fill(tensors, r["room"], pages)
            h = mgr.sender(r["room"], r["pages"])
            h.send(pages, last=True)
            handles.append((r, h))
        for r, h in handles:
            h.wait(spec.get("run_timeout_s", 120))
            out.append({"room": r["room"], "state": h.poll().name, "failure": h.failure, "kind": h.failure_kind,
                        "latency_s": None, "verified": None})
    else:
        for i, r in enumerate(spec["rooms"]):
            h = mgr.receiver(r["room"], spec["peer_engine"])
            dst = np.arange(i % 64 * r["pages"], i % 64 * r["pages"] + r["pages"], dtype=np.int64)
            time.sleep(spec["bench"].get("gap_s", 0.002))  # let the control plane settle between requests
            if spec["bench"].get("meet"):
                meet(spec["bench"]["meet"], r["room"], spec["rank"])
            t0 = time.perf_counter()
            h.init(dst)
            state = h.wait(spec.get("run_timeout_s", 120))
            lat = time.perf_counter() - t0
            rec = {"room": r["room"], "state": state.name, "failure": h.failure, "kind": h.failure_kind,
                   "latency_s": lat, "verified": None}
            if state is KVPoll.Success and verifies(spec, r["room"]):
                err = pattern.check(tensors, r["room"], dst)
                rec["verified"], rec["error"] = err is None, err
            out.append(rec)
    result["stats"] = mgr.stats()
    barrier(spec.get("barrier"), f"{spec['engine']}-{spec['rank']}")
    mgr.close()


def meet(m: dict, room: int, rank: int) -> None:
    """Latency mode: the decode ranks of one engine init() a room together, as one scheduler step
    of a TP engine would ({"dir": ..., "count": decode ranks}); each waits for the others' mark."""
    open(os.path.join(m["dir"], f"{room}-{rank}"), "w").close()
    deadline = time.monotonic() + m.get("timeout_s", 60)
    while time.monotonic() < deadline:
        if sum(f.startswith(f"{room}-") for f in os.listdir(m["dir"])) >= m["count"]:
            return
        time.sleep(0.0002)
    raise TimeoutError(f"room {room}: the other decode ranks never came to init() it")


def barrier(b: dict | None, name: str) -> None:
    """Stay up (serving peers) until every rank of the run is done, as real ranks would."""
    if not b:
        return
    open(os.path.join(b["dir"], f"done-{name}"), "w").close()
    deadline = time.monotonic() + b.get("timeout_s", 60)
    while time.monotonic() < deadline:
        names = os.listdir(b["dir"])
        if "abort" in names or len([f for f in names if f.startswith("done-")]) >= b["count"]:
            return  # "abort": a rank process crashed and will never arrive (cluster.Cluster.wait)
        time.sleep(0.05)


def _write_progress(path: str, role: str, out: list) -> None:
    """Rooms ended so far, and how many of them succeeded as their side can tell: bit-exact on a
    decode rank (verified is True), confirmed by the decode side on a prefill rank (nothing to verify)."""
    want = True if role == "decode" else None
    _write_json(path, {"done": len(out), "ok": sum(r["state"] == "Success" and r["verified"] is want for r in out)})


def _write_json(path: str, obj: object) -> None:
    """Replace `path` atomically, so a reader never sees half a file."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, default=str)
    os.replace(tmp, path)


def room_item_counts(spec: dict, r: dict, pools: dict) -> dict:
    """How many items of each pool the room takes on this rank ({"aux": 1, ...}): the room's
    `pool_items`, or `pool_items_decode` on a decode rank (a mismatch on purpose), of the pools
    this rank registered (a PP stage: those of its layers)."""
    counts = r.get("pool_items", {})
    counts = r.get("pool_items_decode", counts) if spec["role"] == "decode" else counts
    layered = {n for n, p in (spec.get("geometry") or {}).get("pools", {}).items() if p.get("layer") is not None}
    return {n: c for n, c in counts.items() if n in pools or n not in layered}


def start_room(mgr: KVManager, spec: dict, r: dict, pages: np.ndarray, pattern: KVPattern, tensors,
               items: dict | None = None, buffers: KVBuffers | None = None) -> dict:
    st = {"room": r["room"], "pages": pages, "spec": r, "t0": time.perf_counter(), "chunk": 0, "sent": 0,
          "aborted": False, "t_done": None, "wall0": time.time(), "pattern": pattern, "tensors": tensors,
          "rank": spec["rank"], "items": items or {}, "buffers": buffers, "verify": verifies(spec, r["room"])}
    if spec["role"] == "prefill":
        if verifies(spec, r["room"]):
            if r.get("dcp_tokens") and pattern.layout.dcp_size > 1:   # a prefill DCP rank: its tokens
                fill_dcp(r, pattern, tensors, pages)
            elif pattern.layout.page_shards > 1:   # sharded pages: the positions whose page this rank holds
                lay = pattern.layout
                mine = np.flatnonzero(pages % lay.page_shards == lay.tp_rank)
                pattern.fill(tensors, r.get("pattern_key", r["room"]), pages[mine] // lay.page_shards, positions=mine)
            elif not r.get("layer_sends"):   # layer-wise: each send's layers are filled once it is ready
                pattern.fill(tensors, r.get("pattern_key", r["room"]), pages)
            if pattern.draft is not None:  # a draft of its own geometry moves with the last piece
                pattern.draft.fill(buffers, r.get("pattern_key", r["room"]), pages, pattern.layout.draft_entries)
            if st["items"]:
                pool_pattern.fill(buffers.pools, st["items"], r.get("pattern_key", r["room"]), pattern.layout)
        delay = r.get("create_delay_s", 0)
        st["create_at"] = time.perf_counter() + delay
        st["handle"] = None
        if not delay:
            st["handle"] = new_sender(mgr, r, st)
    else:
        st["handle"] = new_receiver(mgr, spec, r)
        if r.get("abort_before_init"):
            st["handle"].abort()
            st["aborted"], st["inited"], st["init_at"] = True, True, 0
            return st
        delay = r.get("init_delay_s", 0)
        st["init_at"] = time.perf_counter() + delay
        st["inited"] = False
        if not delay:
            init_receiver(st)
            st["inited"], st["t0"], st["wall0"] = True, time.perf_counter(), time.time()
    if st.get("handle") is None:
        st["handle"] = _Pending()
    return st


def new_receiver(mgr: KVManager, spec: dict, r: dict):
    """The room's own source ({"bootstrap": "host:port", "dp_rank": r} or {"engine": id}), else
    the manager's peer_engine."""
    src = r.get("source")
    if src is None:
        return mgr.receiver(r["room"], spec["peer_engine"])
    return mgr.receiver(r["room"], src.get("engine"), bootstrap=src.get("bootstrap"),
                        prefill_dp_rank=src.get("dp_rank"))


def prefix_of(st: dict) -> int:
    r = st["spec"]
    return r.get("prefix_pages_by_rank", {}).get(str(st["rank"]), r.get("prefix_pages", 0))


def init_receiver(st: dict) -> None:
    """init(); with prefix_pages k, the first k pages stand for this rank's prefix cache: they
    get their own marker pattern (which must survive), and only the rest is asked for."""
    k = prefix_of(st)
    tokens = {"num_tokens": st["spec"]["dcp_tokens"]} if st["spec"].get("dcp_tokens") else {}
    if tokens:   # decode context parallel: the room's pages start zeroed, so a byte written off its slot shows
        for t in st["tensors"]:
            t.view(torch.uint8).view(-1, st["pattern"].layout.page_bytes)[torch.as_tensor(st["pages"][k:])] = 0
    if k:
        st["pattern"].fill(st["tensors"], st["room"] ^ PREFIX_MARK, st["pages"][:k])
        st["prefix_filled"] = True
        st["handle"].init(st["pages"][k:], prefix_pages=k, pool_items=st["items"] or None, **tokens)
    else:
        st["handle"].init(st["pages"], pool_items=st["items"] or None, **tokens)


def new_sender(mgr: KVManager, r: dict, st: dict):
    late = r.get("late_init")
    st["inited"], st["seen_before_init"] = not late, set()
    items = None if r.get("pool_items_with_last") else (st["items"] or None)
    tokens = {"num_tokens": r["dcp_tokens"]} if r.get("dcp_tokens") else {}
    if not late:
        return mgr.sender(r["room"], len(st["pages"]), pool_items=items, **tokens)
    h = mgr.sender(r["room"])
    if late == "now":
        h.init(len(st["pages"]), pool_items=items, **tokens)
        st["inited"] = True
    return h


def _files(named: str | list[str] | None) -> list[str]:
    """start_after_file: one path or a list of them."""
    if not named:
        return []
    return [named] if isinstance(named, str) else list(named)


class _Pending:
    """Stands in until a delayed sender is created."""
    released = False
    failure = None

    def poll(self):
        return KVPoll.Bootstrapping


def advance(mgr: KVManager, spec: dict, st: dict) -> bool:
    r, now = st["spec"], time.perf_counter()
    h = st["handle"]
    if spec["role"] == "prefill":
        if isinstance(h, _Pending):
            if now < st["create_at"]:
                return False
            st["handle"] = h = new_sender(mgr, r, st)
        if r.get("abort_at") and not st["aborted"]:
            if h.poll().name != r["abort_at"]:
                return False
            h.abort()
            st["aborted"] = True
            return True
        if st["aborted"]:
            return False
        if not st["inited"]:
            state = h.poll()
            if state is not KVPoll.WaitingForInput:
                st["seen_before_init"].add(state.name)
                return False
            h.init(len(st["pages"]), pool_items=None if r.get("pool_items_with_last") else (st["items"] or None))
            st["inited"], st["waited_for_input"] = True, True
            return True
        chunks = r.get("chunks") or [len(st["pages"])]
        if (spec.get("bench") or r.get("send_after_metadata")) and st["chunk"] == 0 \
                and h.poll() is KVPoll.Bootstrapping:
            return False  # bench: the clock starts once the decode side is there
        if st["chunk"] < len(chunks) and now >= st.get("next_chunk_at", 0):
            if st["chunk"] == 0:
                st["t_send"] = time.time()
            if r.get("abort_after_chunks") is not None and st["chunk"] >= r["abort_after_chunks"] and not st["aborted"]:
                h.abort()
                st["aborted"] = True
                return True
            if st["aborted"]:
                return False
            if st["chunk"] == len(chunks) - 1 and not all(map(os.path.exists, r.get("hold_last_until", []))):
                return False
            n = chunks[st["chunk"]]
            if r.get("layer_sends"):
                return send_layers(h, r, st, n, len(chunks))
            final = st["chunk"] == len(chunks) - 1
            extra = {"pool_items": st["items"]} if final and r.get("pool_items_with_last") else {}
            if final:
                st["last_send_at"] = time.monotonic()
            if r.get("infer_last"):
                h.send(st["pages"][st["sent"]:st["sent"] + n], **extra)
            else:
                h.send(st["pages"][st["sent"]:st["sent"] + n], last=final, **extra)
            st["sent"] += n
            st["chunk"] += 1
            st["next_chunk_at"] = now + r.get("chunk_delay_s", 0)
            return True
    else:
        if not st["inited"] and now >= st["init_at"]:
            init_receiver(st)
            st["inited"], st["t0"], st["wall0"] = True, time.perf_counter(), time.time()
            return True
        ab = r.get("abort_after_s")
        if ab is not None and st["inited"] and not st["aborted"] and now - st["t0"] >= ab:
            h.abort()
            st["aborted"] = True
            if r.get("touch_after_abort"):
                open(r["touch_after_abort"].format(rank=spec["rank"]), "w").close()
            return True
    if st["t_done"] is None and h.poll() in DONE:
        st["t_done"], st["wall1"] = time.perf_counter(), time.time()
    return False


class LayersComputed:
    """A readiness object (what a CUDA event is to send(ready=...)): the pattern of its layers'
    pages is written only when synchronize() runs, as a GPU's forward pass would have produced
    them by then, so a write that read them without waiting carries zeros and fails the check.
    Records which threads synchronize() ran on (kvstage's, never the caller's)."""

    def __init__(self, seen: set, fill=None, fails: str | None = None):
        self.seen, self._fill, self._fails = seen, fill, fails

    def synchronize(self) -> None:
        self.seen.add(threading.current_thread().name)
        if self._fails is not None:   # the forward pass failed: its layers never come
            raise RuntimeError(self._fails)
        if self._fill is not None:
            self._fill()
            self._fill = None


def send_layers(h, r: dict, st: dict, n: int, num_chunks: int) -> bool:
    """One layer-wise send of the current chunk; the chunk is done after its last layer range."""
    stage = st["pattern"].layout.layers   # a PP stage sends its part of each range
    sends = [(max(a, stage.start), min(b, stage.stop)) for a, b in r["layer_sends"]
             if max(a, stage.start) < min(b, stage.stop)]
    i = st.setdefault("layer_send", 0)
    stop = r.get("abort_after_sends")
    if stop is not None and st.setdefault("sends_made", 0) >= stop:
        h.abort()
        st["aborted"] = True
        return True
    a, b = sends[i]
    pages = st["pages"][st["sent"]:st["sent"] + n]
    fill = None
    if st["verify"]:
        # this rank's tensors: K of each of its (stage's) layers, then V of each
        held = len(stage)
        only = [kv * held + layer - stage.start for kv in range(st["pattern"].layout.num_kv) for layer in range(a, b)]
        lay = st["pattern"].layout
        if lay.page_shards > 1:   # sharded pages: the positions whose page this rank holds
            mine = np.flatnonzero(pages % lay.page_shards == lay.tp_rank)
            fill = functools.partial(st["pattern"].fill, st["tensors"], r.get("pattern_key", r["room"]),
                                     pages[mine] // lay.page_shards, only=only, positions=st["sent"] + mine)
        else:
            fill = functools.partial(st["pattern"].fill, st["tensors"], r.get("pattern_key", r["room"]), pages,
                                     st["sent"], only)
    final = i == len(sends) - 1 and st["chunk"] == num_chunks - 1
    extra = {"pool_items": st["items"]} if final and r.get("pool_items_with_last") else {}
    if final:
        st["last_send_at"] = time.monotonic()
    fails = r.get("ready_fails_at_send")
    fails = f"forward pass of room {r['room']} failed" if fails == st.get("sends_made", 0) else None
    h.send(pages, layers=range(a, b), ready=LayersComputed(st.setdefault("ready_threads", set()), fill, fails), **extra)
    st["sends_made"] = st.get("sends_made", 0) + 1
    st["layer_send"] = i + 1
    if st["layer_send"] == len(sends):
        st["layer_send"] = 0
        st["sent"] += n
        st["chunk"] += 1
        st["next_chunk_at"] = time.perf_counter() + r.get("chunk_delay_s", 0)
    return True


def draft_entries(spec: dict, layout: KVLayout) -> tuple[list[int], list[int]]:
    """Indices into buffers.tensors() of the entries the prefill writes, and of the decode's
    draft entries beyond the prefill's (empty without decode-only speculation)."""
    sent = layout.num_layers + spec.get("prefill_draft", layout.draft_layers)
    held = layout.layers   # a PP stage's entries only (the last one's draft after its layers)
    idx = [(kv * len(held) + i, e < sent) for kv in range(layout.num_kv) for i, e in enumerate(held)]
    return [t for t, s in idx if s], [t for t, s in idx if not s]


def finish(spec: dict, st: dict, pattern: KVPattern, tensors) -> dict:
    h = st["handle"]
    state = h.poll()
    rec = {"room": st["room"], "state": state.name, "failure": h.failure, "kind": h.failure_kind,
           "latency_s": (st["t_done"] or time.perf_counter()) - st["t0"], "pages": int(len(st["pages"])),
           "verified": None, "start": st["wall0"], "end": st.get("wall1", time.time())}
    rec["t_send"] = st.get("t_send")
    if st.get("prefix_filled"):  # decode, whatever the outcome: the pages holding the prefix kept their bytes
        rec["prefix_intact"] = pattern.check(tensors, st["room"] ^ PREFIX_MARK, st["pages"][:prefix_of(st)]) is None
    if spec["role"] == "prefill" and hasattr(h, "decode_prefix_pages"):
        rec["decode_prefix_pages"] = h.decode_prefix_pages
    m = h.metrics() if hasattr(h, "metrics") else None
    if m is not None:
        rec["metrics"] = {"state": m.state.name, "nbytes": m.nbytes, "backend_writes": m.backend_writes,
                          "merged_sends": m.merged_sends,
                          "path": m.path, "seconds": m.seconds, "gb_per_s": m.gb_per_s,
                          "timeline": dataclasses.asdict(m.timeline)}
    exc = h.failure_exception() if hasattr(h, "failure_exception") else None
    if exc is not None:
        rec["exception"] = {"type": type(exc).__name__, "kind": exc.kind, "reason": exc.reason}
    if "last_send_at" in st:
        rec["last_send_at"] = st["last_send_at"]
    if "ready_threads" in st:
        rec["ready_threads"] = sorted(st["ready_threads"])
    if st["spec"].get("late_init") == "wait":
        rec["waited_for_input"] = st.get("waited_for_input", False)
        rec["seen_before_init"] = sorted(st.get("seen_before_init", ()))
    if spec["role"] == "decode" and pattern.draft is not None:
        rec.update(pattern.draft.outcome(st["buffers"], st["pages"], prefix_of(st), UNWRITTEN))
    if spec["role"] == "decode" and state is KVPoll.Success and verifies(spec, st["room"]):
        k = prefix_of(st)
        sent, extra = draft_entries(spec, pattern.layout)
        if extra:   # decode-only speculation: the entries the prefill lacks were never written (past the prefix)
            page = pattern.layout.page_size * pattern.layout.token_bytes
            rows = torch.as_tensor(np.asarray(st["pages"][k:], dtype=np.int64))
            rec["unwritten_intact"] = all(bool((tensors[t].view(torch.uint8).view(-1, page)[rows] == UNWRITTEN).all())
                                          for t in extra)
        if st["spec"].get("dcp_tokens"):
            err = check_dcp(st, pattern, tensors, rec)
        else:
            err = pattern.check(tensors, st["spec"].get("pattern_key", st["room"]), st["pages"][k:], first=k,
                                only=sent if extra else None)
        if err is None and pattern.draft is not None:
            n = spec.get("prefill_draft", pattern.layout.draft_entries)
            err = pattern.draft.check(st["buffers"], st["spec"].get("pattern_key", st["room"]), st["pages"][k:], k, n)
            if pattern.layout.draft_entries > n:
                rec["unwritten_intact"] = pattern.draft.untouched(st["buffers"], st["pages"][k:],
                                                                  range(n, pattern.layout.draft_entries), UNWRITTEN)
        if err is None and st["items"]:
            err = pool_pattern.check(st["buffers"].pools, st["items"], st["spec"].get("pattern_key", st["room"]),
                                     pattern.layout)
        rec["verified"] = err is None
        rec["error"] = err
    return rec


def dcp_slots(pattern: KVPattern, pages: np.ndarray, num_tokens: int, prefix_pages: int = 0):
    """(slots, tokens): a DCP rank's local slots past its prefix pages and the request's tokens
    they hold, token t = local slot * dcp_size + dcp_rank (token_mapping.py)."""
    lay = pattern.layout
    n, d, ps = lay.dcp_size, lay.dcp_rank, lay.page_size
    start = prefix_pages * ps * n
    tokens = np.arange(start + (d - start) % n, num_tokens, n, dtype=np.int64)
    local = tokens // n - prefix_pages * ps
    dst = np.asarray(pages[prefix_pages:], dtype=np.int64)
    return dst[local // ps] * ps + local % ps, tokens


def fill_dcp(r: dict, pattern: KVPattern, tensors, pages: np.ndarray) -> None:
    """A prefill rank of a DCP group (room spec dcp_tokens): each of its local slots gets the
    pattern of the token it holds."""
    slots, tokens = dcp_slots(pattern, pages, r["dcp_tokens"])
    pattern.fill_tokens(tensors, r.get("pattern_key", r["room"]), slots, tokens)


def check_dcp(st: dict, pattern: KVPattern, tensors, rec: dict) -> str | None:
    """Decode context parallel (room spec dcp_tokens: the request's token count): this rank's
    local slot s past its prefix holds token s * dcp_size + dcp_rank, bit-exact, and every other
    slot of its pages past the prefix (the final partial page's tail) is still zero
    (rec["dcp_rest_untouched"])."""
    lay = pattern.layout
    ps, k = lay.page_size, prefix_of(st)
    slots, tokens = dcp_slots(pattern, st["pages"], st["spec"]["dcp_tokens"], k)
    dst = np.asarray(st["pages"][k:], dtype=np.int64)
    every = (dst[:, None] * ps + np.arange(ps)).ravel()
    rest = torch.as_tensor(np.setdiff1d(every, slots))
    rec["dcp_tokens"] = int(tokens.size)
    rec["dcp_rest_untouched"] = all(bool((t.view(torch.uint8).view(-1, lay.token_bytes)[rest] == 0).all())
                                    for t in tensors)
    return pattern.check_tokens(tensors, st["spec"].get("pattern_key", st["room"]), slots, tokens)


_HOG_STOP = threading.Event()


def gil_hog() -> None:
    """A tight pure-Python loop with no sleep and no I/O: it holds the GIL except when the
    interpreter makes it drop it, every sys.getswitchinterval() (5 ms by default) while another
    thread waits for it. Every other Python thread of the process (kvstage's control thread
    included) gets the GIL only at those switches, after waiting up to one interval each time it
    comes back from a call that released it; on a machine whose cores are all busy the hog may
    also be descheduled while it holds the GIL, and then nobody runs Python."""
    n = 0
    stop = _HOG_STOP
    while not stop.is_set():   # is_set() reads a flag: no system call, the GIL stays held
        for _ in range(10_000):
            n += 1


def profile_kvstage_threads(out_dir: str) -> Callable[[str], None]:
    """Profile the CPU time of every kvstage thread started from now on (cProfile on
    time.thread_time: time a thread waits for the interpreter or the CPU is not counted); the
    function returned writes one pstats file per thread, named by `role` and the thread."""
    profiles: list[tuple[str, cProfile.Profile]] = []
    lock = threading.Lock()

    def first_call(*_: object) -> None:   # the first profile event of each new thread
        name = threading.current_thread().name
        if not name.startswith("kvstage"):
            sys.setprofile(None)
            return
        prof = cProfile.Profile(time.thread_time)
        with lock:
            profiles.append((name, prof))
        prof.enable()

    threading.setprofile(first_call)

    def dump(role: str) -> None:
        os.makedirs(out_dir, exist_ok=True)
        with lock:
            for i, (name, prof) in enumerate(profiles):
                prof.dump_stats(os.path.join(out_dir, f"{os.getpid()}-{role}-{name}-{i}.prof"))

    return dump


def main() -> int:
    faulthandler.enable()  # a crash in native code (NIXL, UCX, Mooncake) leaves every thread's stack in the log
    spec = json.load(open(sys.argv[1]))
    profile_dir = os.environ.get("PD_RANK_PROFILE_DIR")
    dump_profiles = profile_kvstage_threads(profile_dir) if profile_dir else None
    logging.basicConfig(level=getattr(logging, spec.get("log_level", "WARNING")),
                        format="%(asctime)s %(process)d %(threadName)s %(name)s %(levelname)s %(message)s")
    results = [{"name": m.get("name", f"{m['engine']}/{m['rank']}"), "role": m["role"]} for m in spec["managers"]]
    threads = []
    if any(m.get("gil_hog") for m in spec["managers"]):   # before any manager starts its threads
        threading.Thread(target=gil_hog, name="gil-hog", daemon=True).start()
    for m, res in zip(spec["managers"], results):
        def run(m=m, res=res):
            try:
                drive(m, spec["bootstrap"], res)
            except Exception as exc:  # noqa: BLE001 - reported to the test/demo, not swallowed
                res["error"] = f"{type(exc).__name__}: {exc}"
                res["traceback"] = traceback.format_exc()
        threads.append(threading.Thread(target=run, name=f"driver-{m['engine']}-{m['rank']}"))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _HOG_STOP.set()
    if dump_profiles is not None:
        dump_profiles("+".join(sorted({m["role"] for m in spec["managers"]})))
    _write_json(spec["result"], results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
