"""One SGLang scheduler rank, driven through SGLang's real transfer classes for backend kvstage.

Run as a process by test_scheduler_classes.py: it publishes SGLang's runtime config for its TP
rank, loads SGLang's plugins (so kvstage's classes come from get_kv_class, as in a server),
builds KVArgs over its own KV cache and SGLang's real MetadataBuffers (raw pointers, as a
scheduler does), then plays the requests of a scenario the way SGLang's prefill or decode
scheduler drives a backend, and writes what happened per room as JSON.

KV contents are a pattern of (room, layer, K/V, global head, token), so each side checks the
bytes on its own: prefill writes it, decode compares every byte it received, and checks that
every page no successful request owns still holds the sentinel (no byte in a wrong page). With
"state" in the scenario the ranks also hold SGLang state components (state_harness.py): Mamba
slots and SWA window pages (with "mla" and state "mamba_only": Mamba slots beside MLA layers, a
hybrid MLA pool as Kimi Linear's), named per request with state_indices on both sides, checked alike.
With "draft" the ranks also hold a speculative-decoding draft model's KV, appended to KVArgs after
the target's as SGLang appends it (num_draft_entries), filled and checked like the target's; the
aux row carries the draft's hidden states and top-k as well. draft["model"]: the draft model's
directory (its config names its KV heads), set as SGLang's speculative_draft_model_path. With
"prefill_pp" the prefill is pipeline-parallel (pp_stage.py): --rank is the world rank (PP rank x
TP + TP rank), each stage holds its layers only, over SGLang's real process groups. With
"prefill_cp" the prefill has attention context parallelism (SGLang's --enable-prefill-cp): --tp
is CP x attention TP, and every CP rank holds the whole KV of its heads; with "layer_split" too
(SGLang's DSA cache layer split) each CP rank holds only its range of the layers
(get_layer_shard_range), lists those in its KVArgs with prefill_start_layer at the first, and
sends them. With "decode_dcp" the
decode has decode context parallel (SGLang's --dcp-size, MLA): DCP rank r (attention TP rank mod
N) holds the request's tokens t with t % N == r, at local slot t // N; a request's "tokens" (its
prompt length, which the plugin's hooks hand to the sender and the receiver) may end inside a
page, and each decode rank checks the tokens it owns and that the rest of its pages still hold
the sentinel. With "kv_shard" the prefill (MLA, its ServerArgs with SGLang's
--enable-kv-cache-sharding) holds logical page l on attention TP rank l % N at local page l // N,
writes only the pages it owns, and every rank sends the same logical page ids, as SGLang's
scheduler does. With "prefill_complete" both sides run SGLang's prefill_complete allocation
policy ("decode": the decode only, a deployment whose roles disagree): the decode announces each
room at init() and must not poll WaitingForInput before the
prefill called mark_prefill_complete() (the prefill writes a `marking-ROOM` file in the sync
folder just before; a request's "mark_after" rooms are marked only once the decode finished
them, a `done-ROOM` file), and the prefill must not see the decode's metadata before it marked.

The KV device is data (scenario "device": "cpu", the default, or "cuda"): the KV, draft and state
tensors live there (GPU 0: ServerArgs(device=...), KVArgs.gpu_id) and their patterns are built
and compared there, while the aux rows stay in host memory, where SGLang's MetadataBuffers keeps
them beside a CUDA KV cache. On CUDA every fill is synchronised before the send that names it
(the forward pass has finished, as SGLang's schedule guarantees), except the overlap schedule's
early chunk: it is written on a side stream behind a sleeping kernel and a real CUDA event
recorded after it is the sender's `_early_send_wait_event` (`CudaForwardDone`); on CPU the
stand-in `ForwardDone` writes those pages when it is waited on.

    python rank.py --role prefill --tp 2 --rank 0 --scenario s.json --out r.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from decode_queue import decode_request, init_gloo, make_queue, pages_hold  # noqa: E402
from pp_stage import init_groups, run_prefill_pp, stage_layers  # noqa: E402
from state_harness import StateSide  # noqa: E402

SENTINEL = -12345
# what a rank reports beside its rooms: its KV and aux devices, and the kvstage it imported
RANK_INFO: dict = {}
# the "forward pass" still running when an early chunk is sent on CUDA (torch.cuda._sleep cycles:
# tens of milliseconds on a current GPU, far longer than a transfer reading the pages would take)
FORWARD_CYCLES = 100_000_000


def pattern(room: int, layer: int, kv: int, heads, tokens, head_dim: int, device="cpu") -> torch.Tensor:
    t = torch.as_tensor(tokens, dtype=torch.int64, device=device)[:, None, None]
    h = torch.as_tensor(heads, dtype=torch.int64, device=device)[None, :, None]
    d = torch.arange(head_dim, dtype=torch.int64, device=device)[None, None, :]
    x = (room % 9973) * 7919 + layer * 613 + kv * 307 + h * 101 + t * 13 + d
    return (x % 65521 - 32760).to(torch.int16)


def aux_ids(room: int) -> torch.Tensor:
    return torch.tensor([(room >> (4 * i)) & 0x7FFF for i in range(16)], dtype=torch.int32)


class Rank:
    def __init__(self, a, sc, kv: tuple[list, list] | None = None):
        """`kv`: the (K, V) tensors of the rank this one replaces in its process (a PD role
        switch: SGLang keeps the KV pool and builds the other role's transfer classes over it);
        None: new ones."""
        from sglang.srt.plugins import load_plugins
        load_plugins()                       # kvstage's plugin: backend choice + get_kv_class hook
        from sglang.srt.disaggregation.utils import (
            DisaggregationMode,
            KVClassType,
            MetadataBuffers,
            TransferBackend,
            get_kv_class,
        )
        from sglang.srt.runtime_context import SpawnRanks, publish
        from sglang.srt.server_args import ServerArgs

        self.a, self.sc = a, sc
        self.prefill = a.role == "prefill"
        self.ps, self.H, self.hd = sc["page_size"], sc["heads"], sc["head_dim"]
        # PP: --rank is the world rank; the stage holds its layers (base: the first)
        self.pp = int(sc.get(f"{a.role}_pp") or 1)
        tp_rank, self.pp_rank = a.rank % a.tp, a.rank // a.tp
        self.stage = stage_layers(sc["layers"], self.pp_rank, self.pp)
        self.layers = len(self.stage)
        self.mla = bool(sc.get("mla"))     # one latent "head", the same on every rank; no V
        # DP attention (scenario "<role>_dp"): tp ranks = dp x attention TP, heads split over attention TP
        self.dp = int(sc.get(f"{a.role}_dp") or 1)
        # prefill attention CP (scenario "prefill_cp"): tp ranks = dp x CP x attention TP, each CP rank
        # holding the whole KV of its attention TP rank's heads (SGLang's default: CP rank 0 sends)
        self.cp = int(sc.get(f"{a.role}_cp") or 1)
        self.attn_tp = a.tp // self.dp // self.cp
        self.attn_rank, self.cp_rank = tp_rank % self.attn_tp, tp_rank // self.attn_tp % self.cp
        self.dp_rank = tp_rank // (self.attn_tp * self.cp)
        # DSA cache layer split (scenario "layer_split", a CP prefill): each CP rank holds its layers only
        self.layer_split = bool(sc.get("layer_split")) and self.prefill and self.cp > 1
        if self.layer_split:
            from sglang.srt.layers.cp.utils import get_layer_shard_range
            self.stage = range(*get_layer_shard_range(self.cp_rank, self.cp, sc["layers"]))
            self.layers = len(self.stage)
        # decode context parallel (scenario "decode_dcp"): SGLang's DCP rank is the attention TP rank mod N
        self.dcp = int(sc.get(f"{a.role}_dcp") or 1)
        self.dcp_rank = self.attn_rank % self.dcp
        self.local = 1 if self.mla else self.H // self.attn_tp
        self.heads = [0] if self.mla else list(range(self.attn_rank * self.local, (self.attn_rank + 1) * self.local))
        self.num_pages = sc["num_pages"]
        self.device = kv_device(sc.get("device", "cpu"))
        cp = {"attn_cp_size": self.cp, "enable_prefill_cp": True, "cp_strategy": "interleave"} if self.cp > 1 else {}
        if self.dcp > 1:
            cp["dcp_size"] = self.dcp
        # KV cache sharding (scenario "kv_shard", prefill, MLA): logical page l on attention TP rank
        # l % N at local page l // N; SGLang resolves it with the fa3 attention backend (never run here)
        self.shards = self.attn_tp if sc.get("kv_shard") and self.prefill else 1
        if self.shards > 1:
            cp.update(enable_kv_cache_sharding=True, attention_backend="fa3")
        sa = ServerArgs(model_path=sc["model"], tp_size=a.tp, pp_size=self.pp, dp_size=self.dp,
                        enable_dp_attention=self.dp > 1, **cp,
                        disaggregation_mode=a.role,
                        disaggregation_transfer_backend="kvstage", disaggregation_bootstrap_port=sc["bootstrap_port"],
                        device=self.device.type, host="127.0.0.1", port=sc["http_port"] + (0 if self.prefill else 1),
                        skip_tokenizer_init=True, page_size=self.ps,
                        disaggregation_decode_allocation_policy="prefill_complete"
                        if sc.get("prefill_complete") in (True, a.role) else "early")
        if (sc.get("draft") or {}).get("model"):   # a draft model of its own: SGLang's speculative server args
            sa.speculative_algorithm, sa.speculative_draft_model_path = "EAGLE", sc["draft"]["model"]
            sa.speculative_eagle_topk, sa.speculative_num_steps, sa.speculative_num_draft_tokens = 1, 1, 2
        publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=a.rank))
        init_groups(a, self.pp, self.attn_rank, self.attn_tp, sc["gloo"] + f"-{a.role}-pp", self.cp_rank, self.cp,
                    kv_shard=self.shards > 1)
        if self.layer_split:   # SGLang resolves the flag for a DSA model only (whose config's resolution stops
            # at CUDA device queries on this machine): set as its resolution sets it, in the parallel state
            from sglang.srt.runtime_context import get_parallel
            get_parallel().override_permanently(enable_dsa_cache_layer_split=True)
        backend = TransferBackend("kvstage")
        tokens = self.num_pages * self.ps
        dev = self.device
        self.k = kv[0] if kv else [torch.full((tokens, self.local, self.hd), 0, dtype=torch.bfloat16, device=dev)
                                   for _ in range(self.layers)]
        self.v = kv[1] if kv else [] if self.mla else [
            torch.full((tokens, self.local, self.hd), 0, dtype=torch.bfloat16, device=dev) for _ in range(self.layers)]
        self.sets = [KVSet(base=self.stage.start, k=self.k, v=self.v, heads=self.heads, hd=self.hd)]
        # speculative decoding: the draft model's KV, appended after the target's (on decode always;
        # on prefill unless draft["prefill"] is false: decode-only speculation); under PP on the last
        # stage only, where SGLang runs the draft worker (Scheduler.maybe_init_draft_worker)
        draft = sc.get("draft") if self.stage.stop == sc["layers"] else None
        if draft and (not self.prefill or draft.get("prefill", True)):
            # fewer draft heads than attention TP ranks: each is replicated on consecutive ranks
            local = 1 if self.mla else max(1, draft["heads"] // self.attn_tp)
            first = self.attn_rank // max(1, self.attn_tp // draft.get("heads", 1)) * local
            heads = [0] if self.mla else list(range(first, first + local))
            make = lambda: [torch.empty((tokens, local, draft["head_dim"]), dtype=torch.bfloat16, device=dev)
                            for _ in range(draft["layers"])]
            self.sets.append(KVSet(base=100, k=make(), v=[] if self.mla else make(), heads=heads,
                                   hd=draft["head_dim"], written=draft.get("prefill", True)))
        # host KV destinations (scenario "host", decode): SGLang's host pool, the KV's layout with
        # twice the pages; a request with "host" gets its KV there (destination HOST)
        self.host_set = None
        if sc.get("host") and not self.prefill:
            make = lambda: [torch.empty((2 * tokens, self.local, self.hd), dtype=torch.bfloat16)
                            for _ in range(self.layers)]
            self.host_set = KVSet(base=0, k=make(), v=[] if self.mla else make(), heads=self.heads, hd=self.hd)
        for kv_set in self.sets + ([self.host_set] if self.host_set else []):
            for t in kv_set.k + kv_set.v:
                t.view(torch.int16).fill_(SENTINEL)
        self.sync()
        # SGLang's aux rows: host memory beside a CUDA KV cache as beside a CPU one
        self.meta = MetadataBuffers(size=32, hidden_size=8, hidden_states_dtype=torch.float32,
                                    max_sampling_mask_tokens=4)
        import kvstage
        RANK_INFO.update(kv_device=str(self.k[0].device), aux_device=str(self.meta.output_ids.device),
                         kvstage=kvstage.__file__)
        args = get_kv_class(backend, KVClassType.KVARGS)()
        bufs = [t for kv_set in self.sets for t in kv_set.k + kv_set.v]   # target K, V, then draft K, V
        args.engine_rank, args.pp_rank, args.system_dp_rank = self.attn_rank, self.pp_rank, 0
        args.kv_data_ptrs = [t.data_ptr() for t in bufs]
        args.kv_data_lens = [t.nbytes for t in bufs]
        args.kv_item_lens = [t[: self.ps].nbytes for t in bufs]
        args.kv_layer_ids = [] if self.pp > 1 or self.layer_split else [   # SGLang's build_kv_layer_ids: none for a plain pool
            self.layers * (s.name == "draft") + layer for s in self.sets for _, ts in s.kinds() for layer in range(len(ts))]
        args.kv_cache_dtype_str = "bfloat16"
        args.page_size = self.ps
        if self.prefill:   # as SGLang's schedulers: only the prefill side fills the head counts
            args.kv_head_num, args.total_kv_head_num = self.local, self.H
        args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = self.meta.get_buf_infos()
        args.state_types, args.state_data_ptrs, args.state_data_lens, args.state_item_lens = [], [], [], []
        args.state_layer_ids, args.state_dim_per_tensor, args.state_slice_outer_counts = [], [], []
        args.state_conv_shard_groups, args.swa_kv_cache_layout = [], None
        self.state = None
        if sc.get("state"):
            self.state = StateSide(sc["state"], a.tp, a.rank, self.local * a.tp, self.hd, self.ps, self.num_pages,
                                   decode=not self.prefill, device=self.device, layers=self.stage)
            self.state.kv_args(args)
        if self.host_set is not None:
            host = self.host_set.k + self.host_set.v
            args.host_kv_data_ptrs = [t.data_ptr() for t in host]
            args.host_kv_data_lens = [t.nbytes for t in host]
            args.host_kv_item_lens = [t[: self.ps].nbytes for t in host]
        args.ib_device, args.gpu_id = None, self.device.index or 0
        # as PrefillBootstrapQueue: the pool's start_layer, and its end_layer (None on a pool without
        # PP); SGLang's decode fills neither (a PP decode stage's KVArgs name no start layer)
        if self.prefill or self.pp == 1:
            args.prefill_start_layer, args.prefill_end_layer = self.stage.start, (
                self.stage.stop if self.pp > 1 or self.layer_split else None)
        args.num_draft_entries = sum(len(s.k) + len(s.v) for s in self.sets[1:])
        # a hybrid pool of MLA layers (Kimi Linear): SGLang's is_mla_backend is False for the pool as a
        # whole, and KVArgs say its full-attention layers are MLA
        hybrid_mla = self.mla and bool((sc.get("state") or {}).get("mamba_only"))
        args.is_hybrid_mla_backend = hybrid_mla
        mode = DisaggregationMode.PREFILL if self.prefill else DisaggregationMode.DECODE
        if self.prefill and sc.get("hold"):   # this rank's writes of one room land hold["s"] late
            from functools import partial

            from kvstage.adapters.sglang import conn
            conn.EngineConfig = partial(conn.EngineConfig, faults={"hold_write_rooms": [sc["hold"]["room"]],
                                                                   "hold_write_s": sc["hold"]["s"]})
        self.mgr = get_kv_class(backend, KVClassType.MANAGER)(args, mode, sa, self.mla and not hybrid_mla)
        self.Sender = get_kv_class(backend, KVClassType.SENDER)
        self.Receiver = get_kv_class(backend, KVClassType.RECEIVER)
        self.addr = f"127.0.0.1:{sc['bootstrap_port']}"
        from sglang.srt.disaggregation.base.conn import KVPoll
        self.P = KVPoll

    # -- KV contents ------------------------------------------------------------------------
    def sync(self) -> None:
        """On CUDA: every kernel this rank queued has finished (the forward pass wrote its pages)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def fill(self, room: int, pages, first_token: int, *, wait: bool = True) -> None:
        """Writes the pattern of `room` into `pages`; `wait`: synchronised before it returns (on
        CUDA; the early chunk's fill on a side stream does not wait). Under KV cache sharding
        `pages` are logical: this rank writes those it owns, at their local pages."""
        for i, logical in enumerate(pages):
            if logical % self.shards != self.attn_rank % self.shards:
                continue
            page = logical // self.shards
            tokens = range(first_token + i * self.ps, first_token + (i + 1) * self.ps)
            for s in self.sets:
                for layer in range(len(s.k)):
                    for kv, bufs in s.kinds():
                        bufs[layer].view(torch.int16)[page * self.ps:(page + 1) * self.ps] = pattern(
                            room, s.base + layer, kv, s.heads, tokens, s.hd, self.device)
        if wait:
            self.sync()

    def check(self, room: int, pages, first_token: int, sets=None) -> list[str]:
        bad = []
        for i, page in enumerate(pages):
            tokens = range(first_token + i * self.ps, first_token + (i + 1) * self.ps)
            for s in sets or self.sets:
                if not s.written:      # decode-only speculation: nothing of the draft comes
                    continue
                for layer in range(len(s.k)):
                    for kv, bufs in s.kinds():
                        got = bufs[layer].view(torch.int16)[page * self.ps:(page + 1) * self.ps]
                        if not torch.equal(got, pattern(room, s.base + layer, kv, s.heads, tokens, s.hd, got.device)):
                            bad.append(f"room {room} page {page} {s.name} layer {layer} {'KV'[kv]} differs")
        return bad

    def fill_dcp(self, room: int, pages, prefix_tokens: int, tokens: int) -> None:
        """A prefill with decode context parallel (DCP N -> N): slot s of this rank's `pages` (its
        local slots from prefix_tokens // N on) holds global token (local slot) * N + DCP rank;
        the slots past the request's end get the pattern of the token they would hold (not the
        sentinel), so a decode slot written past the end is told apart."""
        for i, page in enumerate(pages):
            local = prefix_tokens // self.dcp + i * self.ps + torch.arange(self.ps)
            ids = (local * self.dcp + self.dcp_rank).tolist()
            for s in self.sets:
                for layer in range(len(s.k)):
                    for kv, bufs in s.kinds():
                        bufs[layer].view(torch.int16)[page * self.ps:(page + 1) * self.ps] = pattern(
                            room, s.base + layer, kv, s.heads, ids, s.hd, self.device)
        self.sync()

    def check_dcp(self, room: int, pages, prefix_tokens: int, tokens: int) -> list[str]:
        """Decode context parallel: slot s of this rank's `pages` (its local slots from
        prefix_tokens // N on) holds global token (local slot) * N + DCP rank: its pattern where
        that token is below `tokens`, the sentinel past the request's end."""
        bad = []
        for i, page in enumerate(pages):
            local = prefix_tokens // self.dcp + i * self.ps + torch.arange(self.ps)
            ids = local * self.dcp + self.dcp_rank
            mine = ids < tokens
            for s in self.sets:
                for layer in range(len(s.k)):
                    for kv, bufs in s.kinds():
                        got = bufs[layer].view(torch.int16)[page * self.ps:(page + 1) * self.ps]
                        want = pattern(room, s.base + layer, kv, s.heads, ids.tolist(), s.hd, got.device)
                        if not torch.equal(got[mine], want[mine]):
                            bad.append(f"room {room} page {page} {s.name} layer {layer} {'KV'[kv]} differs")
                        if not bool((got[~mine] == SENTINEL).all()):
                            bad.append(f"room {room} page {page} {s.name} layer {layer} {'KV'[kv]}: a slot past "
                                       f"token {tokens} was written")
        return bad

    def untouched(self, owned: set, sets=None) -> list[str]:
        bad = []
        for s in sets or self.sets:
            for page in range(s.k[0].shape[0] // self.ps):
                if page in owned and s.written:
                    continue
                for bufs in (s.k, s.v):
                    for layer, t in enumerate(bufs):
                        if not bool((t.view(torch.int16)[page * self.ps:(page + 1) * self.ps] == SENTINEL).all()):
                            bad.append(f"page {page} {s.name} layer {layer} was written but no successful room owns it")
        return bad


@dataclass(kw_only=True)
class KVSet:
    """The target's KV (base: its first layer in the pattern, a PP stage's start) or the draft
    model's (base 100); `written`: whether the prefill side has it (not with decode-only speculation)."""

    base: int
    k: list
    v: list
    heads: list
    hd: int
    written: bool = True

    @property
    def name(self) -> str:
        return "draft" if self.base >= 100 else "target"

    def kinds(self) -> tuple:
        return ((0, self.k), (1, self.v)) if self.v else ((0, self.k),)


def spec_aux(room: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the prefill puts in a request's aux row for the draft: hidden states, top-k p and ids."""
    g = torch.Generator().manual_seed(room % (1 << 31))
    return torch.rand(8, generator=g), torch.rand(16, generator=g), torch.randint(0, 1 << 40, (16,), generator=g)


def kv_device(name: str) -> torch.device:
    """The scenario's KV device: "cpu", or "cuda" (GPU 0, made this process's current device)."""
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda":
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)
    raise ValueError(f"scenario device must be cpu or cuda, not {name!r}")


class ForwardDone:
    """Stands for the CUDA event SGLang's overlap schedule puts on a sender before an early
    send: the pages are written when it is waited on (as if the forward pass finished then),
    and the waiting thread is recorded."""

    def __init__(self, x: dict, write):
        self.x, self.write = x, write

    def synchronize(self) -> None:
        self.x["event_thread"] = threading.current_thread().name
        self.write()


class CudaForwardDone(torch.cuda.Event):
    """A real CUDA event, as SGLang's overlap schedule puts on a sender before an early send:
    recorded on a side stream after a sleeping kernel (the forward pass still running) and the
    fill of the early chunk's pages, so the pages hold the sentinel until it completes. Waiting
    on it records the waiting thread, then waits as a CUDA event does."""

    def __init__(self, x: dict):
        super().__init__()
        self.x = x

    def synchronize(self) -> None:
        self.x["event_thread"] = threading.current_thread().name
        super().synchronize()


def early_event(r: Rank, x: dict, write):
    """The event an early send waits on: `write` (the early chunk's fill) happens when it is
    waited on (CPU), or once the side stream's sleeping kernel is done (CUDA)."""
    if r.device.type != "cuda":
        return ForwardDone(x, write)
    stream = torch.cuda.Stream(device=r.device)
    stream.wait_stream(torch.cuda.current_stream(r.device))
    event = CudaForwardDone(x)
    with torch.cuda.stream(stream):
        torch.cuda._sleep(FORWARD_CYCLES)
        write()
        event.record(stream)
    x["event_pending"] = not event.query()   # still running when SGLang sends
    return event


def run_prefill(r: Rank, sc, out) -> None:
    P, rows = r.P, iter(range(1, 32))
    reqs = []
    pages, swa_pages = iter(range(1, r.num_pages)), iter(range(1, r.num_pages))
    for i, q in enumerate(sc["requests"]):
        if q.get("dp_rank", 0) != r.dp_rank:      # the router sent it to another prefill DP rank
            continue
        reqs.append({"q": q, "s": r.Sender(r.mgr, r.addr, q["room"]), "made": time.monotonic(), "st": "boot",
                     "row": next(rows),
                     "pages": [next(pages) for _ in range(q["pages"])], "slot": 1 + i})
    deadline = time.monotonic() + sc["deadline_s"]
    # die_at_room: the rank dies once that request is ready for its KV, after every request before
    # it ended and before any after it started (each room's outcome is then known on decode)
    die = next((i for i, q in enumerate(sc["requests"]) if q["room"] == sc.get("die_at_room")), None)
    errors: list[str] = []
    while any(x["st"] != "done" for x in reqs) and time.monotonic() < deadline:
        for i, x in enumerate(reqs):
            q, s = x["q"], x["s"]
            if x["st"] == "done" or (die is not None and i > die):
                continue
            st = s.poll()
            if sc.get("prefill_complete") is True and x["st"] == "boot" and not x.get("marked"):
                if st == P.WaitingForInput:
                    errors.append(f"room {q['room']}: the decode's metadata came before the prefill completed it")
                elif st == P.Bootstrapping and mark_now(sc, q, time.monotonic() - x["made"]):
                    x["marked"] = True
                    if q.get("abort") == "prefill-early":   # the prefill fails it before it completes
                        s.abort()
                    else:
                        (Path(sc["sync"]) / f"marking-{q['room']}").touch()
                        s.mark_prefill_complete()
                    continue
            if x["st"] == "boot" and st == P.WaitingForInput:
                if i == die:
                    if any(y["st"] != "done" for y in reqs[:die]):
                        continue
                    os.kill(os.getpid(), signal.SIGKILL)   # a prefill rank dies mid-request
                # SGLang's pages here: a DCP prefill's are its virtual pages of page_size x N tokens
                k = s.pop_decode_prefix_len() // (r.ps * r.dcp)
                x["prefix_seen"] = k
                suffix = x["pages"][k:]
                if r.shards > 1:   # KV cache sharding: the logical pages of the request this rank holds
                    x["owned"] = sum(1 for page in suffix if page % r.shards == r.attn_rank)
                # early_event: the first chunk's KV is written by "the previous forward pass",
                # finished when SGLang's event completes: kvstage must wait for it before reading
                late = q["chunks"][0] if q.get("early_event") else 0
                if r.dcp > 1:
                    r.fill_dcp(q["room"], suffix, k * r.ps * r.dcp, q["tokens"])
                else:
                    r.fill(q["room"], suffix[late:], (k + late) * r.ps)
                r.meta.output_ids[x["row"]] = aux_ids(q["room"])
                r.meta.bootstrap_room[x["row"], 0] = q["room"]
                hidden, topk_p, topk_ids = spec_aux(q["room"])
                r.meta.output_hidden_states[x["row"]], r.meta.output_topk_p[x["row"]] = hidden, topk_p
                r.meta.output_topk_index[x["row"]] = topk_ids
                state = None
                if r.state is not None:   # SGLang names the state with the last send only
                    w = min(sc["state"]["swa_pages"], len(suffix))
                    x["swa"] = [next(swa_pages) for _ in range(w)]
                    r.state.fill(q["room"], x["slot"], x["swa"], q["pages"] - w)
                    state = r.state.indices(x["slot"], x["swa"])
                if q.get("tokens") is not None:   # as the plugin's hook before finalize_bootstrap
                    s.request_tokens = q["tokens"]
                s.init(len(suffix), x["row"])
                if q.get("abort") == "prefill":
                    s.abort()
                else:
                    done = 0
                    if late:
                        s._early_send_wait_event = early_event(r, x, lambda room=q["room"], pages=suffix[:late],
                                                               first=k * r.ps: r.fill(room, pages, first, wait=False))
                    for c, n in enumerate(q["chunks"]):
                        last = c == len(q["chunks"]) - 1
                        s.send(np.asarray(suffix[done:done + n], dtype=np.int32), state if last else None)
                        done += n
                        # streamed: a write leaves before the last send (a DCP split is written once
                        # the last send is in, docs/protocol.md, "Decode context parallel"; an MLA
                        # prefill of several attention TP ranks has ranks that write nothing)
                        if not last and state is not None and sc["decode_dcp"] == 1 and not (r.mla and r.attn_tp > 1):
                            x["streamed"] = wait_first_write(s, time.monotonic() + 20)
                if q.get("abort") == "prefill-held":   # fail the request while its write is in flight
                    injected = r.mgr.engine._backend.backend.injected
                    while not injected.get("held_write") and time.monotonic() < deadline:
                        time.sleep(0.005)
                    x["held"] = bool(injected.get("held_write"))
                    s.abort()
                x["st"] = "sent"
            elif st in (P.Success, P.Failed):
                x["result"] = "Success" if st == P.Success else "Failed"
                if st == P.Failed:
                    try:
                        s.failure_exception()
                    except Exception as exc:  # noqa: BLE001 - the harness records what was raised
                        x["error"] = f"{type(exc).__name__}: {exc}"
                s.clear()
                m = s.get_transfer_metric()
                x["bytes"] = m.transfer_total_bytes
                x["st"] = "done"
        time.sleep(0.002)
    report(out, reqs, errors)


def mark_now(sc, q, waited_s: float) -> bool:
    """prefill_complete: whether the prefill may complete request `q` now: once the decode finished
    every room of its "mark_after" (a `done-ROOM` file each), and `waited_s` since its sender was
    made reached its "mark_after_s" (a prefill that queued and computed that long)."""
    return waited_s >= q.get("mark_after_s", 0) and all(
        (Path(sc["sync"]) / f"done-{room}").exists() for room in q.get("mark_after", ()))


def wait_first_write(sender, deadline: float) -> bool:
    """Whether the request's first backend write was posted (its kvstage timeline says so)
    before the deadline."""
    handle = sender._handle
    while time.monotonic() < deadline and handle.poll().name != "Failed":
        if handle._status.timeline.timeline().first_write is not None:
            return True
        time.sleep(0.005)
    return False


def wait_parallel_info(r: Rank, deadline: float) -> None:
    """As SGLang's decode scheduler: the prefill instance's topology, before any receiver."""
    while not r.mgr.try_ensure_parallel_info(r.addr):
        if time.monotonic() > deadline:
            raise TimeoutError("prefill parallel info never became available")
        time.sleep(0.1)


def prefill_stage_popped(r: Rank, room: int) -> bool:
    """Whether every prefill rank of this decode stage's PP stage has popped the room's decode
    prefix (pp_stage.prefix_arrives_after_pop: a prefill stage past the first, told by PP rank
    0's poll that the request may start before its own decode stage sent its metadata)."""
    tp = len(list(Path(r.sc["sync"]).glob(f"popped-{room}-*")))
    return tp == r.sc["prefill_tp"]


def run_decode(r: Rank, sc, out) -> None:
    P = r.P
    deadline = time.monotonic() + sc["deadline_s"]
    wait_parallel_info(r, deadline)
    from sglang.srt.disaggregation.base.conn import KVTransferDestination
    rows, pages = iter(range(1, 32)), iter(range(1, r.num_pages))
    host_pages = iter(range(2 * r.num_pages - 1, 0, -3))     # the host pool's: spread, from its end
    swa_pages = iter(range((r.state.num_pages if r.state else r.num_pages) - 1, 0, -1))   # not prefill's pages
    reqs = []
    for i, q in enumerate(sc["requests"]):
        if q.get("decode_dp", 0) != r.dp_rank:    # another decode DP rank serves it
            continue
        rec = r.Receiver(r.mgr, r.addr, q["room"])
        rec.init(q.get("dp_rank", 0))
        if q.get("abort") == "decode-early":   # before its metadata (prefill_complete: while it waits)
            rec.abort()
        # under DCP each rank gets the request's virtual pages of page_size x N tokens past the prefix
        n = (q["pages"] - q["prefix"] if r.dcp == 1
             else -(-(q["tokens"] - q["prefix"] * r.ps) // (r.ps * r.dcp)))
        reqs.append({"q": q, "r": rec, "st": "boot", "row": next(rows),
                     "pages": [next(host_pages if q.get("host") else pages) for _ in range(n)],
                     "slot": sc["state"]["slots"] - 1 - i if r.state is not None else None})
    errors: list[str] = []
    owned: set = set()
    owned_host: set = set()
    owned_slots, owned_swa = set(), set()
    while any(x["st"] != "done" for x in reqs) and time.monotonic() < deadline:
        for x in reqs:
            q, rec = x["q"], x["r"]
            if x["st"] == "done":
                continue
            st = rec.poll()
            if x["st"] == "boot" and st == P.WaitingForInput:
                if sc.get("prefill_complete") is True and not (Path(sc["sync"]) / f"marking-{q['room']}").exists():
                    errors.append(f"room {q['room']}: WaitingForInput before the prefill completed it")
                if q.get("late_meta") and r.pp_rank > 0 and not prefill_stage_popped(r, q["room"]):
                    continue   # its metadata waits until this stage's prefill ranks popped the prefix
                state = None
                if r.state is not None:
                    w = min(sc["state"]["swa_pages"], len(x["pages"])) - (1 if q.get("swa_short") else 0)
                    x["swa"], x["first_swa"] = [next(swa_pages) for _ in range(w)], q["pages"] - w
                    state = r.state.indices(x["slot"], x["swa"])
                where = KVTransferDestination.HOST if q.get("host") else KVTransferDestination.DEVICE
                x["supports_host"] = bool(rec.supports_host_destination)
                if q.get("tokens") is not None:   # as the plugin's hook before _send_kv_metadata
                    rec.request_tokens = q["tokens"]
                rec.send_metadata(np.asarray(x["pages"], dtype=np.int32), x["row"], state,
                                  decode_prefix_len=q["prefix"] * r.ps, destination=where)
                if q.get("abort") == "decode":
                    rec.abort()
                x["st"] = "meta"
            elif st in (P.Success, P.Failed):
                x["result"] = "Success" if st == P.Success else "Failed"
                if st == P.Success and q.get("host"):
                    owned_host.update(x["pages"])
                    errors += r.check(q["room"], x["pages"], q["prefix"] * r.ps, sets=[r.host_set])
                elif st == P.Success and r.dcp > 1:
                    owned.update(x["pages"])
                    errors += r.check_dcp(q["room"], x["pages"], q["prefix"] * r.ps, q["tokens"])
                elif st == P.Success:
                    owned.update(x["pages"])
                    errors += r.check(q["room"], x["pages"], q["prefix"] * r.ps)
                if st == P.Success:
                    x["aux_room"] = int(r.meta.bootstrap_room[x["row"], 0])
                    x["aux_ids_ok"] = bool(torch.equal(r.meta.output_ids[x["row"]], aux_ids(q["room"])))
                    hidden, topk_p, topk_ids = spec_aux(q["room"])
                    x["aux_spec_ok"] = bool(torch.equal(r.meta.output_hidden_states[x["row"]], hidden)
                                            and torch.equal(r.meta.output_topk_p[x["row"]], topk_p)
                                            and torch.equal(r.meta.output_topk_index[x["row"]], topk_ids))
                    if r.state is not None:
                        owned_slots.add(x["slot"])
                        owned_swa.update(x["swa"])
                        x["state_bad"] = r.state.check(q["room"], x["slot"], x["swa"], x["first_swa"])
                        errors += x["state_bad"]
                else:
                    try:
                        rec.failure_exception()
                    except Exception as exc:  # noqa: BLE001
                        x["error"] = f"{type(exc).__name__}: {exc}"
                rec.clear()
                m = rec.get_transfer_metric()
                x["bytes"], x["latency"] = m.transfer_total_bytes, m.transfer_latency_s
                kv = rec._handle.metrics() if rec._handle is not None else None   # the path kvstage took
                x["path"] = kv.path if kv is not None else None
                x["prefill_engine"] = rec._handle.prefill_engine if rec._handle is not None else None
                x["st"] = "done"
                (Path(sc["sync"]) / f"done-{q['room']}").touch()
        time.sleep(0.002)
    errors += r.untouched(owned)
    if r.host_set is not None:
        errors += r.untouched(owned_host, sets=[r.host_set])
    if r.state is not None:
        errors += r.state.untouched(owned_slots, owned_swa)
    report(out, reqs, errors)


def run_decode_queue(r: Rank, sc, out) -> None:
    """Decode through SGLang's real DecodeTransferQueue (decode_queue.py): a request's pages are
    handed back when SGLang releases them (the harness then rewrites them to the sentinel, as
    the next owner would overwrite them); after the last request, every failed request's kvstage
    receiver is waited on until released (any late write has landed by then), and every page no
    successful request owns must still hold the sentinel."""
    P = r.P
    init_gloo(r.a.tp, r.a.rank, sc["gloo"])
    deadline = time.monotonic() + sc["deadline_s"]
    wait_parallel_info(r, deadline)
    rows, pages = iter(range(1, 32)), iter(range(1, r.num_pages))
    reqs, by_room, errors, owned = [], {}, [], set()
    for q in sc["requests"]:
        rec = r.Receiver(r.mgr, r.addr, q["room"])
        rec.init(q.get("dp_rank", 0))
        x = {"q": q, "r": rec, "st": "boot", "row": next(rows), "kv": rec._handle,
             "pages": [next(pages) for _ in range(q["pages"] - q["prefix"])]}
        reqs.append(x)
        by_room[q["room"]] = x

    def on_release(dr) -> None:
        x = by_room[dr.req.bootstrap_room]
        x["landed_before_release"] = not pages_hold(r.k + r.v, x["pages"], r.ps, SENTINEL)
        for t in r.k + r.v:
            for page in x["pages"]:
                t.view(torch.int16)[page * r.ps:(page + 1) * r.ps] = SENTINEL
        r.sync()     # on CUDA: rewritten before anything can land after the release
        x["released_after_s"] = time.monotonic() - x.get("failed_at", time.monotonic())   # 0: at once

    def on_commit(dr) -> None:
        x = by_room[dr.req.bootstrap_room]
        x["result"] = "Success"
        owned.update(x["pages"])
        nonlocal errors
        errors += r.check(x["q"]["room"], x["pages"], x["q"]["prefix"] * r.ps)
        x["aux_room"] = int(r.meta.bootstrap_room[x["row"], 0])
        x["aux_ids_ok"] = bool(torch.equal(r.meta.output_ids[x["row"]], aux_ids(x["q"]["room"])))

    queue = make_queue(r.meta, on_release, on_commit)
    while time.monotonic() < deadline:
        for x in reqs:
            if x["st"] == "boot" and x["r"].poll() == P.WaitingForInput:
                x["r"].send_metadata(np.asarray(x["pages"], dtype=np.int32), x["row"], None,
                                     decode_prefix_len=x["q"]["prefix"] * r.ps)
                x["dr"] = decode_request(x["q"]["room"], x["r"], x["row"])
                queue.add(x["dr"])
                x["st"] = "queued"
        queue.pop_transferred()
        for x in reqs:
            if x["st"] == "queued" and x["dr"] not in queue.queue:
                x["st"] = "out"
                if x.get("result") != "Success":
                    x["result"], x["failed_at"] = "Failed", time.monotonic()
                    x["error"] = f"KVTransferError: {x['dr'].req.finished_reason.message}"
        queue.resolve_deferred_releases()
        held = {dr.req.bootstrap_room for dr, *_ in queue._deferred_releases}
        if all(x["st"] == "out" for x in reqs) and not held:
            break
        time.sleep(0.002)
    for x in reqs:    # a late write has landed once kvstage released the room
        while x["kv"] is not None and not x["kv"].released and time.monotonic() < deadline:
            time.sleep(0.01)
    errors += r.untouched(owned)
    report(out, reqs, errors)


def report(out: str, reqs, errors) -> None:
    rows = {str(x["q"]["room"]): {k: v for k, v in x.items() if k not in ("q", "s", "r", "pages", "kv", "dr")}
            for x in reqs}
    with open(out + ".tmp", "w") as f:
        json.dump({"rooms": rows, "errors": errors, "rank": RANK_INFO}, f)
    os.replace(out + ".tmp", out)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--role", required=True)
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--scenario", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    sc = json.load(open(a.scenario))
    if sc.get("switch"):
        return run_switch(a, sc)
    try:
        r = Rank(a, sc)
        if r.pp > 1 and r.prefill:
            run_prefill_pp(r, sc, a.out, aux_row=aux_ids, spec_row=spec_aux, report=report)
        else:
            (run_prefill if r.prefill else run_decode_queue if sc.get("queue") else run_decode)(r, sc, a.out)
        if r.prefill:
            # a prefill server outlives its requests: a rank that is done must stay registered
            # until every decode rank has looked the engine up (the test writes this file then)
            deadline = time.monotonic() + sc["deadline_s"]
            while not os.path.exists(sc["release"]) and time.monotonic() < deadline:
                time.sleep(0.05)
        r.mgr.teardown()
        Path(a.out + ".teardown").write_text(json.dumps(left_running(r.mgr)))
    except Exception:  # noqa: BLE001 - the test reads the traceback from the report
        return crashed(a.out)
    return 0


def left_running(mgr) -> dict:
    """What a torn-down manager left running or open (a rank's `--out`.teardown): the kvstage
    threads of this process, and whether SGLang's socket is closed."""
    return {"threads": sorted(t.name for t in threading.enumerate() if t.name.startswith("kvstage")),
            "socket_closed": bool(mgr.server_socket.closed)}


def crashed(out: str) -> int:
    """A rank that raised: its traceback as its report (the test reads it); the exit status."""
    with open(out, "w") as f:
        json.dump({"crash": traceback.format_exc()}, f)
    return 1


def run_switch(a, sc) -> int:
    """A PD role switch (scenario "switch"): this process plays its role for the scenario's
    requests (reported to `--out`.1), tears its manager down as SGLang's role switch does
    (KvstageKVManager.teardown), then plays the other role over the same KV tensors for
    switch["requests"] (reported to `--out`; what the teardown left running, its kvstage threads
    and SGLang's socket, to `--out`.teardown). The old decode builds its prefill first; the old
    prefill builds its decode once that prefill is registered (sync files). The KV keeps what the
    first role left in it; every page is set to the sentinel before the second role starts, as
    a new role's pool holds nothing it may rely on."""
    sync = Path(sc["sync"])

    def play(r: Rank, reqs, out: str) -> None:
        (run_prefill if r.prefill else run_decode)(r, {**sc, "requests": reqs}, out)

    def wait_for(name: str) -> None:
        deadline = time.monotonic() + sc["deadline_s"]
        while not (sync / name).exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} never came")
            time.sleep(0.02)

    try:
        first = Rank(a, sc)
        play(first, sc["requests"], a.out + ".1")
        if first.prefill:          # as a prefill server: registered until its decode is done
            wait_for("decoded-1")
        else:
            (sync / "decoded-1").touch()
        first.mgr.teardown()
        # what the torn-down manager left running or open (`--out`.teardown)
        Path(a.out + ".teardown").write_text(json.dumps(left_running(first.mgr)))
        other = argparse.Namespace(**{**vars(a), "role": "decode" if first.prefill else "prefill"})
        if first.prefill:
            wait_for("prefill-2")
        second = Rank(other, sc, kv=(first.k, first.v))   # sets every page to the sentinel
        if second.prefill:
            (sync / "prefill-2").touch()
        play(second, sc["switch"]["requests"], a.out)
        if second.prefill:
            wait_for("decoded-2")
        else:
            (sync / "decoded-2").touch()
        second.mgr.teardown()
    except Exception:  # noqa: BLE001 - the test reads the traceback from the report
        return crashed(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
