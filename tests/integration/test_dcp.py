"""Decode context parallel between real processes (real NIXL or Mooncake, the real bootstrap
server): prefill DCP 1 -> decode DCP 2 (MLA, direct) puts every token on the decode rank that owns
it, at its local slot, bit-exact, with a decode prefix and the final partial page exact (every
other slot of the room's pages untouched), and each request's aux row (a pool item) whole on every
decode rank, the one owning no token included; a pairing kvstage's engine cannot move fails every
request on both sides, kind `layout`, with the reason naming both layouts
(token_mapping.engine_refusal), long before any deadline, and nothing hangs."""

import pytest
from engine_cases import LAYERED_AUX, Case, Topo, corrupt_rooms, each_rank, problems, random_rooms, run_cases

from kvstage.transfer.protocol.token_mapping import DCPLayout, local_pages

PS = 4


SHAPES = [(1, 0), (7, 0), (8, 0), (37, 1), (61, 2), (5, 0)]   # (tokens, decode prefix in local pages)
WANT = {0: 1, 1: 7, 2: 8, 3: 37 - 8, 4: 61 - 16, 5: 5}     # tokens moved past the prefix, per room


def split_case(backend: str, prefill_dcp: int = 1, base: int = 3300, aux: bool = False,
               buffer_bytes: int = 0, head_dim: int = 16) -> Case:
    """Prefill TP 2 / DCP `prefill_dcp` (1 or 2) -> decode TP 2 DCP 2, pages of 4 tokens (a
    virtual page of 8): one token, a partial last page, whole virtual pages, prefixes of one and
    two virtual pages, in uneven chunks on the prefill side (MLA: decode rank d is written by
    prefill rank d % 2, which holds the same DCP rank when the prefill has DCP 2). `aux`: each
    request also carries an aux row (SGLang's first output token), one item of a replicated pool
    on every rank, which each decode rank gets whole (the one-token request's rank 1, owning no
    token, gets it alone). `buffer_bytes`: staging on, the prefill ranks' buffers of that size
    (each decode rank's tokens gathered into one before they are written: token_mapping.Relayout);
    0: staging off, every token run written from the cache."""
    dec = DCPLayout(dcp_size=2, page_size=PS, mla=True)
    pre = DCPLayout(dcp_size=prefill_dcp, page_size=PS, mla=True)
    pre_rooms, dec_rooms = [], []
    for i, (tokens, prefix) in enumerate(SHAPES):
        room = base + i
        pages = local_pages(pre, tokens)
        chunks = [pages] if pages < 4 else [1, pages - 3, 2]
        items = {"pool_items": {"aux": 1}} if aux else {}
        pre_rooms.append({"room": room, "pages": pages, "chunks": chunks, "dcp_tokens": tokens, **items})
        rec = {"room": room, "pages": local_pages(dec, tokens), "dcp_tokens": tokens, **items}
        if prefix:
            rec["prefix_pages"] = prefix
        dec_rooms.append(rec)
    staged = {"buffer_mb": buffer_bytes / (1 << 20)} if buffer_bytes else {}
    return Case(topo=Topo(P=2, D=2, H=1, mla=True), page_size=PS, dtype="bfloat16", backend=backend, layers=2,
                head_dim=head_dim, pages=64, label=f"dcp{prefill_dcp}2{'aux' if aux else ''}{buffer_bytes or ''}",
                staging=bool(buffer_bytes), prefill_extra={"rooms": pre_rooms, "dcp": prefill_dcp, **staged},
                decode_extra={"rooms": dec_rooms, "dcp": 2}, pools={"aux": LAYERED_AUX} if aux else {})


def refused_case(topo: Topo, backend: str, label: str, prefill_dcp: int, decode_dcp: int, base: int) -> Case:
    return Case(topo=topo, page_size=PS, dtype="bfloat16", backend=backend, rooms=random_rooms(base, 3, PS, 60, base),
                layers=2, head_dim=16, pages=64, label=label,
                prefill_extra={"dcp": prefill_dcp}, decode_extra={"dcp": decode_dcp})


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_dcp_1_and_2_to_2_are_bit_exact_on_each_rank_and_an_unserved_pairing_fails_on_both_sides(backend):
    """One cluster, four engine pairs: prefill DCP 1 -> decode DCP 2 and prefill DCP 2 -> decode
    DCP 2 (split_case), every token on its rank, bit-exact, and DCP 1 -> 2 again with an aux row
    per request, every rank's item bit-exact too; prefill TP 2 DCP 2 -> decode TP 1 (DCP on the
    prefill side only: SGLang does not serve it), every room Failed on every rank with the reason
    naming both layouts."""
    moved = [split_case(backend, 1, 3300), split_case(backend, 2, 3400), split_case(backend, 1, 3500, aux=True),
             split_case(backend, 1, 3600, aux=True, buffer_bytes=1 << 20), split_case(backend, 1, 3700, buffer_bytes=8192, head_dim=128)]
    # relayout writes: every flow of two tokens or more (ten: the one-token room's two are
    # direct), each of both layers; with 8 KiB buffers and 256 bytes a token, the 61-token room's
    # two flows (23 and 22 tokens: 5888 and 5632 bytes a layer) in two writes each
    relayouts = {moved[3].name: 10, moved[4].name: 12}
    refused = refused_case(Topo(P=2, D=1, H=1, mla=True), backend, "pside", 2, 1, 3100)
    results, codes, logs, _ = run_cases([*moved, refused], timeout=120)
    bad = problems({c.name: results[c.name] for c in moved}, codes, logs)
    assert not bad, "\n".join(bad[:10])
    for case in moved:
        by_room: dict[int, int] = {}
        for _c, side, res in each_rank([case], results):
            assert len(res["rooms"]) == 6, (side, res)
            for rec in res["rooms"]:
                assert rec["state"] == "Success", (side, rec)
                if side == "decode":
                    assert rec["verified"] is True and rec["dcp_rest_untouched"] is True, rec
                    assert rec.get("prefix_intact", True) is True, rec
                    by_room[rec["room"] % 100] = by_room.get(rec["room"] % 100, 0) + rec["dcp_tokens"]
        assert by_room == WANT, case.name   # the two decode ranks took every token past the prefix
        made = sum(res["stats"].get("relayout_writes", 0) for _c, side, res in each_rank([case], results)
                   if side == "prefill")
        assert made == relayouts.get(case.name, 0), (case.name, made)
    for c, side, res in each_rank([refused], results):
        assert len(res["rooms"]) == 3, (c.name, side, res)
        for rec in res["rooms"]:
            assert rec["state"] == "Failed", (c.name, side, rec)
            assert rec["kind"] in ("layout", "remote_layout"), (c.name, side, rec)
            assert ("prefill DCP 2 (page_size 4, MLA) -> decode DCP 1 (page_size 4, MLA): DCP on the prefill side only "
                    "is not served" in rec["failure"]), (c.name, side, rec)


@pytest.mark.timeout(300)
def test_with_verify_each_dcp_write_is_checked_and_a_flipped_byte_fails_only_its_room():
    """Engine verify (EngineConfig(verify=True)) beside DCP 1 -> 2 over NIXL, as direct runs and
    relayouted (each with an aux row per request): every write's digest covers its tokens in
    order on both sides (token_mapping.run_slots, first_slots), so clean rooms succeed bit-exact;
    with the corrupt_data fault on the decode ranks, every room a byte was flipped in fails there
    as `corrupt` with the digests named, and no other does."""
    cases = [split_case("nixl", 1, 3800, aux=True), split_case("nixl", 1, 3900, aux=True, buffer_bytes=1 << 20)]
    for c in cases:
        c.extra = {"verify": True}
        c.decode_extra = {**c.decode_extra, "faults": {"corrupt_data": 0.3, "seed": 5}}
    results, codes, logs, _ = run_cases(cases, timeout=120)
    assert not any(codes), codes
    for c in cases:
        flipped = sum(len(corrupt_rooms(c.name, dec)) for dec in results[c.name]["decode"])
        assert 0 < flipped < 12, (c.name, flipped)   # some rooms of the two decode ranks, not all
