"""The head mapping against a brute-force reference over every valid (P, D, H)."""

import itertools

import pytest

from kvstage.transfer.protocol.head_mapping import compute_assignments

TPS = [1, 2, 3, 4, 6, 8, 16]
HEADS = [1, 2, 3, 4, 6, 8, 12, 16, 32]


def valid(tp, h):
    return h % tp == 0 or tp % h == 0


def holds(tp, h, rank):
    """Reference: global heads held by `rank`, by division (never modulo)."""
    if tp <= h:
        n = h // tp
        return set(range(rank * n, rank * n + n))
    return {rank // (tp // h)}


def first(tp, h, rank):
    return min(holds(tp, h, rank))


CASES = [(p, d, h) for p, d, h in itertools.product(TPS, TPS, HEADS) if valid(p, h) and valid(d, h)]


@pytest.mark.parametrize("P,D,H", CASES)
def test_every_decode_head_written_exactly_once_by_a_holder(P, D, H):
    m = compute_assignments(P, D, H)
    written = {}
    pairs = set()
    for a in m.assignments:
        assert (a.prefill_rank, a.decode_rank) not in pairs, "one assignment per rank pair"
        pairs.add((a.prefill_rank, a.decode_rank))
        s0, s1 = a.src_heads
        d0, d1 = a.dst_heads
        assert s1 - s0 == d1 - d0 >= 1
        src_global = [first(P, H, a.prefill_rank) + i for i in range(s0, s1)]
        dst_global = [first(D, H, a.decode_rank) + i for i in range(d0, d1)]
        assert src_global == dst_global, "source and destination name the same global heads"
        for h in dst_global:
            assert h in holds(P, H, a.prefill_rank), "writer holds the head"
            assert h in holds(D, H, a.decode_rank), "decode rank holds the head"
            key = (a.decode_rank, h)
            assert key not in written, f"head {h} of decode rank {a.decode_rank} written twice"
            written[key] = a.prefill_rank
    expected = {(d, h) for d in range(D) for h in holds(D, H, d)}
    assert set(written) == expected


@pytest.mark.parametrize("P,D,H", CASES)
def test_writer_indices_and_counts(P, D, H):
    m = compute_assignments(P, D, H)
    for d in range(D):
        ws = m.for_decode(d)
        assert [a.writer_index for a in ws] == list(range(len(ws)))
        assert all(a.num_writers == len(ws) for a in ws)
        # writers are ordered by destination heads and tile the decode rank's heads
        starts = [a.dst_heads[0] for a in ws]
        assert starts == sorted(starts) and starts[0] == 0
        assert ws[-1].dst_heads[1] == len(holds(D, H, d))


@pytest.mark.parametrize("P,D,H", [c for c in CASES if c[0] > c[1] and c[0] % c[1] == 0 and c[0] <= c[2]])
def test_p_greater_than_d_sends_all_heads_to_one_rank(P, D, H):
    m = compute_assignments(P, D, H)
    for p in range(P):
        (a,) = m.for_prefill(p)
        assert a.src_heads == (0, H // P)
        assert a.num_writers == P // D


@pytest.mark.parametrize("P,D,H", [c for c in CASES if c[0] < c[1] and c[1] % c[0] == 0 and c[1] <= c[2]])
def test_p_less_than_d_one_writer_per_decode_rank(P, D, H):
    m = compute_assignments(P, D, H)
    for d in range(D):
        (a,) = m.for_decode(d)
        assert a.num_writers == 1 and a.dst_heads == (0, H // D)
    for p in range(P):
        assert len(m.for_prefill(p)) == D // P  # each prefill rank feeds D/P decode ranks


@pytest.mark.parametrize("N,H", [(n, h) for n in TPS for h in HEADS if valid(n, h)])
def test_equal_tp_is_identity(N, H):
    m = compute_assignments(N, N, H)
    for a in m.assignments:
        assert a.prefill_rank == a.decode_rank and a.num_writers == 1
        assert a.src_heads == a.dst_heads == (0, max(1, H // N))


def test_replicas_nobody_needs_do_not_write():
    m = compute_assignments(8, 1, 2)  # prefill ranks 0-3 hold head 0, 4-7 head 1
    assert {a.prefill_rank for a in m.assignments} == {0, 4}
    assert m.for_prefill(1) == []
    assert [a.num_writers for a in m.for_decode(0)] == [2, 2]


def test_decode_replicas_spread_over_prefill_replicas():
    m = compute_assignments(4, 8, 2)  # both sides replicate: 2 copies prefill, 4 decode
    writers = [m.writers_of(d)[0] for d in range(8)]
    assert writers == [0, 1, 0, 1, 2, 3, 2, 3]


def test_mla_one_writer_per_decode_rank():
    m = compute_assignments(2, 4, 1, mla=True)
    assert [m.writers_of(d) for d in range(4)] == [[0], [1], [0], [1]]
    m = compute_assignments(4, 1, 1, mla=True)
    assert m.writers_of(0) == [0] and m.for_prefill(3) == []


def test_invalid_combinations():
    with pytest.raises(ValueError, match="prefill tp_size=3"):
        compute_assignments(3, 2, 8)
    with pytest.raises(ValueError, match="decode tp_size=5"):
        compute_assignments(2, 5, 8)
    with pytest.raises(ValueError):
        compute_assignments(1, 1, 2, mla=True)


@pytest.mark.parametrize("P,D,H", CASES)
def test_every_prefill_rank_hears_from_exactly_its_decode_peers(P, D, H):
    m = compute_assignments(P, D, H)
    told = {p: [] for p in range(P)}
    for d in range(D):
        writers, notices = m.prefill_peers_of(d)
        assert not set(writers) & set(notices)
        for p in writers + notices:
            told[p].append(d)
    for p in range(P):
        assert sorted(told[p]) == sorted(m.decode_peers_of(p)), "metadata senders match what p waits for"
        assert (m.notice_rank(p) is None) == bool(m.for_prefill(p))
