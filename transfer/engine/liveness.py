"""Liveness of the connections: heartbeats out, leases in, goodbyes, and what happens when a
peer stays silent or never answers.

Each connected peer has a Lease (protocol/leases.py): heard from within the lease, or lost. A
prefill rank also stops writing to a decode rank whose acknowledgements stopped, since its
memory may have been handed to someone else by now. These are rank-pair leases (EngineConfig.leases
"rank", the default); engine_liveness.py keeps one lease per pair of engines instead. A peer that
sends an EngineBeat runs the other mode: it is declared lost with that reason (every engine of a
fleet must run the same).
"""

from __future__ import annotations

import logging

from ..config import Timeouts
from ..protocol.leases import Lease, heartbeat_interval, over_rate
from ..protocol.messages import EngineBeat, Goodbye, Heartbeat
from ..protocol.routing import PeerState
from .interfaces import Counters, EventHandler, HeartbeatSink, LeaseHooks, MessageHandler, RingOwner
from .peers import Peer, PeerTable

log = logging.getLogger("kvstage.liveness")


class Liveness:
    """The leases of rank `me`'s peers (`peers`), by `timeouts` (lease, connect, heartbeat);
    `side` (the role's) is told a connection never came up and says whether this role writes to
    its peers; `heartbeats` (the prefill side; None on a decode rank) hears each heartbeat after
    it renewed a lease; `ring` (the staging handler) is where a decode rank's ring watermark is
    read for its heartbeats; `stats` takes the heard gap and silence maxima."""

    def __init__(self, *, me: int, peers: PeerTable, timeouts: Timeouts, stats: Counters, ring: RingOwner,
                 side: LeaseHooks, heartbeats: HeartbeatSink | None):
        self.me, self.peers, self.t, self.stats, self.ring = me, peers, timeouts, stats, ring
        self.side, self.heartbeats = side, heartbeats
        self.handlers: dict[type, MessageHandler] = {Heartbeat: self.on_Heartbeat, Goodbye: self.on_Goodbye,
                                                     EngineBeat: self.on_EngineBeat}
        self.events: dict[type, EventHandler] = {}
        self._said_over_rate = False   # the warning that engine-pair leases would beat less is said once

    def on_Heartbeat(self, peer: Peer, msg: Heartbeat, now: float) -> None:
        self.stats.count("heartbeats_received", "rank")
        peer.lease.on_heartbeat(msg.seq, msg.ack, now)
        if self.heartbeats is not None:
            self.heartbeats.on_heartbeat(peer, msg, now)

    def on_EngineBeat(self, peer: Peer, msg: EngineBeat, now: float) -> None:
        self.peers.lost(peer, MODE_MISMATCH.format(theirs="engine", ours="rank"), now)

    def on_Goodbye(self, peer: Peer, msg: Goodbye, now: float) -> None:
        self.peers.lost(peer, f"it said goodbye: {msg.reason or 'closing'}", now, tell=False, clean=msg.clean)

    def tick(self, now: float, looked: float | None = None) -> None:
        """`looked`: when the control thread last read its socket to the end (leases.py: a
        peer's silence counts up to then, so our own lateness is not taken for the peer's)."""
        t = self.t
        for peer in list(self.peers.peers.values()):
            if peer.state == PeerState.CONNECTING and min(now, looked if looked is not None else now) - peer.since > t.connect:
                self.side.connect_failed(peer, now)
            elif peer.state == PeerState.CONNECTED:
                self.stats.maximum("heard_gap_max_s", round(now - peer.lease.last_heard, 4))  # up to now
                self.stats.maximum("silence_max_s", round(peer.lease.silence(now, looked), 4))  # as judged
                if not peer.lease.alive(now, looked):
                    self.peers.lost(peer, f"silent for {t.lease:g} s (lease expired)", now)
                elif self.side.writes_to_peers and not peer.lease.may_write(now):
                    self.peers.lost(peer, fence_ran_out(peer.lease, now, looked), now)
        self._heartbeats(now)

    def _heartbeats(self, now: float) -> None:
        """Each peer whose heartbeat is due (leases.py: heartbeat_interval, longer with many
        peers; pair_interval, no more often than the peer heartbeats us). Decode ranks with a
        ring piggyback its watermark, so a lost WatermarkUpdate costs at most one interval."""
        connected = self.peers.connected()
        own = heartbeat_interval(len(connected), base=self.t.heartbeat, lease=self.t.lease)
        if not self._said_over_rate and over_rate(len(connected), base=self.t.heartbeat, lease=self.t.lease):
            self._said_over_rate = True
            log.warning("rank %d is connected to %d peer ranks: with rank-pair leases it sends %.0f heartbeats a "
                        "second and receives up to as many (one per peer every quarter lease). Engine-pair leases "
                        "(KVSTAGE_LEASES=engine, or EngineConfig.leases='engine', on every engine of the fleet) "
                        "pool the liveness of an engine's ranks: docs/scale.md#engine-pair-leases",
                        self.me, len(connected), len(connected) / own)
        allocator = self.ring.allocator
        wm = allocator.watermark if allocator is not None else None
        for peer in connected:
            if now < peer.lease.beat_due:
                continue
            peer.lease.beat_sent(now, own)
            seq, ack = peer.lease.next_heartbeat(now)
            extra = {}
            if wm is not None and peer.staging:
                extra = {"wm_epoch": self.me, "wm_round": wm.round, "wm_tail": wm.tail}
            self.peers.send(peer.key, Heartbeat(src=self.me, dst=peer.key.incarnation, seq=seq, ack=ack, **extra))
            self.stats.count("heartbeats_sent", "rank")


def fence_ran_out(lease: Lease, now: float, looked: float | None) -> str:
    """Why a writer stopped writing to a peer, with what tells a slow peer from a slow self: how
    long ago the heartbeat it last acknowledged went out, when it was last heard, how often it
    heartbeats, and how late this rank's own loop read its socket."""
    late = 0.0 if looked is None else max(0.0, now - looked)
    return (f"its acknowledgements stopped (write lease expired: the last heartbeat of ours it acknowledged "
            f"went out {now - lease.fence_base:.1f} s ago, lease {lease.lease_s:g} s; it was last heard "
            f"{now - lease.last_heard:.1f} s ago and heartbeats every {lease.peer_every:.1f} s; this rank's "
            f"loop read its socket {late:.1f} s late)")


MODE_MISMATCH = ("it runs {theirs}-pair leases and this rank {ours}-pair leases (EngineConfig.leases, "
                 "KVSTAGE_LEASES): every engine of a fleet must run the same")
