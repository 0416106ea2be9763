"""Memory a room holds while in flight (issue 52: at most 4 KiB per room on each side), measured
as the fleet simulator measures it (sim/report.py `room_memory`, sim/deep_size.py) on a small
fleet with both paths: TP 8 and 4 prefill engines, TP 1 to 8 decode engines (staged and direct
rooms), a GQA and an MLA model. docs/scale.md has the figures at fleet size."""

import sys

from kvstage.sim.deep_size import deep_size
from kvstage.sim.fleet import Fleet, FleetConfig, Model
from kvstage.sim.report import room_memory
from kvstage.transfer.poll import KVPoll
from kvstage.transfer.protocol.actions import PeerKey
from kvstage.transfer.protocol.prefill.flows import NO_ENTRIES, Flow, FlowState

MIXED = FleetConfig(prefill_engines=4, decode_engines=4, prefill_tp=(8, 4), decode_tp=(1, 2, 4, 8),
                    models=(Model(name="gqa-p16", mla=False, heads=8, layers=4, page_size=16),
                            Model(name="mla-p64", mla=True, heads=1, layers=4, page_size=64)),
                    requests=240, in_flight=200, deaths=0, seed=1)


def rooms_in_flight(fleet: Fleet) -> list:
    return [r for rank in fleet.ranks if rank.alive for r in rank.rooms.values()
            if r.state not in (KVPoll.Success, KVPoll.Failed)]


def test_a_room_in_flight_holds_at_most_4_kib_on_each_side():
    """The goal (issue 52) at p99 on each side, measured on every room in flight; on the prefill
    side on every room (its largest), whose flows share their empty maps (flows.py)."""
    fleet = Fleet(MIXED)
    memory: dict = {}
    fleet.at(0.03, "hook", lambda: memory.update(room_memory(fleet, sample=10_000)))
    fleet.run(until=0.031)
    for side in ("prefill", "decode"):
        m = memory[side]
        assert m["sampled"] == m["rooms_in_flight"] >= 500, (side, m)
        assert m["mean_bytes"] <= 4096 and m["p99_bytes"] <= 4096, (side, m)
    assert memory["prefill"]["max_bytes"] <= 4096, memory["prefill"]


def test_a_flow_keeps_its_empty_records_shared_until_it_writes_them():
    """A flow's per-chunk maps are the shared read-only NO_ENTRIES until written, then a dict of
    its own (written in place from then on); granted chunks are bits; tags a list once one came."""
    a, b = (Flow(peer=PeerKey("decode", 0, 2000), session=s, assignment=None, staged=True) for s in (1, 2))
    assert a.requested_at is a.asked_again is a.remainders is b.requested_at is NO_ENTRIES
    a.note_asked(3, 1.0)
    own = a.requested_at
    a.note_asked(4, 1.5)
    a.note_asked_again(3, 2.0)
    a.note_remainder(3, 2)
    assert a.requested_at is own and own == {3: 1.0, 4: 1.5}
    assert (a.asked_again, a.remainders) == ({3: 2.0}, {3: 2})
    assert b.requested_at is b.asked_again is b.remainders is NO_ENTRIES and len(NO_ENTRIES) == 0
    a.grant(2)
    a.grant(2)
    a.grant(0)
    assert a.granted_count == 2 and b.granted_count == 0
    assert [c for c in (-1, 0, 1, 2, 3, 10**6) if a.is_granted(c)] == [0, 2]
    a.note_tags(())
    assert a.landed_tags == ()
    a.note_tags((b"t1",))
    a.note_tags((b"t2", b"t3"))
    assert a.landed_tags == [b"t1", b"t2", b"t3"] and b.landed_tags == ()


def test_rooms_keep_their_attributes_in_a_shared_key_dictionary():
    """CPython gives each instance a dictionary of its own (about 1.3 KiB more) once a class has
    30 instance attributes or more (room_base.py); a room must stay under that."""
    fleet = Fleet(MIXED)
    fleet.run(until=0.02)
    rooms = rooms_in_flight(fleet)
    assert {type(r).__name__ for r in rooms} == {"PrefillRoom", "DecodeRoom"}
    for room in rooms[::50]:
        assert len(vars(room)) < 30, (type(room).__name__, sorted(vars(room)))
        assert sys.getsizeof(vars(room)) < 600, (type(room).__name__, sys.getsizeof(vars(room)))


class _Holder:
    __slots__ = ("state",)

    def __init__(self, state: object):
        self.state = state


def test_an_enum_member_is_not_counted_as_a_rooms_own():
    """One object per member in the process (a flow's FlowState): holding it costs a room its
    pointer only, as holding None does; a value of the room's own still counts."""
    assert deep_size(_Holder(FlowState.WRITING)) == deep_size(_Holder(None))
    assert deep_size(_Holder([1000, 2000])) > deep_size(_Holder(None))
