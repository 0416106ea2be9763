from hypothesis import given, settings
from hypothesis import strategies as st

from kvstage.transfer.protocol.leases import Lease


def test_alive_and_fence_basics():
    w = Lease(10, now=0)
    assert w.alive(10) and not w.alive(10.1)
    assert w.may_write(9.9) and not w.may_write(10)
    seq, ack = w.next_heartbeat(5)
    assert (seq, ack) == (1, 0)
    w.on_heartbeat(seq=3, ack=1, now=6)       # the peer got our heartbeat 1 (sent at 5)
    assert w.may_write(14.9) and not w.may_write(15)
    assert w.alive(16) and w.next_heartbeat(7) == (2, 3)
    w.on_heartbeat(seq=2, ack=0, now=8)       # stale ack does not move the fence back
    assert w.may_write(14.9) and w.peer_seq == 3


@given(st.lists(st.tuples(st.floats(0, 3), st.floats(0, 2), st.booleans()), min_size=1, max_size=80))
@settings(max_examples=300, deadline=None)
def test_writer_fence_always_ends_before_the_reader_declares_it_lost(steps):
    """Two peers exchanging heartbeats with random delays and losses: whenever the reader
    considers the writer lost, the writer's own fence has already stopped it."""
    L = 4.0
    now = 0.0
    writer, reader = Lease(L, now), Lease(L, now)
    in_flight = []  # (arrival time, to_reader, seq, ack)
    for gap, delay, lost in steps:
        now += gap
        for m in sorted([m for m in in_flight if m[0] <= now]):
            in_flight.remove(m)
            (reader if m[1] else writer).on_heartbeat(m[2], m[3], m[0])
        s, a = writer.next_heartbeat(now)
        if not lost:
            in_flight.append((now + delay, True, s, a))
        s, a = reader.next_heartbeat(now)
        if not lost:
            in_flight.append((now + delay, False, s, a))
        for t in (now, now + 0.5, now + 1.5):
            if not reader.alive(t):
                assert not writer.may_write(t)
