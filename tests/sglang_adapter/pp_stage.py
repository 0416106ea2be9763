"""A pipeline-parallel prefill stage in a harness rank (rank.py, scenario "prefill_pp"), and
the process groups of every harness rank (init_groups; a PP decode, scenario "decode_pp", forms
its own world the same way and drives each stage's receivers as without PP).

The stage processes of one prefill instance form a real torch.distributed world (gloo, over a
file store), and SGLang's own parallel_state builds its process groups on it, as a scheduler
process does: so `get_parallel().pp_group` is SGLang's GroupCoordinator, over which SGLang's
PPConsensusStore (created by CommonKVManager under PP) broadcasts its address, and over which
SGLang's `poll_and_all_reduce_prefill_pp` passes PP rank 0's bootstrap polls down the stages.
A stage holds only its layers, split as SGLang splits them (`get_pp_indices`); its KVArgs list
those layers with `prefill_start_layer` at the first, as SGLang's PrefillBootstrapQueue builds
them from a pool's start_layer/end_layer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace


def init_groups(a, pp: int, attn_rank: int, attn_tp: int, store_file: str, cp_rank: int = 0, cp: int = 1,
                kv_shard: bool = False) -> None:
    """The process groups SGLang's transfer code reads. Under PP, SGLang's own WORLD, TP, PP and
    attention-TP/CP groups over gloo, at the widths the rank published (PPConsensusStore needs a
    real PP group); without, no torch.distributed: the groups as metadata (with prefill attention
    CP, its CP group's too; with KV cache sharding the CP group of one rank, which SGLang's
    get_kv_shard_group reads before it takes an MLA model's attention TP group)."""
    from sglang.srt.runtime_context import get_parallel
    if pp > 1:
        from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
        init_distributed_environment(world_size=a.tp * pp, rank=a.rank, distributed_init_method=f"file://{store_file}",
                                     local_rank=a.rank, backend="gloo")
        initialize_model_parallel(backend="gloo")
        return
    group = lambda rank, size: SimpleNamespace(rank_in_group=rank, world_size=size, is_first_rank=rank == 0,
                                               is_last_rank=rank == size - 1)
    cp_group = {"attn_cp_group": group(cp_rank, cp)} if cp > 1 or kv_shard else {}
    get_parallel().override_permanently(pp_group=group(0, 1), world_group=group(a.rank, a.tp),
                                        tp_group=group(a.rank, a.tp), attn_tp_group=group(attn_rank, attn_tp),
                                        **cp_group)


def stage_layers(num_layers: int, pp_rank: int, pp_size: int) -> range:
    """The layers of PP stage `pp_rank`, as SGLang's model loader assigns them."""
    from sglang.srt.distributed.utils import get_pp_indices
    start, end = get_pp_indices(num_layers, pp_rank, pp_size)
    return range(start, end)


def run_prefill_pp(r, sc, out, *, aux_row: Callable, spec_row: Callable, report: Callable) -> None:
    """SGLang's PP prefill: bootstrap by PP rank 0's polls (kvstage's `poll_pp_consensus`),
    all-reduced over attention TP and passed down the stages (`pop_bootstrapped`); then each
    stage sends its layers of every page in chunks, and only the last stage writes the aux row
    (an earlier stage's row stays empty, so the decode's row can only be the last stage's), but
    for a PP decode (scenario "decode_pp"), which reads a row on every stage: then every stage
    writes its own, as SGLang's send_kv_chunk does. The stage holding a draft (the last) also puts
    the draft's hidden states and top-k in the row (`spec_row`)."""
    from sglang.srt.disaggregation.utils import poll_and_all_reduce_prefill_pp
    from sglang.srt.runtime_context import get_parallel

    P, par = r.P, get_parallel()
    last = par.pp_group.is_last_rank
    pages, r.state_pages = iter(range(1, r.num_pages)), iter(range(1, r.num_pages))
    reqs = [{"q": q, "s": r.Sender(r.mgr, r.addr, q["room"]), "st": "boot", "row": 1 + i, "slot": 1 + i,
             "pages": [next(pages) for _ in range(q["pages"])]} for i, q in enumerate(sc["requests"])]
    queue, sync_work = list(reqs), []
    while queue:   # the polls are PP rank 0's on every stage: all stages leave this loop together
        polls = poll_and_all_reduce_prefill_pp([x["s"] for x in queue], par.attn_cp_group.cpu_group,
                                               par.attn_tp_group.cpu_group, par.pp_group, r.pp_rank, r.pp,
                                               sync_work)
        for x, poll in zip(queue, polls):
            if poll == P.WaitingForInput:
                start_request(r, x, last, aux_row, spec_row)
            elif poll == P.Failed:
                x["st"], x["consensus_failed"] = "sent", True
        queue = [x for x in queue if x["st"] == "boot"]
        time.sleep(0.002)
    for work in sync_work:
        work.work.wait()
    deadline = time.monotonic() + sc["deadline_s"]
    while any(x["st"] != "done" for x in reqs) and time.monotonic() < deadline:
        for x in reqs:    # each stage's own senders, as SGLang's inflight queue polls them
            st = x["s"].poll() if x["st"] == "sent" else None
            if st in (P.Success, P.Failed):
                x["result"] = "Success" if st == P.Success else "Failed"
                if st == P.Failed:
                    try:
                        x["s"].failure_exception()
                    except Exception as exc:  # noqa: BLE001 - the harness records what was raised
                        x["error"] = f"{type(exc).__name__}: {exc}"
                x["s"].clear()
                x["bytes"], x["st"] = x["s"].get_transfer_metric().transfer_total_bytes, "done"
        time.sleep(0.002)
    report(out, reqs, [])


def prefix_arrives_after_pop(r, s, room: int) -> bool:
    """A request made with `late_meta` (the decode also PP): this stage, told WaitingForInput
    by PP rank 0's poll, has popped the decode prefix before its own decode stage sent its
    metadata (held back until every rank of this stage says it popped: rank.py's run_decode);
    wait until that metadata arrived, so SGLang's init() comes after the prefix is known here.
    Whether it arrived."""
    Path(r.sc["sync"], f"popped-{room}-{r.a.rank}").touch()
    deadline = time.monotonic() + r.sc["deadline_s"] / 2
    while s._handle.decode_prefix_pages is None and time.monotonic() < deadline:
        time.sleep(0.005)
    return s._handle.decode_prefix_pages is not None


def start_request(r, x, last: bool, aux_row: Callable, spec_row: Callable) -> None:
    """SGLang's finalize_bootstrap and chunked sends of one request on this stage. A stage past
    the first may be told WaitingForInput before its own sender heard the decode's prefix: it
    then sends the prefix pages too (kvstage skips them), in the first chunk. With state in the
    scenario (DSA pages) each stage names its own layers' state with its last send."""
    import numpy as np

    q, s = x["q"], x["s"]
    k = s.pop_decode_prefix_len() // r.ps
    x["prefix_seen"] = k
    if q.get("late_meta") and r.pp_rank > 0:
        x["prefix_after_pop"] = prefix_arrives_after_pop(r, s, q["room"])
    suffix = x["pages"][k:]
    r.fill(q["room"], suffix, k * r.ps)
    if last or int(r.sc.get("decode_pp") or 1) > 1:   # a PP decode: each stage's row to its decode stage
        r.meta.output_ids[x["row"]] = aux_row(q["room"])
        r.meta.bootstrap_room[x["row"], 0] = q["room"]
    if len(r.sets) > 1:   # the draft's stage: its hidden states and top-k for the decode's draft
        hidden, topk_p, topk_ids = spec_row(q["room"])
        r.meta.output_hidden_states[x["row"]], r.meta.output_topk_p[x["row"]] = hidden, topk_p
        r.meta.output_topk_index[x["row"]] = topk_ids
    state = None
    if r.state is not None:   # this stage's state (its layers' DSA pages), named with the last send
        w = min(r.sc["state"]["swa_pages"], len(suffix))
        x["swa"] = [next(r.state_pages) for _ in range(w)]
        r.state.fill(q["room"], x["slot"], x["swa"], q["pages"] - w)
        state = r.state.indices(x["slot"], x["swa"])
    if q.get("tokens") is not None:   # as the plugin's hook before finalize_bootstrap (decode DCP)
        s.request_tokens = q["tokens"]
    s.init(len(suffix), x["row"])
    done = 0
    sends = [q["chunks"][0] + q["prefix"] - k, *q["chunks"][1:]]
    for i, n in enumerate(sends):
        s.send(np.asarray(suffix[done:done + n], dtype=np.int32), state if i == len(sends) - 1 else None)
        done += n
    x["st"] = "sent"
