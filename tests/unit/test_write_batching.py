"""Writes that size themselves on the direct path (transfer/protocol/prefill/write_batching.py and the
batching PrefillRoom): units wait for their layers, the next write starts only when the previous
one completed and takes every ready unit at the front, merged; a unit that is not ready holds
back every unit behind it; nothing is reported done while a unit is held."""

import itertools

import numpy as np
import pytest
import torch

from kvstage.transfer.config import Timeouts
from kvstage.transfer.layout import KVLayout
from kvstage.transfer.poll import KVPoll
from kvstage.transfer.protocol.actions import AwaitUnit, PeerKey, PostWrite, Send
from kvstage.transfer.protocol.messages import RoomMeta, WriterDone
from kvstage.transfer.protocol.prefill.layer_sends import LayerGrouping, Unit
from kvstage.transfer.protocol.prefill.room import PrefillRoom
from kvstage.transfer.protocol.prefill.write_batching import UnitBatcher, merge_units

PAGES = np.arange(10, 14)


def unit(a, b, pages=PAGES, start=0, ready=()):
    return Unit(page_start=start, pages=pages, layers=range(a, b), ready=ready)


def test_consecutive_layers_of_the_same_pages_merge_and_nothing_else_does():
    other = np.arange(20, 24)
    got = merge_units([unit(0, 1, ready=("e0",)), unit(1, 3), unit(3, 4), unit(5, 6), unit(6, 7, pages=other),
                       unit(7, 8, start=4), unit(8, 9, start=4)])
    assert [(u.page_start, u.layers, u.pages.tolist()) for u in got] == [
        (0, range(0, 4), PAGES.tolist()),     # 0, 1-3, 3 follow on
        (0, range(5, 6), PAGES.tolist()),     # a gap at layer 4
        (0, range(6, 7), other.tolist()),     # other pages
        (4, range(7, 9), PAGES.tolist())]     # other positions, following on among themselves
    assert all(u.ready == () for u in got)


def test_a_batcher_lets_out_only_the_ready_units_at_the_front():
    b = UnitBatcher(room=5, ids=itertools.count())
    waits = [b.add(unit(i, i + 1, ready=(f"e{i}",)), now=float(i)) for i in range(4)]
    assert waits == [AwaitUnit(room=5, seq=i, ready=(f"e{i}",)) for i in range(4)]
    assert b.add(unit(4, 5), now=9.0) is None          # nothing to wait on: ready at once
    assert b.unit_ready(2) and b.unit_ready(1)
    assert b.take() == [] and len(b) == 5               # unit 0 holds the others back
    assert b.oldest_waiting() == 0.0
    assert b.unit_ready(0)
    assert [u.layers for u in b.take()] == [range(0, 3)] and b.merged == 2
    assert b.oldest_waiting() == 3.0
    assert b.unit_ready(3) and not b.unit_ready(3 + 100) and not b.unit_ready(0)   # unknown or gone
    assert [u.layers for u in b.take()] == [range(3, 5)] and len(b) == 0 and b.oldest_waiting() is None


# -- a batching room ---------------------------------------------------------------------------------
LAYERS = 8
LAYOUT = KVLayout(num_layers=LAYERS, total_kv_heads=2, head_dim=4, dtype=torch.uint8, page_size=2, tp_size=1,
                  tp_rank=0, mla=False)
DEC = PeerKey("decode", 0, 2000)
N = 4
BATCH = LayerGrouping(size=4, batch=True)


def room(grouping=BATCH, staged=False, timeouts=None, ids=None):
    r = PrefillRoom(room=7, num_pages=N, layout=LAYOUT, me=1000, now=0.0, timeouts=timeouts or Timeouts(),
                    op_ids=ids or itertools.count(1), grouping=grouping)
    r.add_meta(DEC, 1, RoomMeta(src=DEC.incarnation, dst=1000, room=7, session=3, num_pages=N, staged=staged,
                                dst_pages=b"" if staged else np.arange(N, dtype="<i8").tobytes()), 1.0)
    return r


def writes(actions):
    return [a.op for a in actions if isinstance(a, PostWrite)]


def awaits(actions):
    return [a for a in actions if isinstance(a, AwaitUnit)]


def send_every_layer(r):
    """Every layer's send at once, each with its own readiness object, as a forward pass issues
    them; the actions and the unit number of each layer."""
    out = []
    for layer in range(LAYERS):
        out += r.add_chunk(PAGES, None, 1.0, layers=range(layer, layer + 1), ready=(f"event {layer}",))
    return out, [w.seq for w in awaits(out)]


def test_the_next_write_takes_every_ready_layer_once_the_previous_one_completed():
    r = room()
    out, seq = send_every_layer(r)
    assert [w.ready for w in awaits(out)] == [(f"event {i}",) for i in range(LAYERS)] and len(set(seq)) == LAYERS
    assert not r.ops                                             # nothing is written before its layer is ready
    first = writes(r.on_unit_ready(seq[0], None, 2.0))
    assert [op.layers for op in first] == [range(0, 1)] and first[0].ready == ()
    for layer in (1, 2, 4):                                      # ready while layer 0's write is in flight
        assert r.on_unit_ready(seq[layer], None, 2.0) == []
    second = writes(r.on_write_done(first[0].op_id, True, None, 3.0))
    assert [op.layers for op in second] == [range(1, 3)]        # 1 and 2 merged; 4 waits behind 3
    for layer in (3, 5, 6, 7):
        assert r.on_unit_ready(seq[layer], None, 3.0) == []
    third = r.on_write_done(second[0].op_id, True, None, 4.0)
    assert [op.layers for op in writes(third)] == [range(3, 8)]
    assert not [a for a in third if isinstance(a, Send) and isinstance(a.msg, WriterDone)]
    done = r.on_write_done(writes(third)[0].op_id, True, None, 5.0)
    assert [a.msg for a in done if isinstance(a, Send) and isinstance(a.msg, WriterDone)][0].writes == 3
    assert r.batcher is not None and r.batcher.merged == LAYERS - 3


def test_a_room_without_batching_or_on_the_staged_path_groups_as_before():
    for r in (room(grouping=LayerGrouping(size=4)), room(staged=True)):
        out, _ = send_every_layer(r)
        assert awaits(out) == [] and r.batcher is None
        assert [c.layers for c in r.chunks] == [range(0, 4), range(4, 8)]
        assert [c.ready for c in r.chunks] == [tuple(f"event {i}" for i in g) for g in (range(4), range(4, 8))]


def test_a_room_that_sends_before_the_metadata_keeps_its_groups():
    r = PrefillRoom(room=7, num_pages=N, layout=LAYOUT, me=1000, now=0.0, timeouts=Timeouts(),
                    op_ids=itertools.count(1), grouping=BATCH)
    send_every_layer(r)
    assert r.batcher is None and [c.layers for c in r.chunks] == [range(0, 4), range(4, 8)]


def test_layers_that_never_become_ready_fail_the_room_and_nothing_is_written():
    r = room()
    _, seq = send_every_layer(r)
    why = "waiting for the layers to be ready failed: RuntimeError: the stream was destroyed"
    out = r.on_unit_ready(seq[0], why, 2.0)
    assert r.state is KVPoll.Failed and r.failure == why and not writes(out)
    assert r.released and len(r.batcher) == 0
    assert r.on_unit_ready(seq[1], None, 3.0) == []              # late reports of a failed room: ignored


def test_a_report_for_an_earlier_use_of_the_room_id_names_no_unit_of_this_one():
    """The first use failed while its units were still waited on; the id is used again at once.
    The waiter's late report for the first use's layer 0 must not let the second use's layer 0
    be written before its own readiness object was waited on."""
    ids = itertools.count(1)   # the process's write ids, shared by the rooms (prefill_side.py)
    first = room(ids=ids)
    _, old = send_every_layer(first)
    first.abort(2.0)
    second = room(ids=ids)
    _, new = send_every_layer(second)
    assert not set(old) & set(new)
    assert second.on_unit_ready(old[0], None, 3.0) == [] and not second.ops
    assert [op.layers for op in writes(second.on_unit_ready(new[0], None, 3.0))] == [range(0, 1)]


def test_layers_not_ready_within_the_write_deadline_time_the_room_out():
    r = room(timeouts=Timeouts(write=5.0))
    send_every_layer(r)   # none of them reported ready
    r.tick(5.5)
    assert r.state is not KVPoll.Failed
    r.tick(6.5)
    assert r.state is KVPoll.Failed and "not ready" in r.failure and r.released


@pytest.mark.parametrize("order", [list(range(LAYERS)), list(reversed(range(LAYERS))), [3, 0, 7, 1, 2, 6, 5, 4]])
def test_every_layer_is_written_once_in_any_readiness_order(order):
    r = room()
    _, seq = send_every_layer(r)
    posted, inflight, told_done = [], [], []
    for layer in order:
        for op in writes(r.on_unit_ready(seq[layer], None, 2.0)):
            posted.append(op.layers)
            inflight.append(op)
        while inflight:   # complete what is in flight, which may start the next write
            out = r.on_write_done(inflight.pop(0).op_id, True, None, 3.0)
            told_done += [len(posted)] * sum(isinstance(a, Send) and isinstance(a.msg, WriterDone) for a in out)
            for op in writes(out):
                posted.append(op.layers)
                inflight.append(op)
    assert sorted(layer for rng in posted for layer in rng) == list(range(LAYERS))
    assert told_done == [len(posted)]   # once, after the last write, never while a layer was still held
    assert all(a.stop == b.start for a, b in zip(posted, posted[1:]))   # in layer order
