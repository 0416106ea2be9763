"""Prefill and decode room state machines together, over many random interleavings."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from protocol_sim import Geometry, World

from kvstage.transfer.poll import KVPoll

GEOMS = [
    Geometry(P=1, D=1, H=2), Geometry(P=2, D=2, H=4),
    Geometry(P=4, D=2, H=8), Geometry(P=2, D=4, H=8),
    Geometry(P=1, D=4, H=2), Geometry(P=4, D=1, H=2),
    Geometry(P=2, D=1, H=1, mla=True), Geometry(P=1, D=2, H=1, mla=True),
    Geometry(P=3, D=2, H=6), Geometry(P=8, D=2, H=2),
]


def run_rooms(g, seed, rooms, **kw):
    w = World(g=g, seed=seed, **kw)
    for room, (n, chunks) in rooms.items():
        w.add_room(room, n, chunks)
    w.run()
    return w


def assert_all_succeeded(w, g, rooms):
    """Every room succeeded on every rank, bit-exact on the decode side."""
    for room in rooms:
        for d in range(g.D):
            assert w.status_d[(d, room)] is KVPoll.Success, w.rooms_d[(d, room)].failure
        for p in range(g.P):
            assert w.status_p[(p, room)] is KVPoll.Success, w.rooms_p[(p, room)].failure
        assert w.check_bytes(room)


@pytest.mark.parametrize("g", GEOMS, ids=lambda g: f"P{g.P}D{g.D}H{g.H}{'mla' if g.mla else ''}")
@pytest.mark.parametrize("staged", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_rooms_complete_bit_exact(g, staged, seed):
    g = Geometry(**{**g.__dict__, "staged": staged})
    rooms = {1: (5, [2, 3]), 2: (1, [1]), 3: (12, [4, 0, 8]), 4: (7, [7])}
    w = run_rooms(g, seed, rooms)
    assert_all_succeeded(w, g, rooms)
    assert w.overlaps == 0
    for d in range(g.D):
        assert w.rings[d].live_regions == 0  # every region freed
    assert len(w.released_d) == len(w.rooms_d) and len(w.released_p) == len(w.rooms_p)


@given(st.sampled_from(GEOMS[:6] + GEOMS[8:]), st.integers(0, 10**6),
       st.lists(st.tuples(st.integers(1, 20), st.integers(1, 4)), min_size=1, max_size=8),
       st.sampled_from([512, 1024, 4096]))
@settings(max_examples=120, deadline=None)
def test_random_rooms_small_rings(g, seed, specs, ring):
    """Many rooms sharing a ring far smaller than the requests: splits, wraps, any order."""
    g = Geometry(**{**g.__dict__, "ring_bytes": ring, "buffer_bytes": 1024})
    rooms = {}
    for i, (n, k) in enumerate(specs):
        cuts = [n // k] * (k - 1)
        rooms[i + 1] = (n, cuts + [n - sum(cuts)])
    w = run_rooms(g, seed, rooms, dup_tags=0.2)
    for room in rooms:
        assert all(w.status_d[(d, room)] is KVPoll.Success for d in range(g.D))
        assert all(w.status_p[(p, room)] is KVPoll.Success for p in range(g.P))
        assert w.check_bytes(room)
    assert w.overlaps == 0


@pytest.mark.parametrize("seed", range(6))
def test_lost_tags_fail_cleanly_on_both_sides(seed):
    g = Geometry(P=4, D=2, H=8)
    rooms = {1: (8, [4, 4]), 2: (6, [6])}
    w = run_rooms(g, seed, rooms, drop_tags=0.5)
    # nothing more can happen; time passes: arrival deadlines fire
    for _ in range(3):
        w.now += 6
        w.tick_all()
        w.run()
    assert any(st_ is KVPoll.Failed for st_ in w.status_d.values()), "half the tags lost, yet no room failed"
    for (d, room), st_ in w.status_d.items():
        assert st_ in (KVPoll.Success, KVPoll.Failed)
        for p in w.mapping.writers_of(d):    # its writers end the way the decode rank did
            assert w.status_p[(p, room)] is st_, (d, p, room, w.rooms_p[(p, room)].failure)
            if st_ is KVPoll.Failed:
                # told by the decode rank: its arrival deadline (5 s) is up well before the writers'
                # own wait for its confirmation (arrival + scatter, 10 s) would fail them
                r = w.rooms_p[(p, room)]
                assert r.failure_kind == f"remote_{w.rooms_d[(d, room)].failure_kind}", (d, p, room, r.failure)
                assert f"decode rank {d}" in r.failure, (d, p, room, r.failure)
        if st_ is KVPoll.Success:
            assert w.check_bytes(room, ranks=[d])
    for rooms_, kind in ((w.rooms_d, "decode"), (w.rooms_p, "prefill")):
        for key, r in rooms_.items():
            assert r.state in (KVPoll.Success, KVPoll.Failed), (kind, key, r.state)
            assert (r.state is KVPoll.Failed) == bool(r.failure), (kind, key, r.failure)
    # a failed room's ring regions are all released once writers quiesced
    assert all(r.live_regions == 0 for r in w.rings)
    assert w.released_d == set(w.rooms_d) and w.released_p == set(w.rooms_p)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_abort_mid_transfer_reaches_the_other_side(seed, side):
    g = Geometry(P=2, D=4, H=8)
    w = World(g=g, seed=seed)
    w.add_room(1, 10, [3, 3, 4])
    w.add_room(2, 4, [4])
    for _ in range(40):
        w.step()
    done = (KVPoll.Success, KVPoll.Failed)
    if side == "prefill":
        assert w.rooms_p[(0, 1)].state not in done
        w.apply_p(0, w.rooms_p[(0, 1)].abort(w.now))
        # its decode peers that did not hold every byte yet
        failed_p = [0]
        failed_d = [a.decode_rank for a in w.mapping.for_prefill(0) if w.rooms_d[(a.decode_rank, 1)].state not in done]
    else:
        assert w.rooms_d[(1, 1)].state not in done
        w.apply_d(1, w.rooms_d[(1, 1)].abort(w.rings[1], w.now))
        failed_p, failed_d = w.mapping.writers_of(1), [1]
    assert failed_p and failed_d
    w.run()
    w.refresh_status()
    # the aborting rank's peers all fail, with a reason, and every failed room is released
    for p in failed_p:
        assert w.status_p[(p, 1)] is KVPoll.Failed and w.rooms_p[(p, 1)].failure, (p, w.rooms_p[(p, 1)].failure)
    for d in failed_d:
        assert w.status_d[(d, 1)] is KVPoll.Failed and w.rooms_d[(d, 1)].failure, (d, w.rooms_d[(d, 1)].failure)
    for rooms_ in (w.rooms_p, w.rooms_d):
        for key, r in rooms_.items():
            if r.state is KVPoll.Failed:
                assert r.failure, key
    assert {k for k in w.rooms_p if k[1] == 1 and w.status_p[k] is KVPoll.Failed} <= w.released_p
    assert {k for k in w.rooms_d if k[1] == 1 and w.status_d[k] is KVPoll.Failed} <= w.released_d
    # the other room is untouched and exact
    assert all(w.status_d[(d, 2)] is KVPoll.Success for d in range(4)) and w.check_bytes(2)
    assert all(w.status_p[(p, 2)] is KVPoll.Success for p in range(2))
    assert all(r.live_regions == 0 for r in w.rings)


@pytest.mark.parametrize("g", [Geometry(P=2, D=2, H=4), Geometry(P=4, D=2, H=8), Geometry(P=2, D=4, H=8)],
                         ids=lambda g: f"P{g.P}D{g.D}H{g.H}")
@pytest.mark.parametrize("staged", [True, False])
@pytest.mark.parametrize("late", ["ok", "failed"])
@pytest.mark.parametrize("seed", range(3))
def test_decode_rank_leaving_after_it_confirmed_does_not_fail_the_prefill(g, staged, late, seed):
    """The decode rank has every byte, confirms and leaves (closing: Goodbye) before the prefill
    rank has seen its own last writes complete (the shell handles wire messages before queued
    completions). The prefill room still succeeds, whether the shell then reports those writes
    done or failed (released when the peer was disconnected): both sides agree on Success."""
    g = Geometry(**{**g.__dict__, "staged": staged})
    w = World(g=g, seed=seed, hold_completions=True)
    w.add_room(1, 9, [4, 5])
    w.add_room(2, 3, [3])
    w.run()
    assert len(w.status_d) == 2 * g.D and all(st_ is KVPoll.Success for st_ in w.status_d.values()), w.status_d
    assert w.completions, "the writers saw no completion yet"
    for (p, _), r in w.rooms_p.items():
        for d in range(g.D):
            w.apply_p(p, r.on_peer_lost(w.kd[d], "it said goodbye: closing", w.now))
    for p, op in w.completions:
        w.apply_p(p, w.rooms_p[(p, op.room)].on_write_done(op.op_id, late == "ok", "released", w.now))
    w.run()
    for key, r in w.rooms_p.items():
        assert r.state is KVPoll.Success and r.released, (key, r.failure)
    assert all(w.check_bytes(room) for room in (1, 2))


def test_prefill_abort_before_any_metadata_still_releases_decode():
    """The prefill aborts before the decode metadata arrives: the late metadata is answered
    with the failure AND a promise not to write, so the decode side releases the room."""
    g = Geometry(P=2, D=2, H=4, staged=False)
    w = World(g=g, seed=3)
    w.add_room(1, 4, [2, 2])
    w.apply_p(0, w.rooms_p[(0, 1)].abort(w.now))   # before any message was delivered
    w.run()
    w.refresh_status()
    assert w.status_p[(0, 1)] is KVPoll.Failed
    assert w.status_d[(0, 1)] is KVPoll.Failed and "abort" in w.rooms_d[(0, 1)].failure
    assert (0, 1) in w.released_d


@given(st.sampled_from(GEOMS), st.integers(0, 10**6), st.sampled_from([0.05, 0.2]), st.booleans())
@settings(max_examples=80, deadline=None)
def test_lost_control_messages_never_hang_or_corrupt(g, seed, loss, staged):
    """Any control message may be lost (and tags too): every room still ends, on both sides,
    either bit-exact Success or Failed with a reason, and releases everything it held."""
    g = Geometry(**{**g.__dict__, "staged": staged, "ring_bytes": 2048, "buffer_bytes": 1024})
    w = World(g=g, seed=seed, drop_msgs=loss, drop_tags=loss / 2)
    rooms = {1: (5, [2, 3]), 2: (1, [1]), 3: (9, [4, 5])}
    for room, (n, chunks) in rooms.items():
        w.add_room(room, n, chunks)
    w.settle()
    for room in rooms:
        for d in range(g.D):
            r = w.rooms_d[(d, room)]
            assert r.state in (KVPoll.Success, KVPoll.Failed) and r.released, (room, d, r.state)
            assert r.state is KVPoll.Success or r.failure
        for p in range(g.P):
            r = w.rooms_p[(p, room)]
            assert r.state in (KVPoll.Success, KVPoll.Failed) and r.released, (room, p, r.state)
        if all(w.rooms_d[(d, room)].state is KVPoll.Success for d in range(g.D)):
            assert w.check_bytes(room), "a room reported Success with wrong bytes"
    assert w.overlaps == 0
    assert all(r.live_regions == 0 for r in w.rings)


def test_plan_room_decides_the_path_and_refuses_impossible_pages():
    import torch

    from kvstage.transfer.layout import KVLayout
    from kvstage.transfer.protocol.actions import PeerKey
    from kvstage.transfer.protocol.decode.room import WriterOffer, plan_room
    from kvstage.transfer.protocol.head_mapping import compute_assignments

    lay = KVLayout(num_layers=2, total_kv_heads=8, head_dim=16, dtype=torch.bfloat16, page_size=4, tp_size=2, tp_rank=0)  # decode rank 0 of TP 2
    m = compute_assignments(4, 2, 8)
    offers = {p: WriterOffer(PeerKey("p", p, 10 + p), True, 1 << 20) for p in (0, 1)}
    kw = dict(staging=True, ring_size=1 << 20, ring_align=256, piece_cap=1 << 20, epoch=3)
    plan = plan_room(lay, m, offers, {}, **kw)
    assert plan.staged and plan.max_piece_pages > 0 and [a.prefill_rank for _, a in plan.writers] == [0, 1]
    assert not plan_room(lay, m, offers, {}, **{**kw, "staging": False}).staged
    assert not plan_room(lay, m, {**offers, 1: WriterOffer(offers[1].key, False, 1 << 20)}, {}, **kw).staged
    assert not plan_room(lay, m, offers, {}, **{**kw, "ring_size": 0}).staged
    eq = compute_assignments(2, 2, 8)
    assert not plan_room(lay, eq, {0: offers[0]}, {}, **kw).staged  # equal TP: direct whole pages
    refused = plan_room(lay, m, offers, {}, **{**kw, "ring_size": 1024})
    assert refused.kind == "staging" and "never fit" in refused.reason
    tiny_cap = plan_room(lay, m, offers, {}, **{**kw, "piece_cap": 1})
    assert tiny_cap.staged and tiny_cap.max_piece_pages >= 1  # the cap never makes a page impossible


@pytest.mark.parametrize(
    "g", [Geometry(P=2, D=4, H=8, staged=False), Geometry(P=2, D=2, H=4, staged=False)], ids=["heads", "whole"]
)
@pytest.mark.parametrize("seed", range(3))
def test_direct_writes_split_by_descriptor_budget(g, seed):
    """A chunk whose write would exceed the descriptor budget goes out as several writes (by
    page range, each with its own tag); the room still completes bit-exact."""
    w = World(g=g, seed=seed, max_ranges=8, dup_tags=0.2)
    w.add_room(1, 12, [7, 5])
    w.add_room(2, 3, [3])
    w.run()
    for room in (1, 2):
        assert all(w.status_d[(d, room)] is KVPoll.Success for d in range(g.D))
        assert w.check_bytes(room)
    assert any(wr.landed_writes > 2 for r in w.rooms_d.values() for wr in r.writers.values()), "chunks were split"


# -- the lifecycle serving engines drive: the page count late, the last chunk inferred ------------
@pytest.mark.parametrize("g", GEOMS, ids=lambda g: f"P{g.P}D{g.D}H{g.H}{'mla' if g.mla else ''}")
@pytest.mark.parametrize("staged", [True, False])
@pytest.mark.parametrize("seed", range(3))
def test_late_init_and_inferred_last_complete_bit_exact(g, staged, seed):
    """init(n) comes at a random point (before or after the decode metadata), and no chunk says
    it is the last: the room still ends exactly when the pages reach n."""
    g = Geometry(**{**g.__dict__, "staged": staged})
    w = World(g=g, seed=seed)
    rooms = {1: (5, [2, 3]), 2: (1, [1]), 3: (12, [4, 0, 8])}
    for room, (n, chunks) in rooms.items():
        w.add_room(room, n, chunks, late_init=True, infer_last=True)
    w.run()
    assert_all_succeeded(w, g, rooms)
    assert len(w.released_d) == len(w.rooms_d) and len(w.released_p) == len(w.rooms_p)


def test_a_late_sender_waits_for_input_then_checks_the_metadata_against_its_init():
    g = Geometry(P=1, D=1, H=2, staged=False)
    w = World(g=g, seed=0)
    w.add_room(1, 4, [4], late_init=True)
    w.pending_chunks.clear()  # no init, no chunk yet: the metadata alone
    w.run()
    r = w.rooms_p[(0, 1)]
    assert w.status_p[(0, 1)] is KVPoll.WaitingForInput and r.num_pages is None
    with pytest.raises(ValueError, match="before init"):
        r.add_chunk(np.arange(4), None, w.now)
    w.apply_p(0, r.init(3, w.now))  # the decode side asked for 4 pages
    w.run()
    assert w.status_p[(0, 1)] is KVPoll.Failed and "expects 4 pages" in r.failure
    assert w.status_d[(0, 1)] is KVPoll.Failed
    with pytest.raises(ValueError, match="init\\(\\) called twice"):
        r.init(4, w.now)


def test_an_explicit_last_that_disagrees_with_the_count_is_refused_and_changes_nothing():
    g = Geometry(P=1, D=1, H=2)
    w = World(g=g, seed=0)
    w.add_room(1, 4, [4])
    r = w.rooms_p[(0, 1)]
    with pytest.raises(ValueError, match="last chunk ends at page 2 of 4"):
        r.add_chunk(np.arange(2), True, w.now)
    assert r.pages_given == 0 and not r.last
    r.add_chunk(np.arange(2), None, w.now)
    assert r.pages_given == 2 and not r.last  # inferred: not the last yet
    r.add_chunk(np.arange(2, 4), None, w.now)
    assert r.last  # inferred: the pages reached the count


@pytest.mark.parametrize("g", GEOMS, ids=lambda g: f"P{g.P}D{g.D}H{g.H}{'mla' if g.mla else ''}")
@pytest.mark.parametrize("staged", [True, False])
def test_room_totals_count_every_byte_and_write_once_on_each_side(g, staged):
    g = Geometry(**{**g.__dict__, "staged": staged})
    rooms = {1: (5, [2, 3]), 2: (12, [4, 0, 8])}
    w = run_rooms(g, 1, rooms)
    for room, (n, _) in rooms.items():
        sent = [w.rooms_p[(p, room)].totals() for p in range(g.P)]
        landed = [w.rooms_d[(d, room)].totals() for d in range(g.D)]
        # every decode rank receives all its heads of every page: n pages x its local heads
        per_rank = [n * w.nt * g.page_size * g.head_dim * w.ld[d].local_heads for d in range(g.D)]
        assert [t.nbytes for t in landed] == per_rank
        assert sum(t.nbytes for t in sent) == sum(per_rank)
        assert sum(t.writes for t in sent) == sum(t.writes for t in landed) > 0  # one tag per write
        path = "staged" if staged and g.P != g.D and not g.mla else "direct"
        assert {t.path for t in landed} == {path}
        assert {t.path for t in sent} <= {path, "none"} and path in {t.path for t in sent}


# -- prefix hits on the decode side ------------------------------------------------------------------
@pytest.mark.parametrize("g", GEOMS, ids=lambda g: f"P{g.P}D{g.D}H{g.H}{'mla' if g.mla else ''}")
@pytest.mark.parametrize("staged", [True, False])
@pytest.mark.parametrize("seed", range(2))
def test_prefix_hits_send_only_the_rest_bit_exact(g, staged, seed):
    """Chunks 0-4, (empty), 4-12 of a 12-page request; the decode ranks hold k pages already:
    none, exactly a chunk boundary, inside a chunk, all but one. Late init on some rooms."""
    g = Geometry(**{**g.__dict__, "staged": staged})
    w = World(g=g, seed=seed)
    prefixes = {1: 0, 2: 4, 3: 5, 4: 11}
    for room, k in prefixes.items():
        w.add_room(room, 12, [4, 0, 8], late_init=room % 2 == 0, infer_last=room > 2, prefix=k)
    w.run()
    for room, k in prefixes.items():
        for d in range(g.D):
            assert w.status_d[(d, room)] is KVPoll.Success, w.rooms_d[(d, room)].failure
            assert (
                w.rooms_d[(d, room)].totals().nbytes == (12 - k) * w.nt * g.page_size * g.head_dim * w.ld[d].local_heads
            )
        for p in range(g.P):
            assert w.status_p[(p, room)] is KVPoll.Success, w.rooms_p[(p, room)].failure
            assert w.rooms_p[(p, room)].prefix == k
        assert w.check_bytes(room)  # the rest bit-exact, and the prefix pages untouched
    assert sorted(w.prefix_seen) == sorted((p, k) for p in range(g.P) for k in prefixes.values())


@pytest.mark.parametrize("staged", [True, False])
def test_decode_ranks_that_disagree_on_the_prefix_fail_the_request_on_both_sides(staged):
    g = Geometry(P=1, D=2, H=2, staged=staged)
    w = World(g=g, seed=3)
    w.add_room(1, 6, [3, 3], prefix=[2, 3])
    w.run()
    r = w.rooms_p[(0, 1)]
    assert w.status_p[(0, 1)] is KVPoll.Failed and "disagree on the prefix" in r.failure
    for d in range(2):
        assert w.status_d[(d, 1)] is KVPoll.Failed, w.rooms_d[(d, 1)].failure
    assert len(w.released_d) == 2 and len(w.released_p) == 1  # everything released
    for d in range(2):  # and no prefix page touched
        held = w.expected[(d, 1)][2]
        assert (w.cd[d][:, held] == 0xA5).all()
