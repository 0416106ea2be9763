"""The staged path between real processes: a ring far smaller than a chunk, many rooms sharing
one ring, notifications reordered and duplicated by a fault-injecting wrapper around the real
backend, exactly one write per piece, and a tag that lies about its allocation. Large pieces go
to the scatter thread, small ones are scattered by the control thread (both are checked)."""

import pytest
from engine_cases import Case, Topo, problems, random_rooms, run_cases
from records import assert_exact

pytestmark = pytest.mark.integration


def decode_stats(results, case):
    return [res["stats"] for res in results[case.name]["decode"]]


def prefill_stats(results, case):
    return [res["stats"] for res in results[case.name]["prefill"]]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_ring_far_smaller_than_a_chunk(backend):
    """12 MiB chunks through a 1 MiB ring: every chunk split into pieces that fit, the ring
    wraps dozens of times, every byte exact."""
    rooms = [{"room": 500 + i, "pages": 96, "chunks": [48, 48]} for i in range(3)]
    case = Case(
        topo=Topo(P=4, D=2, H=8),
        page_size=16,
        dtype="bfloat16",
        staging=True,
        backend=backend,
        rooms=rooms,
        layers=8,
        head_dim=128,
        pages=256,
        extra={"inflight": 2, "ring_mb": 1, "buffer_mb": 1},
    )
    results, codes, logs, _ = run_cases([case], timeout=300)
    bad = problems(results, codes, logs)
    assert not bad, "\n".join(bad[:20])
    chunk_bytes = 48 * 8 * 2 * 16 * 4 * 128 * 2  # pages x layers x K/V x tokens x heads x head bytes
    assert chunk_bytes == 12 << 20
    for st in decode_stats(results, case):
        assert st["ring_bytes"] == 1 << 20
        assert 0 < st["ring_high_water_bytes"] <= st["ring_bytes"]
        assert st["ring_live_bytes"] == 0 and st["ring_live_regions"] == 0
        assert st["bytes_received"] == 3 * 2 * chunk_bytes
        # 1 MiB pieces, past the inline limit (256 KiB): every one went to the scatter thread
        assert st["scatters"] == {"thread": 2 * 12 * 3}, st["scatters"]
    for st in prefill_stats(results, case):
        # each writer sends half of its decode rank's chunk; a piece holds at most 4 pages here
        assert st["staged_writes"] >= 3 * 2 * 12
        assert st["staged_writes_per_piece"] == {"1": st["staged_writes"]}
        # 512 KiB parts, past the inline limit (256 KiB): every one gathered by a transfer worker
        assert st["gathers"] == {"thread": st["staged_writes"]}, st["gathers"]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_32_rooms_share_one_ring_with_reordered_and_duplicated_tags(backend):
    rooms = random_rooms(11, 32, 16, max_tokens=400)
    faults = {"reorder_tags": 0.5, "dup_tags": 0.3, "hold_s": 0.05, "seed": 5}
    case = Case(
        topo=Topo(P=4, D=1, H=4),
        page_size=16,
        dtype="bfloat16",
        staging=True,
        backend=backend,
        rooms=rooms,
        pages=1024,
        extra={"inflight": 32, "ring_mb": 1},
        decode_extra={"faults": faults},
    )
    results, codes, logs, _ = run_cases([case], timeout=300)
    bad = problems(results, codes, logs)
    assert not bad, "\n".join(bad[:20])
    (dec,) = decode_stats(results, case)
    writes = sum(st["staged_writes"] for st in prefill_stats(results, case))
    for st in prefill_stats(results, case):
        assert st["staged_writes_per_piece"] == {"1": st["staged_writes"]}, "one write per piece per writer"
        assert st["staged_writes"] == st["write_requests"]
        # parts of a few KiB: gathered and posted by the control thread that handed them out
        assert st["gathers"].get("inline", 0) > 0 and sum(st["gathers"].values()) == st["staged_writes"], st["gathers"]
    assert dec["tags_received"] == writes, "every write landed exactly once"
    assert dec["dropped_tags"].get("duplicate", 0) > 0, "duplicates were injected and ignored"
    assert dec["rooms"] == {"success": 32}
    # pieces of a few KiB: scattered by the control thread that read their tags
    assert dec["scatters"].get("inline", 0) > 0 and "thread" not in dec["scatters"], dec["scatters"]


@pytest.mark.timeout(300)
def test_tag_disagreeing_with_its_allocation_fails_only_that_room():
    """Prefill rank 1 rewrites the tags of one room (ring offset and page range) so they disagree
    with the allocation: that room fails on both sides with the reason, the others succeed."""
    rooms = random_rooms(13, 8, 16, max_tokens=200)
    bad_room = rooms[3]["room"]
    case = Case(
        topo=Topo(P=2, D=1, H=2),
        page_size=16,
        dtype="bfloat16",
        staging=True,
        backend="nixl",
        rooms=rooms,
        rank_extra={("prefill", 1): {"faults": {"corrupt_rooms": [bad_room]}}},
    )
    results, codes, logs, _ = run_cases([case], timeout=200)
    assert not any(codes), codes
    for side in ("prefill", "decode"):
        assert len(results[case.name][side]) == (2 if side == "prefill" else 1), side
        for res in results[case.name][side]:
            assert not res.get("error"), res.get("traceback")
            assert sorted(r["room"] for r in res["rooms"]) == sorted(r["room"] for r in rooms), res["name"]
            for r in res["rooms"]:
                if r["room"] == bad_room:
                    assert r["state"] == "Failed" and "does not match the allocation" in r["failure"], r
                else:
                    assert_exact(side, r)  # decode: every byte checked; prefill: nothing to check
