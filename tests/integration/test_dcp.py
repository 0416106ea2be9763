"""Decode context parallel between real processes (real NIXL or Mooncake, the real bootstrap
server): prefill DCP 1 -> decode DCP 2 (MLA, direct) puts every token on the decode rank that owns
it, at its local slot, bit-exact, with a decode prefix and the final partial page exact (every
other slot of the room's pages untouched), and each request's aux row (a pool item) whole on every
decode rank, the one owning no token included; a pairing kvstage's engine cannot move fails every
request on both sides, kind `layout`, with the reason naming both layouts
(token_mapping.engine_refusal), long before any deadline, and nothing hangs. With PP on either
side each prefill stage writes each decode rank its tokens of the layers both stages hold."""

import dataclasses

import pytest
from dcp_cases import PS, check_moved, split_case
from engine_cases import Case, Topo, corrupt_rooms, each_rank, problems, random_rooms, run_cases


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
             split_case(backend, 1, 3600, aux=True, buffer_bytes=1 << 20), split_case(backend, 1, 3700, buffer_bytes=8192, head_dim=128),
             split_case(backend, 1, 3800, aux=True, buffer_bytes=8192, head_dim=128, own_writes=True)]
    # relayout writes: every flow of two tokens or more (ten: the one-token room's two are
    # direct), each of both layers; with 8 KiB buffers and 256 bytes a token, the 61-token room's
    # two flows (23 and 22 tokens: 5888 and 5632 bytes a layer) in two writes each; with an aux
    # pool that writes on its own, only those two flows' first writes (every other write carries
    # the aux item, and goes as token runs)
    relayouts = {moved[3].name: 10, moved[4].name: 12, moved[5].name: 2}
    refused = refused_case(Topo(P=2, D=1, H=1, mla=True), backend, "pside", 2, 1, 3100)
    results, codes, logs, _ = run_cases([*moved, refused], timeout=120)
    bad = problems({c.name: results[c.name] for c in moved}, codes, logs)
    assert not bad, "\n".join(bad[:10])
    check_moved(moved, results, relayouts)
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
    cases = [split_case("nixl", 1, 3900, aux=True), split_case("nixl", 1, 4000, aux=True, buffer_bytes=1 << 20)]
    for c in cases:
        c.extra = {"verify": True}
        c.decode_extra = {**c.decode_extra, "faults": {"corrupt_data": 0.3, "seed": 5}}
    results, codes, logs, _ = run_cases(cases, timeout=120)
    assert not any(codes), codes
    for c in cases:
        flipped = sum(len(corrupt_rooms(c.name, dec)) for dec in results[c.name]["decode"])
        assert 0 < flipped < 12, (c.name, flipped)   # some rooms of the two decode ranks, not all


@pytest.mark.timeout(300)
def test_dcp_beside_pp_writes_each_stages_layers_of_the_tokens_each_rank_owns():
    """Prefill PP 2 (a layer a stage) -> decode DCP 2: as token runs and relayouted through the
    staging buffers (every flow of two tokens or more, of each stage: 20 writes), over NIXL; and
    -> a decode of PP 2 with DCP 2 over Mooncake. Each request has an aux row, which comes with
    the last stage's writes; the one-token request's decode rank 1 owns no token and gets no write
    from the first stage. Every decode rank checks its tokens bit-exact and the rest untouched."""
    cases = [split_case("nixl", 1, 4100, aux=True), split_case("nixl", 1, 4200, aux=True, buffer_bytes=1 << 20),
             split_case("mooncake", 1, 4300, aux=True)]
    for c, (pp, dpp) in zip(cases, [(2, 1), (2, 1), (2, 2)]):
        c.topo = dataclasses.replace(c.topo, pp=pp, dpp=dpp)
        c.label += f"pp{pp}{dpp}"
    results, codes, logs, _ = run_cases(cases, timeout=120)
    bad = problems(results, codes, logs)
    assert not bad, "\n".join(bad[:10])
    check_moved(cases, results, {cases[1].name: 20})
