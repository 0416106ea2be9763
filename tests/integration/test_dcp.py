"""Decode context parallel between real processes (real NIXL or Mooncake, the real bootstrap
server): prefill DCP 1 -> decode DCP 2 (MLA, direct) puts every token on the decode rank that owns
it, at its local slot, bit-exact, with a decode prefix and the final partial page exact (every
other slot of the room's pages untouched); a pairing kvstage's engine cannot move fails every
request on both sides, kind `layout`, with the reason naming both layouts
(token_mapping.engine_refusal), long before any deadline, and nothing hangs."""

import pytest
from engine_cases import Case, Topo, each_rank, problems, random_rooms, run_cases

from kvstage.transfer.protocol.token_mapping import DCPLayout, local_pages

PS = 4


def split_case(backend: str) -> Case:
    """Prefill TP 1 (DCP 1) -> decode TP 2 DCP 2, pages of 4 tokens (a virtual page of 8): one
    token, a partial last page, whole virtual pages, prefixes of one and two virtual pages, in
    uneven chunks on the prefill side."""
    dec = DCPLayout(dcp_size=2, page_size=PS, mla=True)
    shapes = [(1, 0, [1]), (7, 0, [1, 1]), (8, 0, [2]), (37, 1, [3, 5, 2]), (61, 2, [4, 12]), (5, 0, [2])]
    pre_rooms, dec_rooms = [], []
    for i, (tokens, prefix, chunks) in enumerate(shapes):
        room = 3300 + i
        pages = -(-tokens // PS)
        assert sum(chunks) == pages
        pre_rooms.append({"room": room, "pages": pages, "chunks": chunks, "dcp_tokens": tokens})
        rec = {"room": room, "pages": local_pages(dec, tokens), "dcp_tokens": tokens}
        if prefix:
            rec["prefix_pages"] = prefix
        dec_rooms.append(rec)
    return Case(topo=Topo(P=1, D=2, H=1, mla=True), page_size=PS, dtype="bfloat16", backend=backend, layers=2,
                head_dim=16, pages=64, label="dcp12", prefill_extra={"rooms": pre_rooms},
                decode_extra={"rooms": dec_rooms, "dcp": 2})


def refused_case(topo: Topo, backend: str, label: str, prefill_dcp: int, decode_dcp: int, base: int) -> Case:
    return Case(topo=topo, page_size=PS, dtype="bfloat16", backend=backend, rooms=random_rooms(base, 3, PS, 60, base),
                layers=2, head_dim=16, pages=64, label=label,
                prefill_extra={"dcp": prefill_dcp}, decode_extra={"dcp": decode_dcp})


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_dcp_1_to_2_is_bit_exact_on_each_rank_and_an_unserved_pairing_fails_on_both_sides(backend):
    """One cluster, two engine pairs: prefill TP 1 -> decode TP 2 DCP 2 (split_case), every
    token on its rank, bit-exact; prefill TP 2 DCP 2 -> decode TP 1 (DCP on the prefill side only:
    SGLang does not serve it), every room Failed on every rank with the reason naming both layouts."""
    case = split_case(backend)
    refused = refused_case(Topo(P=2, D=1, H=1, mla=True), backend, "pside", 2, 1, 3100)
    results, codes, logs, _ = run_cases([case, refused], timeout=120)
    bad = problems({case.name: results[case.name]}, codes, logs)
    assert not bad, "\n".join(bad[:10])
    seen = {}
    for _c, side, res in each_rank([case], results):
        assert len(res["rooms"]) == 6, (side, res)
        for rec in res["rooms"]:
            assert rec["state"] == "Success", (side, rec)
            if side == "decode":
                assert rec["verified"] is True and rec["dcp_rest_untouched"] is True, rec
                assert rec.get("prefix_intact", True) is True, rec
                seen[(rec["room"], res["name"])] = rec["dcp_tokens"]
    # the two decode ranks took every token past the prefix between them
    by_room: dict[int, int] = {}
    for (room, _rank), n in seen.items():
        by_room[room] = by_room.get(room, 0) + n
    assert by_room == {3300: 1, 3301: 7, 3302: 8, 3303: 37 - 8, 3304: 61 - 16, 3305: 5}
    for c, side, res in each_rank([refused], results):
        assert len(res["rooms"]) == 3, (c.name, side, res)
        for rec in res["rooms"]:
            assert rec["state"] == "Failed", (c.name, side, rec)
            assert rec["kind"] in ("layout", "remote_layout"), (c.name, side, rec)
            assert ("prefill DCP 2 (page_size 4, MLA) -> decode DCP 1 (page_size 4, MLA): DCP on the prefill side only "
                    "is not served" in rec["failure"]), (c.name, side, rec)
