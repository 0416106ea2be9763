"""Draft KV entries (speculative decoding: EAGLE, MTP) between real processes over real NIXL and
Mooncake: bit-exact with the target's pages, staged and direct, hetero TP both ways, MLA,
layer-wise sends naming the draft entries; a decode holding more draft entries than the prefill
leaves its extra ones untouched and succeeds; a prefill with more draft entries than the decode
fails on both sides with kind layout (remote_layout on the prefill: the decode side failed it).
A draft of its own geometry (other heads and head_dim than the target's) moves with the last
piece, every byte checked, staged and direct, hetero TP with replication, a prefix hit,
decode-only speculation, and under the integrity check (verify=True: the draft's items are in
each write's digest); another draft geometry on the decode, or a draft whose writers are
not the KV's, fails on both sides with nothing written. With pipeline parallelism on either
side the last stage holds the draft and moves it to the decode's last stage."""

from __future__ import annotations

import pytest
from engine_cases import TEST_TIMEOUTS, Case, Topo, each_rank, layered_case, problems, run_cases

pytestmark = pytest.mark.integration

LAYERS = 2


def draft_case(topo: Topo, staging: bool, backend: str, *, prefill: int, decode: int, seed: int, label: str,
               layer_sends: list | None = None, prefix: bool = False, pools: bool = False,
               from_pointers: bool = False, own: dict | None = None, decode_own: dict | None = None,
               layers: int = LAYERS) -> Case:
    """engine_cases.layered_case's rooms over a model of LAYERS layers; the prefill holds `prefill`
    draft entries, the decode `decode` (0: none); `pools`: each room has an aux row, which
    moves with the write of the last page of the last draft entry; `from_pointers`: both sides
    hand their caches over as raw addresses in SGLang's order (target K, V, then draft K, V);
    `own`: the draft's own geometry on both sides ({"draft_heads": ..., "draft_head_dim": ...}),
    `decode_own`: the decode's when it differs; with PP (`topo.pp`, `topo.dpp`) the last stage's
    ranks hold the draft (support/pd_rank.py)."""
    case = layered_case(topo, staging, backend, seed=seed, base=9000 + 10 * seed, label=label, layers=layers,
                        layer_sends=layer_sends, prefix=prefix, pools=pools)
    case.extra = {"from_pointers": from_pointers}
    geo = case.geometry()
    case.prefill_extra["geometry"] = {**geo, "draft": prefill, **(own or {})}
    case.decode_extra = {"geometry": {**geo, "draft": decode, **(decode_own or own or {})}, "prefill_draft": prefill}
    return case


def run_clean(cases: list[Case]):
    """Run the cases, every room a verified success; yield (case, decode-only extra entries?,
    decode room record) for each decode rank's rooms."""
    results, codes, logs, _ = run_cases(cases, timeout=200)
    bad = problems(results, codes, logs)
    assert not bad, "\n".join(bad[:10])
    for c, side, res in each_rank(cases, results):
        assert len(res["rooms"]) == len(c.rooms), (c.name, side)
        extra = c.decode_extra["geometry"]["draft"] > c.prefill_extra["geometry"]["draft"]
        if side == "decode":
            for rec in res["rooms"]:
                yield c, extra, rec


def run_refused(cases: list[Case]):
    """Run cases whose connection is refused: every room Failed on both sides, kind layout
    (remote_layout on the prefill: the decode side failed it and told it), nothing written;
    yield (case, side, room record)."""
    for c in cases:
        for extra in (c.prefill_extra, c.decode_extra):
            extra["timeouts"] = {**TEST_TIMEOUTS, "bootstrap": 30.0}
        c.prefill_extra["run_timeout_s"] = 60
    results, codes, logs, _ = run_cases(cases, timeout=90)
    assert not any(codes), codes
    for c, side, res in each_rank(cases, results):
        assert len(res["rooms"]) == len(c.rooms), (c.name, side, res["rooms"])
        for rec in res["rooms"]:
            want = "layout" if side == "decode" else "remote_layout"
            assert rec["state"] == "Failed" and rec["kind"] == want, (c.name, side, rec)
            assert rec["metrics"]["nbytes"] == 0 and rec["metrics"]["backend_writes"] == 0, rec   # nothing written
            yield c, side, rec


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_draft_entries_move_bit_exact_and_extra_ones_stay_unwritten(backend):
    entries = LAYERS + 1
    cases = [
        # equal geometry, EAGLE-like (one draft entry) and MTP-like (two)
        draft_case(Topo(P=2, D=1, H=4), True, backend, prefill=1, decode=1, seed=1, label="st21", pools=True),
        draft_case(Topo(P=1, D=2, H=4), True, backend, prefill=2, decode=2, seed=2, label="st12", prefix=True,
                   from_pointers=True),
        draft_case(Topo(P=1, D=1, H=4), False, backend, prefill=1, decode=1, seed=3, label="dr11",
                   layer_sends=[[i, i + 1] for i in range(entries)], pools=True),   # the draft entry on its own
        draft_case(Topo(P=1, D=2, H=1, mla=True), False, backend, prefill=1, decode=1, seed=4, label="mla12"),
        # decode-only speculation: more draft entries on the decode than the prefill, or none there
        draft_case(Topo(P=2, D=1, H=4), True, backend, prefill=1, decode=2, seed=5, label="more21",
                   from_pointers=True),
        draft_case(Topo(P=1, D=1, H=4), False, backend, prefill=0, decode=2, seed=6, label="none11"),
    ]
    for c, extra, rec in run_clean(cases):
        # the entries beyond the prefill's still hold their start-up bytes on the room's pages
        assert rec.get("unwritten_intact") is (True if extra else None), (c.name, rec)


@pytest.mark.timeout(200)
def test_a_prefill_with_more_draft_entries_than_the_decode_fails_both_sides():
    cases = [draft_case(Topo(P=2, D=1, H=4), True, "nixl", prefill=2, decode=1, seed=7, label="bad21"),
             draft_case(Topo(P=1, D=1, H=4), False, "nixl", prefill=1, decode=0, seed=8, label="bad11")]
    for c, side, rec in run_refused(cases):
        # the prefill ranks refuse the decode rank's Hello; it fails the request (layout) and tells
        # them, and a prefill rank reports its peer's kind (remote_<kind>)
        p, d = c.prefill_extra["geometry"]["draft"], c.decode_extra["geometry"]["draft"]
        assert f"the prefill has {p} draft KV entr" in rec["failure"], rec
        assert (f"the decode {d} draft KV entr" if d else "the decode no draft KV") in rec["failure"], rec


OWN = {"draft_heads": 2, "draft_head_dim": 24}      # beside 4 heads of head_dim 16


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_a_draft_of_its_own_geometry_moves_bit_exact_with_the_last_piece(backend):
    cases = [
        draft_case(Topo(P=2, D=1, H=4), True, backend, prefill=1, decode=1, seed=11, label="own21", own=OWN,
                   pools=True),
        draft_case(Topo(P=1, D=2, H=4), True, backend, prefill=2, decode=2, seed=12, label="own12", own=OWN,
                   prefix=True, from_pointers=True),
        draft_case(Topo(P=1, D=1, H=4), False, backend, prefill=1, decode=1, seed=13, label="own11", own=OWN,
                   layer_sends=[[0, 1], [1, 2]]),               # layer-wise: the draft rides with the last
        draft_case(Topo(P=2, D=4, H=4), True, backend, prefill=1, decode=1, seed=14, label="own24",
                   own={"draft_heads": 2, "draft_head_dim": 8}),   # the draft replicated on the decode
        # decode-only speculation: more draft entries on the decode than the prefill, or none there
        draft_case(Topo(P=2, D=1, H=4), True, backend, prefill=1, decode=2, seed=15, label="ownmore21", own=OWN),
        draft_case(Topo(P=1, D=1, H=4), False, backend, prefill=0, decode=2, seed=16, label="ownnone11", own=OWN),
    ]
    for c in cases[:4]:   # the backend's integrity check too (verify=True), over the draft's pool parts
        c.extra["verify"] = True
    for c, extra, rec in run_clean(cases):
        assert rec["verified"] is True, (c.name, rec)       # target and draft, every byte
        assert rec.get("unwritten_intact") is (True if extra else None), (c.name, rec)
        assert rec["draft_untouched"] is (c.prefill_extra["geometry"]["draft"] == 0), (c.name, rec)
        if c.rooms[[r["room"] for r in c.rooms].index(rec["room"])].get("prefix_pages"):
            assert rec["draft_prefix_intact"] is True and rec["prefix_intact"] is True, (c.name, rec)


@pytest.mark.timeout(200)
def test_a_draft_geometry_that_cannot_pair_fails_both_sides():
    cases = [
        # the decode's draft has another head_dim than the prefill's
        draft_case(Topo(P=1, D=2, H=4), True, "nixl", prefill=1, decode=1, seed=17, label="badgeo12", own=OWN,
                   decode_own={"draft_heads": 2, "draft_head_dim": 32}),
        # 2 draft heads over prefill TP 4: the decode rank's draft would be written by other ranks than its KV
        draft_case(Topo(P=4, D=1, H=4), True, "nixl", prefill=1, decode=1, seed=18, label="badwriters41",
                   own={"draft_heads": 2, "draft_head_dim": 8}),
    ]
    reasons = {"badgeo12": ["draft KV geometry", "2 heads x head_dim 24", "2 heads x head_dim 32"],
               "badwriters41": ["draft KV entry 0 (2 heads) would be written to decode rank 0",
                                "its KV (4 heads) by [0, 1, 2, 3]"]}
    for c, side, rec in run_refused(cases):
        for part in reasons[c.label]:
            assert part in rec["failure"], (c.name, side, rec["failure"])
        if side == "decode":
            assert rec["draft_untouched"] is True, rec


@pytest.mark.timeout(300)
def test_the_last_pp_stage_moves_the_draft_to_the_decodes_last_stage():
    """SGLang runs the draft model on the last PP stage: its entries follow the model's last layer
    there, on both sides. PP 2 -> 1 direct with an aux row and prefix hits; PP 2 x TP 2 -> 1
    staged, sent layer-wise with the draft entries in the last stage's second send; PP 1 -> 2
    staged with decode-only speculation (the decode's last stage holds one more draft entry,
    which stays unwritten); PP 2 -> 3 (stage bounds that differ) over Mooncake with end-to-end
    digests; a draft of its own geometry PP 2 -> 2 over Mooncake, staged, and PP 1 -> 2 over NIXL
    (only the writes of the model's last layer carry it: none reaches the first decode stage,
    which has no draft). Every decode stage's entries checked bit-exact, the draft's on the last."""
    layers = 4
    cases = [
        draft_case(Topo(P=1, D=1, H=4, pp=2), False, "nixl", prefill=1, decode=1, seed=21, label="pp21",
                   layers=layers, pools=True, prefix=True),
        draft_case(Topo(P=2, D=1, H=4, pp=2), True, "nixl", prefill=2, decode=2, seed=22, label="pp2x21",
                   layers=layers, layer_sends=[[2, 3], [3, 6], [0, 2]]),
        draft_case(Topo(P=2, D=1, H=4, dpp=2), True, "nixl", prefill=1, decode=2, seed=23, label="dpp12",
                   layers=layers, pools=True),
        draft_case(Topo(P=1, D=1, H=4, pp=2, dpp=3), False, "mooncake", prefill=2, decode=2, seed=24, label="pp23",
                   layers=layers, prefix=True),
        draft_case(Topo(P=1, D=1, H=4, pp=2, dpp=2), True, "mooncake", prefill=1, decode=1, seed=25, label="ppown",
                   layers=layers, own=OWN, pools=True),
        draft_case(Topo(P=1, D=1, H=4, dpp=2), False, "nixl", prefill=1, decode=1, seed=26, label="dppown",
                   layers=layers, own=OWN, prefix=True),
    ]
    cases[3].extra["verify"] = True
    cases[4].extra["path"] = "staged"   # equal TP: whole pages through the ring
    results, codes, logs, _ = run_cases(cases, timeout=200)
    bad = problems(results, codes, logs)
    assert not bad, "\n".join(bad[:10])
    for c, side, res in each_rank(cases, results):
        assert len(res["rooms"]) == len(c.rooms), (c.name, side)
        if side != "decode":
            continue
        last = res["rank"] // c.topo.D == c.topo.dpp - 1
        for rec in res["rooms"]:
            assert rec["state"] == "Success" and rec["verified"] is True, (c.name, res["rank"], rec)
            # the decode's last stage: its one draft entry beyond the prefill's still holds its start-up bytes
            assert rec.get("unwritten_intact") is (True if c.label == "dpp12" and last else None), (c.name, rec)
            if c.label in ("ppown", "dppown") and last:
                assert rec["draft_untouched"] is False, rec
