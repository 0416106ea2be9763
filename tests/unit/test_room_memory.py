"""Memory a room holds while in flight (issue 52: at most 4 KiB per room on each side), measured
as the fleet simulator measures it (sim/report.py `room_memory`, sim/deep_size.py) on a small
fleet with both paths: TP 8 and 4 prefill engines, TP 1 to 8 decode engines (staged and direct
rooms), a GQA and an MLA model. docs/scale.md has the figures at fleet size."""

import sys

from kvstage.sim.deep_size import deep_size
from kvstage.sim.fleet import Fleet, FleetConfig, Model
from kvstage.sim.report import room_memory
from kvstage.transfer.poll import KVPoll
from kvstage.transfer.protocol.prefill.flows import FlowState

MIXED = FleetConfig(prefill_engines=4, decode_engines=4, prefill_tp=(8, 4), decode_tp=(1, 2, 4, 8),
                    models=(Model(name="gqa-p16", mla=False, heads=8, layers=4, page_size=16),
                            Model(name="mla-p64", mla=True, heads=1, layers=4, page_size=64)),
                    requests=240, in_flight=200, deaths=0, seed=1)


def rooms_in_flight(fleet: Fleet) -> list:
    return [r for rank in fleet.ranks if rank.alive for r in rank.rooms.values()
            if r.state not in (KVPoll.Success, KVPoll.Failed)]


def test_a_room_in_flight_holds_at_most_4_kib_on_each_side():
    fleet = Fleet(MIXED)
    memory: dict = {}
    fleet.at(0.03, "hook", lambda: memory.update(room_memory(fleet, 100)))
    fleet.run(until=0.031)
    for side in ("prefill", "decode"):
        assert memory[side]["sampled"] >= 50, memory
        assert memory[side]["mean_bytes"] <= 4096, (side, memory[side])


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
