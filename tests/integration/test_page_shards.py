"""KV page sharding between real processes (real NIXL or Mooncake, the real bootstrap server): a
prefill engine of TP 2 that shards an MLA model's pages (logical page l on rank l % 2 at local page
l // 2, transfer/protocol/page_shards.py) -> a decode engine of TP 2. Every decode rank takes every
page of each request from whichever prefill rank owns it, bit-exact, with prefix hits, uneven
chunks, layer-wise sends and each request's aux row (a pool item, carried by the owner of the last page), every
write's digest checked where it landed (EngineConfig(verify=True)); a room whose tags one writer
rewrites fails on both sides (its landed bytes' digest, or its tag, disagrees) while the others
succeed; a decode
engine of another TP size fails every request on both sides, kind `layout`, with the reason naming
both sides, long before any deadline, and nothing hangs."""

import pytest
from engine_cases import LAYERED_AUX, Case, Topo, each_rank, problems, random_rooms, run_cases


def sharded_case(backend: str, base: int) -> tuple[Case, int]:
    """The moved case, and the room whose tags prefill rank 1 rewrites (page range moved one on:
    its mask then names cells another writer wrote, or pages past the room)."""
    rooms = random_rooms(base, 10, 4, max_tokens=160, base=base)
    for i, r in enumerate(rooms):
        r["pool_items"] = {"aux": 1}
        if i % 3 == 1 and r["pages"] > 2:
            r["prefix_pages"] = 2   # a prefix hit: positions 0 and 1 stay as the decode rank holds them
    bad = max(rooms, key=lambda r: r["pages"])["room"]
    return Case(topo=Topo(P=2, D=2, H=1, mla=True), page_size=4, dtype="bfloat16", backend=backend, rooms=rooms,
                layers=3, head_dim=16, pages=256, label="shards", prefill_extra={"shards": 2},
                pools={"aux": LAYERED_AUX}, extra={"verify": True},   # each write's digest over its masked pages
                rank_extra={("prefill", 1): {"faults": {"corrupt_rooms": [bad]}}}), bad


def layerwise_case(backend: str, base: int) -> Case:
    """The same shape sent layer-wise: each chunk as layers [0, 1) then [1, 3), each send with its
    readiness object (the layers filled once it is waited on), an aux row with the last."""
    rooms = random_rooms(base, 6, 4, max_tokens=120, base=base)
    for r in rooms:
        r["layer_sends"], r["pool_items"] = [[0, 1], [1, 3]], {"aux": 1}
    return Case(topo=Topo(P=2, D=2, H=1, mla=True), page_size=4, dtype="bfloat16", backend=backend, rooms=rooms,
                layers=3, head_dim=16, pages=256, label="shards-layerwise", prefill_extra={"shards": 2},
                pools={"aux": LAYERED_AUX})


def refused_case(backend: str, base: int) -> Case:
    return Case(topo=Topo(P=2, D=1, H=1, mla=True), page_size=4, dtype="bfloat16", backend=backend,
                rooms=random_rooms(base, 3, 4, 60, base), layers=2, head_dim=16, pages=64, label="shards-d1",
                prefill_extra={"shards": 2})


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_a_sharded_prefill_moves_every_page_to_each_decode_rank_and_an_unserved_pairing_fails_on_both_sides(backend):
    (moved, corrupt), refused = sharded_case(backend, 4100), refused_case(backend, 4200)
    layerwise = layerwise_case(backend, 4300)
    results, codes, logs, _ = run_cases([moved, refused, layerwise], timeout=120)
    good = {moved.name: {side: [{**res, "rooms": [r for r in res["rooms"] if r["room"] != corrupt]}
                                for res in ranks] for side, ranks in results[moved.name].items()},
            layerwise.name: results[layerwise.name]}
    bad = problems(good, codes, logs)
    assert not bad, "\n".join(bad[:10])
    writers = set()
    for _c, side, res in each_rank([moved], results):
        assert len(res["rooms"]) == 10, (side, res)
        for rec in res["rooms"]:
            if rec["room"] == corrupt:   # failed on every rank of both sides: its digest (verify) or its tag
                kind = rec["kind"].removeprefix("remote_")
                assert rec["state"] == "Failed" and kind in ("corrupt", "tag_mismatch"), rec
                assert ("corrupt data from prefill rank 1" if kind == "corrupt" else "rejected") in rec["failure"], rec
                continue
            assert rec["state"] == "Success", (side, rec)
            if side == "decode":
                assert rec["verified"] is True and rec.get("prefix_intact", True) is True, rec
            else:
                writers.add((res["name"], rec["metrics"]["backend_writes"] > 0))
    # both prefill ranks wrote: each owns some pages of the requests
    assert {w for w in writers if w[1]} and len({n for n, wrote in writers if wrote}) == 2, writers
    for _c, side, res in each_rank([layerwise], results):   # every layer of every page, from its owner
        assert len(res["rooms"]) == 6 and all(rec["state"] == "Success" for rec in res["rooms"]), (side, res)
        if side == "decode":   # (problems() above checked every byte of these rooms)
            assert all(rec["verified"] is True for rec in res["rooms"]), res
    for c, side, res in each_rank([refused], results):
        assert len(res["rooms"]) == 3, (c.name, side, res)
        for rec in res["rooms"]:
            assert rec["state"] == "Failed", (c.name, side, rec)
            assert rec["kind"] in ("layout", "remote_layout"), (c.name, side, rec)
            assert "prefill TP 2 (MLA, KV pages sharded 2 ways) -> decode TP 1 (MLA)" in rec["failure"], rec


def pp_case(topo: Topo, backend: str, base: int, label: str) -> Case:
    """A sharded prefill of 2 PP stages (layers [0, 2) and [2, 3)): each stage's TP group shards
    its own layers' pages, with prefix hits, aux rows and each write's digest."""
    rooms = random_rooms(base, 8, 4, max_tokens=160, base=base)
    for i, r in enumerate(rooms):
        r["pool_items"] = {"aux": 1}
        if i % 3 == 1 and r["pages"] > 2:
            r["prefix_pages"] = 2
    return Case(topo=topo, page_size=4, dtype="bfloat16", backend=backend, rooms=rooms, layers=3, head_dim=16,
                pages=256, label=label, prefill_extra={"shards": 2, "stage_layers": [[0, 2], [2, 3]]},
                pools={"aux": LAYERED_AUX}, extra={"verify": True})


@pytest.mark.timeout(300)
def test_each_pp_stage_shards_its_own_layers_pages():
    """PP 2 x TP 2 sharded -> decode TP 2 over NIXL, and -> decode PP 2 x TP 2 over Mooncake:
    every decode rank takes each (page, layer) from the rank of the stage holding the layer that
    owns the page, bit-exact; every prefill rank of both stages writes."""
    cases = [pp_case(Topo(P=2, D=2, H=1, mla=True, pp=2), "nixl", 4500, "shards-pp"),
             pp_case(Topo(P=2, D=2, H=1, mla=True, pp=2, dpp=2), "mooncake", 4600, "shards-pp-dpp")]
    cases[1].decode_extra = {"stage_layers": [[0, 2], [2, 3]]}
    results, codes, logs, _ = run_cases(cases, timeout=120)
    bad = problems(results, codes, logs)
    assert not bad, "\n".join(bad[:10])
    for c, side, res in each_rank(cases, results):
        assert len(res["rooms"]) == 8 and all(rec["state"] == "Success" for rec in res["rooms"]), (c.name, side)
        if side == "decode":
            assert all(rec["verified"] is True for rec in res["rooms"]), (c.name, res)
        else:   # each rank of each stage owns some pages of the requests, and writes them
            assert sum(rec["metrics"]["backend_writes"] for rec in res["rooms"]) > 0, (c.name, res["name"])
