"""Layer-wise sending through the pure rooms (protocol_sim.World): every (page, layer, K/V,
head) byte of a decode rank is written exactly once and bit-exact, for every P, D in {1, 2, 4},
staged and direct, per-layer, grouped and whole sends, in order and shuffled inside a chunk,
any group size and length threshold, with prefix hits and MLA."""

import itertools

import pytest
from protocol_sim import Geometry, World

from kvstage.transfer.poll import KVPoll
from kvstage.transfer.protocol.prefill.layer_sends import LayerGrouping

LAYERS = 6
SENDS = {"per_layer": [range(i, i + 1) for i in range(LAYERS)],
         "threes": [range(0, 3), range(3, 6)],
         "uneven": [range(0, 1), range(1, 5), range(5, 6)],
         "all": [range(0, LAYERS)]}
GROUPINGS = {"per_chunk": LayerGrouping(), "g1": LayerGrouping(size=1), "g4": LayerGrouping(size=4),
             "g2_above_16": LayerGrouping(size=2, min_tokens=16),   # pages of 2 tokens: rooms of 6 pages fall below
             "batch": LayerGrouping(size=4, batch=True)}             # writes that size themselves (direct)


def run(P, D, sends, grouping, *, staged=True, mla=False, shuffle=False, prefix=0, seed=0, n=12, chunks=(5, 7),
        buffer_bytes=4096, ready_objects=False):
    g = Geometry(P=P, D=D, H=1 if mla else 4, layers=LAYERS, mla=mla, staged=staged, ring_bytes=8192,
                 buffer_bytes=buffer_bytes)
    w = World(g=g, seed=seed, grouping=grouping, ready_objects=ready_objects)
    w.add_room(1, n, list(chunks), layer_sends=SENDS[sends], shuffle_layers=shuffle, prefix=prefix)
    w.settle()
    return w


@pytest.mark.parametrize("P, D", list(itertools.product((1, 2, 4), repeat=2)))
@pytest.mark.parametrize("sends", sorted(SENDS))
@pytest.mark.parametrize("grouping", sorted(GROUPINGS))
def test_every_byte_lands_exactly_once(P, D, sends, grouping):
    for staged, shuffle in ((True, False), (False, True)):
        w = run(P, D, sends, GROUPINGS[grouping], staged=staged, shuffle=shuffle, seed=P * 10 + D)
        assert set(w.status_p.values()) == set(w.status_d.values()) == {KVPoll.Success}, (staged, w.status_d)
        assert w.check_bytes(1) and w.written_once(1)
        assert w.overlaps == 0


@pytest.mark.parametrize("P, D", list(itertools.product((1, 2, 4), repeat=2)))
@pytest.mark.parametrize("sends", sorted(SENDS))
def test_batching_rooms_write_each_byte_once_and_only_once_ready(P, D, sends):
    """Direct, each send with a readiness object reported back in random order: a batching room
    writes every byte exactly once, never a layer before it was ready, and merges sends."""
    merged = 0
    for seed, prefix in itertools.product(range(3), (0, 3)):
        w = run(P, D, sends, GROUPINGS["batch"], staged=False, shuffle=True, prefix=prefix, seed=seed,
                ready_objects=True)
        assert set(w.status_p.values()) == set(w.status_d.values()) == {KVPoll.Success}, w.status_d
        assert w.check_bytes(1) and w.written_once(1) and w.unready_reads == 0
        merged += sum(r.batcher.merged for r in w.rooms_p.values() if r.batcher is not None)
    if sends == "per_layer":   # shuffled: only layers that follow on in the order sent can merge
        assert merged > 0


@pytest.mark.parametrize("P, D", [(1, 2), (2, 1), (4, 2)])
def test_prefix_hits_and_short_requests(P, D):
    for prefix, n, chunks in ((3, 12, (5, 7)), (6, 6, ()), (0, 6, (2, 4))):
        if not chunks:
            chunks = (6,)
            prefix = 2
        w = run(P, D, "per_layer", GROUPINGS["g2_above_16"], shuffle=True, prefix=prefix, n=n, chunks=chunks)
        assert set(w.status_d.values()) == {KVPoll.Success}
        assert w.check_bytes(1) and w.written_once(1)


@pytest.mark.parametrize("P, D", [(1, 2), (2, 1), (2, 2)])
def test_mla_goes_direct_layer_by_layer(P, D):
    w = run(P, D, "per_layer", GROUPINGS["g1"], mla=True, shuffle=True)
    assert set(w.status_d.values()) == {KVPoll.Success}
    assert w.check_bytes(1) and w.written_once(1)


def test_groups_decide_the_number_of_writes():
    """One staged write per (rank pair, chunk, layer group) when the ring takes each chunk whole:
    2 chunks x 6 layers in groups of 4 -> groups [0, 4) and [4, 6) -> 4 pieces per pair."""
    for grouping, want in (("g4", 4), ("g1", 12), ("per_chunk", 2)):
        w = run(2, 1, "per_layer", GROUPINGS[grouping])
        r = w.rooms_d[(0, 1)]
        assert set(w.status_d.values()) == {KVPoll.Success}
        assert r.writes_in == 2 * want, grouping   # two writers


def test_a_layer_group_piece_holds_as_many_pages_as_the_cap_allows():
    """A piece's page count follows the layers it carries: with buffers of 2 pages of every
    layer (384 bytes: 2 heads x 6 layers x K/V x 2 tokens x 4 bytes per page), a chunk of 12
    pages sent per chunk makes 6 pieces per writer, and sent one layer at a time 6 pieces too
    (one per layer, 12 pages of one layer each), not 6 per layer."""
    for grouping, want in (("per_chunk", 6), ("g1", 6)):
        w = run(2, 1, "per_layer", GROUPINGS[grouping], n=12, chunks=(12,), buffer_bytes=384)
        assert set(w.status_d.values()) == {KVPoll.Success}
        assert w.check_bytes(1) and w.written_once(1)
        assert w.rooms_d[(0, 1)].writes_in == 2 * want, grouping   # two writers


PP_STAGES = {"halves": (range(0, 3), range(3, 6)), "uneven3": (range(0, 1), range(1, 5), range(5, 6))}


@pytest.mark.parametrize("P, D", list(itertools.product((1, 2, 4), repeat=2)))
@pytest.mark.parametrize("stages", sorted(PP_STAGES))
@pytest.mark.parametrize("sends", ["per_layer", "all", None])
def test_pp_prefill_every_byte_lands_exactly_once(P, D, stages, sends):
    """A PP prefill: each stage's P ranks send only their layers (per layer, the whole stage per
    send, or plain chunks); the decode rank expects writers per (stage, head range) and is
    complete only once every stage wrote its layers."""
    for staged, shuffle, prefix in ((True, False, 0), (False, True, 3)):
        g = Geometry(P=P, D=D, H=4, layers=LAYERS, staged=staged, ring_bytes=8192, buffer_bytes=4096,
                     stages=PP_STAGES[stages])
        w = World(g=g, seed=P * 10 + D, grouping=GROUPINGS["g1"])
        w.add_room(1, 12, [5, 7], layer_sends=SENDS[sends] if sends else None, shuffle_layers=shuffle, prefix=prefix)
        w.settle()
        assert set(w.status_p.values()) == set(w.status_d.values()) == {KVPoll.Success}, (staged, w.status_d)
        assert len(w.status_p) == P * len(g.pp)
        assert w.check_bytes(1) and w.written_once(1)
        assert w.overlaps == 0


def test_pp_stage_missing_keeps_the_decode_room_waiting():
    """Only stage 0 sends: its layers land, the room is not complete (the other stage's cells
    are still due) and it fails at its deadline rather than succeeding."""
    g = Geometry(P=2, D=1, H=4, layers=LAYERS, staged=False, stages=PP_STAGES["halves"])
    w = World(g=g, seed=3)
    w.add_room(1, 12, [12])
    w.pending_chunks = [c for c in w.pending_chunks if c[0] < 2]   # stage 1 (ranks 2, 3) never sends
    w.run()
    r = w.rooms_d[(0, 1)]
    assert r.state is not KVPoll.Success and r.tracker is not None and not r.tracker.complete
    assert r.tracker.pages_done == 0


DRAFTS = {"equal1": (1, 1), "equal2": (2, 2), "decode_more": (1, 2), "decode_only": (0, 2)}


@pytest.mark.parametrize("P, D", list(itertools.product((1, 2, 4), repeat=2)))
@pytest.mark.parametrize("drafts", sorted(DRAFTS))
def test_draft_entries_land_exactly_once(P, D, drafts):
    """Draft KV entries (speculative decoding) after the model's layers: every (page, entry,
    K/V, head) byte the prefill has is written exactly once and bit-exact, staged and direct,
    sent with the layers, as entries of their own and in plain chunks; the decode's draft
    entries beyond the prefill's are never written (their sentinel stays) and the room
    succeeds."""
    dp, dd = DRAFTS[drafts]
    entries = LAYERS + dp
    for staged, sends, shuffle, mla in ((True, None, False, False),
                                        (False, [range(i, i + 1) for i in range(entries)], True, False),
                                        (True, [range(0, LAYERS), range(LAYERS, entries)] if dp else None, False,
                                         False),
                                        (False, [range(0, 2), range(2, entries)], True, True)):
        g = Geometry(P=P, D=D, H=1 if mla else 4, layers=LAYERS, mla=mla, staged=staged, ring_bytes=8192,
                     buffer_bytes=4096, draft_p=dp, draft_d=dd)
        w = World(g=g, seed=P * 10 + D, grouping=GROUPINGS["g1"])
        w.add_room(1, 12, [5, 7], layer_sends=sends, shuffle_layers=shuffle, prefix=3 if not staged else 0)
        w.settle()
        assert set(w.status_p.values()) == set(w.status_d.values()) == {KVPoll.Success}, (staged, sends, w.status_d)
        assert w.check_bytes(1) and w.written_once(1), (staged, sends, mla)
        assert w.overlaps == 0
