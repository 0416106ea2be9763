"""Liveness of the connections: heartbeats out, leases in, goodbyes, and what happens when a
peer stays silent or never answers.

Each connected peer has a Lease (protocol/leases.py): heard from within the lease, or lost. A
prefill rank also stops writing to a decode rank whose acknowledgements stopped, since its
memory may have been handed to someone else by now.
"""

from __future__ import annotations

from typing import Any

from ..protocol.leases import heartbeat_interval
from ..protocol.messages import Goodbye, Heartbeat
from ..protocol.routing import PeerState
from .context import EngineContext
from .interfaces import MessageHandler, RoleSide
from .peers import Peer, PeerTable


class Liveness:
    def __init__(self, ctx: EngineContext, peers: PeerTable, side: RoleSide[Any]):
        self.ctx, self.peers, self.side = ctx, peers, side
        self.handlers: dict[type, MessageHandler] = {Heartbeat: self.on_Heartbeat, Goodbye: self.on_Goodbye}

    def on_Heartbeat(self, peer: Peer, msg: Heartbeat, now: float) -> None:
        peer.lease.on_heartbeat(msg.seq, msg.ack, now)
        self.side.on_heartbeat(peer, msg, now)

    def on_Goodbye(self, peer: Peer, msg: Goodbye, now: float) -> None:
        self.peers.lost(peer, f"it said goodbye: {msg.reason or 'closing'}", now, tell=False, clean=msg.clean)

    def tick(self, now: float, looked: float | None = None) -> None:
        """`looked`: when the control thread last read its socket to the end (leases.py: a
        peer's silence counts up to then, so our own lateness is not taken for the peer's)."""
        t = self.ctx.t
        for peer in list(self.peers.peers.values()):
            if peer.state == PeerState.CONNECTING and min(now, looked if looked is not None else now) - peer.since > t.connect:
                self.side.connect_failed(peer, now)
            elif peer.state == PeerState.CONNECTED:
                self.ctx.stats.maximum("heard_gap_max_s", round(now - peer.lease.last_heard, 4))  # up to now
                self.ctx.stats.maximum("silence_max_s", round(peer.lease.silence(now, looked), 4))  # as judged
                if not peer.lease.alive(now, looked):
                    self.peers.lost(peer, f"silent for {t.lease:g} s (lease expired)", now)
                elif self.side.writes_to_peers and not peer.lease.may_write(now):
                    self.peers.lost(peer, "its acknowledgements stopped (write lease expired)", now)
        self._heartbeats(now)

    def _heartbeats(self, now: float) -> None:
        """Each peer whose heartbeat is due (leases.py: heartbeat_interval, longer with many
        peers; pair_interval, no more often than the peer heartbeats us). Decode ranks with a
        ring piggyback its watermark, so a lost WatermarkUpdate costs at most one interval."""
        connected = self.peers.connected()
        own = heartbeat_interval(len(connected), base=self.ctx.t.heartbeat, lease=self.ctx.t.lease)
        allocator = self.ctx.handler.allocator
        wm = allocator.watermark if allocator is not None else None
        for peer in connected:
            if now < peer.lease.beat_due:
                continue
            peer.lease.beat_sent(now, own)
            seq, ack = peer.lease.next_heartbeat(now)
            extra = {}
            if wm is not None and peer.staging:
                extra = {"wm_epoch": self.ctx.me, "wm_round": wm.round, "wm_tail": wm.tail}
            self.peers.send(peer.key, Heartbeat(src=self.ctx.me, dst=peer.key.incarnation, seq=seq, ack=ack, **extra))
