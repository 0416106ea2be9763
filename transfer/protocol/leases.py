"""Liveness between two connected peers, and the writer's self-fence. Pure (time passed in).

Each side sends numbered heartbeats and acknowledges the highest number it received. A peer
is alive while we heard anything from it within `lease` seconds. A writer may only write to a
peer while ``send_time(highest acked heartbeat) + lease`` lies ahead: the peer received that
heartbeat at or after we sent it, so it will not declare us lost (and reuse memory we might
still write) before our own fence has stopped us.

Silence is judged up to the last time we read everything the peer had sent (`looked`, the start
of the control thread's last complete read of its socket), not up to `now`: a heartbeat that
waits in our socket because our own thread was held up (the GIL held by the serving engine's
loop, a long call, a busy CPU) is not silence of the peer, and we could not have heard it. A
late local loop so extends each peer's lease by its own lateness, `now - looked`; a peer that is
gone or frozen is still declared lost at the first round after its lease ran out. The write
fence gets no such extension: while we were held up we sent no heartbeats either, so the peer
may rightly have declared us lost and reused the memory; the fence still runs out `lease` after
the send time of the last heartbeat the peer acknowledged, however late we were.

How often: a rank heartbeats each connected peer every `heartbeat_interval` seconds, the
configured interval (timeouts.heartbeat) while that keeps it under `HEARTBEATS_PER_S` sent per
second, longer with more peers (peers / HEARTBEATS_PER_S), and never longer than a quarter of the
lease, so at least four heartbeats fit in a lease and a writer's fence is renewed at least every
half lease; or as often as the peer heartbeats it when that is less often (`pair_interval`), so
two peers settle on the longer of their intervals and a rank receives no more than it sends.
How often the peer heartbeats is the shortest of its last `GAPS_KEPT` gaps, not its latest: one
late heartbeat (its loop held up) would otherwise be answered by as long a gap of ours, which the
peer answers in turn, so a single hiccup echoed between the two for as long as they are
connected, each gap up to a quarter of the lease, and the write fence lagged by up to half a lease
instead of about one interval (tests/unit/test_leases.py).
With a 1 s interval and a 10 s lease, a rank with N peers sends N a second up to
20 peers, 20 a second up to 50 peers, and 0.4 N past that, and receives as many or fewer: a
rank of a 64 x 64 fleet of TP 8 engines (32 peers) sends and receives 40 a second instead of 64
(docs/scale.md).
"""

from __future__ import annotations

from collections import OrderedDict

HEARTBEATS_PER_S = 20.0   # what a rank sends per second at most, while the lease allows it
GAPS_KEPT = 4             # the peer's heartbeat gaps its interval is judged from (the shortest)


def heartbeat_interval(peers: int, *, base: float, lease: float, per_s: float = HEARTBEATS_PER_S) -> float:
    """Seconds between two heartbeats to each of `peers` connected peers: `base` (the configured
    interval) while peers / base <= per_s, else peers / per_s, capped at lease / 4 (never below
    `base`)."""
    if per_s <= 0 or base <= 0 or lease <= 0:
        raise ValueError("the heartbeat interval, the lease and the heartbeat rate must be positive")
    return max(base, min(peers / per_s, lease / 4))


def over_rate(peers: int, *, base: float, lease: float, per_s: float = HEARTBEATS_PER_S) -> bool:
    """True when `peers` connected peers make a rank send more than `per_s` heartbeats a second
    even at the longest interval (a quarter of the lease): past ``per_s * lease / 4`` peers (50 with
    a 10 s lease), where only engine-pair leases (engine_leases.py) keep the rate down."""
    return peers / heartbeat_interval(peers, base=base, lease=lease, per_s=per_s) > per_s


def pair_interval(own: float, peer_every: float, lease: float) -> float:
    """Seconds between our heartbeats to one peer: our own interval, or as long as the peer
    takes between its heartbeats to us when that is longer (up to a quarter of the lease). Two
    peers so settle on the longer of their two intervals: a rank receives no more heartbeats
    than it sends, whatever its peers' own numbers of peers."""
    return max(own, min(peer_every, lease / 4))


class Lease:
    MAX_UNACKED = 1024

    def __init__(self, lease_s: float, now: float):
        if lease_s <= 0:
            raise ValueError("lease must be positive")
        self.lease_s = lease_s
        self.last_heard = now
        self.seq = 0
        self.peer_seq = 0                 # highest heartbeat number received from the peer
        self._sent: OrderedDict[int, float] = OrderedDict({0: now})  # our seq -> send time
        self.fence_base = now             # send time of the highest heartbeat the peer acked
        self.beat_heard: float | None = None   # when the peer's latest heartbeat came
        self._gaps: tuple[float, ...] = ()     # the gaps before its last GAPS_KEPT heartbeats
        self.beat_due = now               # when our next heartbeat to the peer is due

    @property
    def peer_every(self) -> float:
        """How often the peer heartbeats us: the shortest of its last GAPS_KEPT gaps (0 before
        two heartbeats came), so one late heartbeat is not taken for its interval."""
        return min(self._gaps, default=0.0)

    def heard(self, now: float) -> None:
        self.last_heard = max(self.last_heard, now)

    def next_heartbeat(self, now: float) -> tuple[int, int]:
        """(seq, ack) for the heartbeat to send now."""
        self.seq += 1
        self._sent[self.seq] = now
        while len(self._sent) > self.MAX_UNACKED:
            self._sent.popitem(last=False)
        return self.seq, self.peer_seq

    def beat_sent(self, now: float, own: float) -> None:
        """Our heartbeat went out at `now`; the next is due after pair_interval (`own`: our
        heartbeat_interval)."""
        self.beat_due = now + pair_interval(own, self.peer_every, self.lease_s)

    def on_heartbeat(self, seq: int, ack: int, now: float) -> None:
        self.heard(now)
        if seq > self.peer_seq:   # a new one: how long after the one before
            if self.beat_heard is not None:
                self._gaps = (*self._gaps[1 - GAPS_KEPT:], now - self.beat_heard)
            self.beat_heard = now
        self.peer_seq = max(self.peer_seq, seq)
        sent = self._sent.get(ack)
        if sent is not None and sent > self.fence_base:
            self.fence_base = sent
            for old in [s for s in self._sent if s < ack]:
                del self._sent[old]

    def fence_from(self, base: float) -> None:
        """The fence rests on `base`, the time of a stamp of ours the peer acknowledged through
        engine-pair leases (engine_leases.py: the same rule); it only moves forward."""
        if base > self.fence_base:
            self.fence_base = base

    def silence(self, now: float, looked: float | None = None) -> float:
        """How long the peer has been silent as far as we could have heard it: up to `looked`
        (the last complete read of our socket, None: `now`), never past `now`."""
        upto = now if looked is None else min(now, looked)
        return max(0.0, upto - self.last_heard)

    def alive(self, now: float, looked: float | None = None) -> bool:
        return self.silence(now, looked) <= self.lease_s

    def may_write(self, now: float) -> bool:
        return now < self.fence_base + self.lease_s
