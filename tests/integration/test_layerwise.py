"""Layer-wise sending (`send(pages, layers=..., ready=...)`) between real processes over real NIXL
and Mooncake: bit-exact for layer groups of 1, 3 and all layers, in and out of order inside a
chunk, hetero TP both ways (staged) and equal TP and MLA (direct), with state pools and prefix
hits, and with direct writes that size themselves (layer_batching); the readiness objects are
waited on by kvstage's threads only; an abort between layer groups fails both sides and releases
everything."""

from __future__ import annotations

import pytest
from engine_cases import Case, Topo, each_rank, layered_case, problems, random_rooms, run_cases
from records import assert_exact

from kvstage.transfer.protocol.head_mapping import compute_assignments

pytestmark = pytest.mark.integration

LAYERS = 6
PER_LAYER = [[i, i + 1] for i in range(LAYERS)]
THREES_BACKWARDS = [[3, 6], [0, 3]]
ALL = [[0, LAYERS]]


def layerwise(topo: Topo, staging: bool, backend: str, sends: list, group: int, seed: int, *, pools: bool = False,
              prefix: bool = False, min_tokens: int = 0, batching: bool = False) -> Case:
    """With `batching`, the first send waits for the decode side's metadata (a room decides at its
    first send whether it batches, and only knows its path from the metadata)."""
    case = layered_case(topo, staging, backend, seed=seed, base=7000, label=f"lw{seed}", layers=LAYERS,
                        layer_sends=sends, group=group, min_tokens=min_tokens, pools=pools, prefix=prefix)
    case.prefill_extra["layer_batching"] = batching
    for r in case.rooms if batching else ():
        r["send_after_metadata"] = True
    return case


def writes_per_chunk(sends: list, group: int) -> int:
    """Units a chunk becomes (layer_sends.LayerGrouper): whole groups a send covers stay one."""
    if group == 0:
        return 1
    units = 0
    held: set[int] = set()
    for a, b in sends:
        whole = False
        for first in range(0, LAYERS, group):
            g = set(range(first, min(first + group, LAYERS)))
            part = g & set(range(a, b))
            if part == g:
                whole = True
            elif part:
                held |= part
                if g <= held:
                    units += 1
        units += whole
    return units


@pytest.mark.timeout(400)
@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_layer_groups_move_bit_exact(backend):
    cases = [
        layerwise(Topo(P=2, D=1, H=4), True, backend, PER_LAYER, 1, 1, pools=True),
        layerwise(Topo(P=1, D=2, H=4), True, backend, PER_LAYER, 3, 2, prefix=True),
        layerwise(Topo(P=2, D=1, H=4), True, backend, THREES_BACKWARDS, 3, 3, prefix=True),
        layerwise(Topo(P=1, D=2, H=4), True, backend, ALL, 2, 4, pools=True),
        layerwise(Topo(P=2, D=2, H=4), False, backend, PER_LAYER, 3, 5, pools=True, prefix=True),
        layerwise(Topo(P=2, D=2, H=4), False, backend, THREES_BACKWARDS, 1, 6),
        layerwise(Topo(P=2, D=1, H=1, mla=True), False, backend, PER_LAYER, 1, 7),
        # below the length threshold: every layer of a chunk in one write, as without layers
        layerwise(Topo(P=2, D=1, H=4), True, backend, PER_LAYER, 1, 8, min_tokens=1 << 20),
        # direct writes that size themselves: one layer each, merged while a write is in flight
        layerwise(Topo(P=2, D=2, H=4), False, backend, PER_LAYER, 4, 9, pools=True, batching=True),
        layerwise(Topo(P=1, D=1, H=4), False, backend, PER_LAYER, 4, 10, batching=True),
        layerwise(Topo(P=2, D=1, H=1, mla=True), False, backend, THREES_BACKWARDS, 4, 11, batching=True),
    ]
    results, codes, logs, _ = run_cases(cases, timeout=300)
    bad = problems(results, codes, logs)
    assert not bad, "\n".join(bad[:10])
    waited: dict[str, set] = {}
    for c, side, res in each_rank(cases, results):
        if side == "prefill":   # a rank that writes nothing (MLA replicas) reads no layer, waits on nothing
            for rec in res["rooms"]:
                waited.setdefault(c.name, set()).update(rec["ready_threads"])
            if c.prefill_extra["layer_batching"]:
                check_batched_writes(c, res)
            continue
        if c.prefill_extra["layer_batching"]:
            continue
        mapping = compute_assignments(c.topo.P, c.topo.D, c.topo.H, c.topo.mla)
        writers = len(mapping.writers_of(int(res["name"].rsplit("/", 1)[1])))
        group = 0 if c.prefill_extra["layerwise_min_tokens"] else c.prefill_extra["layer_group"]
        for r in c.rooms:
            rec = next(x for x in res["rooms"] if x["room"] == r["room"])
            sent_chunks = len(r["chunks"])
            if r.get("prefix_pages"):   # a chunk entirely inside the prefix is not sent
                sent_chunks -= sum(1 for i in range(len(r["chunks"])) if sum(r["chunks"][:i + 1]) <= 1)
            want = writers * sent_chunks * writes_per_chunk(r["layer_sends"], group)
            assert rec["metrics"]["backend_writes"] == want, (c.name, r, rec["metrics"], want)
    for name, threads in waited.items():   # the transfer workers (staged) or the readiness waiter (direct)
        assert threads and all(t.startswith(("kvstage-xfer-", "kvstage-ready")) for t in threads), (name, threads)


def check_batched_writes(c: Case, res: dict) -> None:
    """A batching prefill rank writes each chunk's sends one layer each, less those merged into
    an earlier write: writes == decode ranks written x (chunks x sends - merged) per room."""
    mapping = compute_assignments(c.topo.P, c.topo.D, c.topo.H, c.topo.mla)
    flows = len(mapping.decode_peers_of(int(res["name"].rsplit("/", 1)[1])))
    for r in c.rooms:
        rec = next(x for x in res["rooms"] if x["room"] == r["room"])
        m = rec["metrics"]
        if m["path"] == "none":   # an MLA replica nobody needs: nothing written
            assert m["backend_writes"] == 0, (c.name, r, m)
            continue
        units = len(r["chunks"]) * len(r["layer_sends"])
        assert m["backend_writes"] == flows * (units - m["merged_sends"]), (c.name, r, m, flows)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_an_abort_or_a_failed_forward_between_layer_groups_fails_both_sides_and_releases(backend):
    """Room 1 aborts after 3 layer sends; room 2's fourth send carries a readiness object that
    raises (its forward pass failed): both fail on both sides with the reason, the rest land, on
    the staged path and on the direct one (which batches)."""
    cases = []
    for topo, staging in ((Topo(P=2, D=1, H=4), True), (Topo(P=2, D=2, H=4), False)):
        rooms = random_rooms(11, 4, 4, max_tokens=120, base=7100)
        for r in rooms:
            r["layer_sends"] = PER_LAYER
            r["send_after_metadata"] = True
        rooms[1].update(pages=4, tokens=16, chunks=[4], chunk_delay_s=0.0, abort_after_sends=3)
        rooms[2].update(ready_fails_at_send=3)
        cases.append(Case(topo=topo, page_size=4, dtype="bfloat16", staging=staging, backend=backend, rooms=rooms,
                          layers=LAYERS, prefill_extra={"layer_group": 1, "layerwise_min_tokens": 0}))
    results, codes, logs, _ = run_cases(cases, timeout=200)
    bad = problems(results, codes, logs, expect_success=False)
    assert not bad, "\n".join(bad[:10])
    for c, side, res in each_rank(cases, results):
        for rec in res["rooms"]:
            if rec["room"] == c.rooms[1]["room"]:
                assert rec["state"] == "Failed" and "abort" in rec["failure"], (c.name, side, rec)
            elif rec["room"] == c.rooms[2]["room"]:
                assert rec["state"] == "Failed" and "forward pass of room" in rec["failure"], (c.name, side, rec)
            else:
                assert_exact(side, rec)
