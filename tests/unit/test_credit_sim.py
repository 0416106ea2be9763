"""Ring credits over many random interleavings (credit_sim.CreditWorld): every byte written
exactly once, no two writes in one ring region, every credit given back, nothing left waiting."""

import pytest
from credit_sim import CreditWorld, Write

from kvstage.transfer.protocol.credits import CreditSpan

CONFIGS = [   # (prefill ranks, ring bytes, piece bytes): tight rings force the grant fallback
    (1, 4096, 1024), (3, 4096, 1024), (8, 8192, 1024), (4, 4096, 1024), (2, 2048, 1024),
]


def add_requests(w: CreditWorld, n: int, max_pieces: int = 4, room0: int = 1) -> list:
    out = []
    for i in range(n):
        sizes = [w.rng.choice([64, 200, 512, w.piece_bytes]) for _ in range(w.rng.randint(1, max_pieces))]
        out.append(w.add_request(w.rng.randrange(w.P), room0 + i, 100 + i, sizes))
    return out


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"P{c[0]}ring{c[1]}")
@pytest.mark.parametrize("seed", range(4))
def test_credits_write_every_byte_once_and_give_the_ring_back(cfg, seed):
    P, ring, piece = cfg
    w = CreditWorld(P=P, ring_bytes=ring, piece_bytes=piece, seed=seed)
    add_requests(w, 12)
    w.run()
    w.check()
    assert w.credit_writes > 0
    assert not w.rejected


def test_a_ring_too_small_for_every_rank_falls_back_to_grants_and_still_completes():
    """Credits run out while pieces are half gathered: several multi-piece requests per rank in
    a ring that holds exactly one piece per rank."""
    writes = [0, 0]
    for seed in range(5):
        w = CreditWorld(P=4, ring_bytes=4096, piece_bytes=1024, seed=seed)
        add_requests(w, 16, max_pieces=6)
        w.run()
        w.check()
        writes[0] += w.credit_writes
        writes[1] += w.grant_writes
    assert writes[0] > 0 and writes[1] > 0   # both paths were taken


@pytest.mark.parametrize("seed", range(4))
def test_lost_credit_messages_are_resent_and_nothing_leaks(seed):
    w = CreditWorld(P=3, ring_bytes=4096, piece_bytes=1024, seed=seed, drop_msgs=0.25)
    add_requests(w, 12)
    w.run(max_ticks=2000)
    w.check()


def abort_reuse_and_kill(w, reqs, next_sizes):
    """Run `w` a random while, abort 3 unfinished requests and use each id again (a new session,
    `next_sizes`) while writes of its earlier use may still land, kill a prefill rank with writes
    in flight, then run to the end and check every rule."""
    for _ in range(w.rng.randint(5, 40)):
        if not w.step():
            break
    for r in w.rng.sample(reqs, 3):
        if len(r.done) < len(r.sizes):
            w.abort(r)
            w.add_request(r.rank, r.room, r.session + 1000, next_sizes)   # the id's next use
    w.kill(w.rng.randrange(w.P))
    w.run(max_ticks=2000)
    w.check()


@pytest.mark.parametrize("seed", range(8))
def test_aborts_dead_ranks_and_reused_room_ids_give_their_credits_back(seed):
    """Requests aborted mid-transfer, a prefill rank that dies with writes in flight, and room
    ids used again (a new session) while writes of their earlier use may still land."""
    w = CreditWorld(P=4, ring_bytes=4096, piece_bytes=1024, seed=seed)
    abort_reuse_and_kill(w, add_requests(w, 10), [512, 64])


def test_a_rank_that_writes_outside_its_credit_fails_only_its_own_request():
    """A faulty rank's write at a ring position no credit of it covers: its request fails with a
    reason, is never scattered, and the other requests (its own included) are untouched."""
    w = CreditWorld(P=2, ring_bytes=4096, piece_bytes=1024, seed=3)
    good = w.add_request(0, 1, 10, [512, 512])
    mine = w.add_request(1, 2, 20, [256])
    forged = w.add_request(1, 3, 30, [128])
    forged.next_piece = 1   # its one piece goes out below, not through the purse
    outside = w.ring.watermark.linear(w.ring_bytes) + w.ring_bytes - 128   # the ring's last bytes
    assert all(not (c.start <= outside < c.start + c.nbytes) for c in w.ledger.credits_of(1))
    w._post(Write(next(w.wids), 1, forged, 0, outside, 128, CreditSpan(credit=999, start=outside, nbytes=128),
                  forged=True))
    w.run()
    w.check()
    assert forged.aborted and not mine.aborted and not good.aborted
    assert [(rank, str(v)) for rank, v, _ in w.rejected] == [(1, "outside")]
    assert "not inside a credit" in w.rejected[0][2]
    assert (forged.written == 0).all()   # never scattered


@pytest.mark.parametrize("cfg", [(1, 4096, 1024), (3, 4096, 1024), (4, 4096, 1024)], ids=lambda c: f"P{c[0]}")
def test_chunks_larger_than_their_credit_write_what_fits_and_ask_for_the_rest(cfg):
    """Several pieces gathered at once, as a chunk: the first that fit go by credit, the rest by
    grant (the remainder), while credits run out with pieces half gathered: every byte once,
    the ring back whole, nothing left waiting, and chunks did take both paths."""
    P, ring, piece = cfg
    mixed = 0
    for seed in range(3):
        w = CreditWorld(P=P, ring_bytes=ring, piece_bytes=piece, seed=seed, chunks=True)
        add_requests(w, 12, max_pieces=6)
        w.run()
        w.check()
        assert not w.rejected
        mixed += w.mixed
    assert mixed > 0


@pytest.mark.parametrize("seed", range(4))
def test_split_chunks_of_aborted_dead_and_reused_rooms_give_credits_and_grants_back(seed):
    w = CreditWorld(P=4, ring_bytes=4096, piece_bytes=1024, seed=seed, chunks=True, drop_msgs=0.1)
    abort_reuse_and_kill(w, add_requests(w, 10, max_pieces=6), [512, 1024, 64])
