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
    for now, writer, reader, _ in exchange([(*step, 0.0) for step in steps]):
        for t in (now, now + 0.5, now + 1.5):
            if not reader.alive(t):
                assert not writer.may_write(t)


def exchange(steps):
    """Two peers (a writer and a reader, lease 4 s) heartbeating each other: per step (gap,
    delay, lost, late), the clock moves by `gap`, what arrived by then is applied, and each sends
    a heartbeat that arrives `delay` later unless `lost`. Yields (now, writer, reader, late)."""
    now = 0.0
    writer, reader = Lease(4.0, now), Lease(4.0, now)
    in_flight = []  # (arrival time, to_reader, seq, ack)
    for gap, delay, lost, late in steps:
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
        yield now, writer, reader, late


def test_our_own_lateness_is_not_the_peers_silence():
    """Heard at 1, then our control thread was held up (the GIL, a long call) from 2 to 15: the
    peer's heartbeats of 2..15 wait in our socket, so its silence counts only up to our last
    complete read of it (`looked`), not up to now."""
    w = Lease(10, now=0)
    w.heard(1)
    assert not w.alive(15)                          # the old judgement: silent for 14 s
    assert w.alive(15, looked=2) and w.silence(15, looked=2) == 1
    assert w.alive(11, looked=11) and not w.alive(15, looked=11.5)   # looked in time: no excuse
    assert w.silence(5, looked=9) == 4              # `looked` never counts past now
    w.heard(15.01)                                  # the next round reads the waiting heartbeats
    assert w.alive(20, looked=20)


def test_a_frozen_peer_is_still_lost_at_the_first_look_past_its_lease():
    """A peer that stops (killed, SIGSTOPped) is declared lost at the first tick after its lease,
    while our loop keeps reading its socket; however late a look, it cannot save a silent peer."""
    w = Lease(10, now=0)
    w.heard(3)                                      # its last heartbeat
    looks = [3 + 0.1 * i for i in range(1, 200)]    # our rounds, every 0.1 s
    lost_at = next(t for t in looks if not w.alive(t, looked=t))
    assert 13 < lost_at <= 13.1 + 1e-9
    assert not w.alive(30, looked=13.2)             # late now, but we looked past the lease: lost


@given(st.lists(st.tuples(st.floats(0, 3), st.floats(0, 2), st.booleans(), st.floats(0, 1)), min_size=1,
                max_size=80))
@settings(max_examples=300, deadline=None)
def test_the_fence_holds_when_the_reader_judges_silence_up_to_its_last_look(steps):
    """The writer-fence property above, with a reader whose loop looks at its socket late (up to
    `late` before each judgement): excusing the reader's own lateness only ever delays its
    verdict, so the writer's fence still stops the writer first."""
    for now, writer, reader, late in exchange(steps):
        for t in (now, now + 0.5, now + 1.5):
            if not reader.alive(t, looked=t - late):
                assert not writer.may_write(t)


def heartbeat_pair(stall: tuple[float, float], until: float, *, lease: float = 30.0, base: float = 1.0,
             delay: float = 0.05, tick: float = 0.01) -> tuple[list[float], float]:
    """Two peers heartbeating each other (each when its Lease says one is due, delivered `delay`
    later); A sends nothing during `stall` (start, end). Returns the gaps between the heartbeats
    either sent after the stall's end + 2 lease, and the longest fence lag (now - fence_base) of
    either in that time."""
    a, b = Lease(lease, 0.0), Lease(lease, 0.0)
    in_flight: list[tuple[float, Lease, int, int]] = []
    last = {id(a): 0.0, id(b): 0.0}
    gaps, lag, settle = [], 0.0, stall[1] + 2 * lease
    for i in range(int(until / tick)):
        now = i * tick
        for m in [m for m in in_flight if m[0] <= now]:
            in_flight.remove(m)
            m[1].on_heartbeat(m[2], m[3], now)
        for me, other in ((a, b), (b, a)):
            if me is a and stall[0] <= now < stall[1]:
                continue
            if now >= me.beat_due:
                if now > settle:
                    gaps.append(round(now - last[id(me)], 2))
                last[id(me)] = now
                me.beat_sent(now, base)
                in_flight.append((now + delay, other, *me.next_heartbeat(now)))
        if now > settle:
            lag = max(lag, now - a.fence_base, now - b.fence_base)
    return gaps, lag


def test_one_late_heartbeat_is_not_echoed_between_the_peers():
    # A's loop held up for 10 s once: afterwards both go back to their 1 s interval and the
    # fence lags about one interval, as before the stall (it echoed for good: gaps of a quarter
    # lease, the fence lagging over 8 s)
    quiet, quiet_lag = heartbeat_pair((0, 0), 150)
    gaps, lag = heartbeat_pair((20, 30), 150)
    assert max(gaps) <= 1.01, sorted(set(gaps))
    assert lag < 2.2
    assert max(quiet) <= 1.01 and quiet_lag < 2.2


def test_a_peer_that_heartbeats_less_often_still_sets_the_pace():
    lease = Lease(30, 0.0)
    for k in range(1, 8):                      # the peer heartbeats every 4 s
        lease.on_heartbeat(seq=k, ack=0, now=4.0 * k)
    lease.beat_sent(28.0, own=1.0)
    assert lease.peer_every == 4.0 and lease.beat_due == 32.0
    lease.on_heartbeat(seq=8, ack=0, now=29.0)  # then every second: followed at once
    lease.beat_sent(29.0, own=1.0)
    assert lease.beat_due == 30.0
