"""The ranks this rank talks to: one `Peer` per incarnation, indexed by rank and by backend
name, plus the memory of incarnations lost or replaced (so their late frames are recognised).

`PeerTable.lost` is the one place a connection ends: it tells the peer (it may only be frozen),
forgets its backend connection and staging subscription, then lets the write queue and the
role's side fail what depended on it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from ..protocol.actions import PeerKey
from ..protocol.kinds import Role
from ..protocol.leases import Lease
from ..protocol.messages import Goodbye, KVMemory, PeerMessage, RingInfo
from ..protocol.routing import PeerState
from ..protocol.stage_mapping import DecodeStage
from ..protocol.token_mapping import DCPLayout
from .context import FINISHED_MEMORY
from .interfaces import Counters, Later, PeerLinks, PeerLossListener, Sockets, Unsubscribe

log = logging.getLogger("kvstage")


@dataclass(kw_only=True)
class Peer:
    key: PeerKey
    role: Role
    tp_size: int
    endpoint: str
    lease: Lease
    state: PeerState = PeerState.CONNECTING
    backend_name: str = ""
    staging: bool = False
    buffer_bytes: int = 0
    kv: KVMemory | None = None         # prefill side: where the decode rank's pages are
    ring: RingInfo | None = None       # prefill side: the decode rank's ring
    credits: bool = False              # prefill side: this rank takes the decode rank's ring credits
    reason: str = ""
    since: float = 0.0
    conn: int = 0                      # the connection's number (decode numbers them; 0: not known)
    stage: DecodeStage | None = None   # prefill side: the decode rank's PP stage (None: no PP there)
    dcp: DCPLayout | None = None       # prefill side: the decode rank's DCP group (token_mapping.py)


class PeerTable:
    """The peers of rank `me`. `sock` sends to an endpoint (a Goodbye) and forgets its socket,
    `stats` counts drops and losses, `staging` drops a lost peer's watermark subscription,
    `links` (a prefill rank's backend; None on a decode rank, which writes nowhere) drops its
    backend connection. `listeners`: who is told when a connection ends, in order (built after
    the table: they use it). The table is the parts' Outbox (interfaces.py)."""

    def __init__(self, *, me: int, sock: Sockets, stats: Counters, staging: Unsubscribe, links: PeerLinks | None,
                 listeners: Later[Sequence[PeerLossListener]]):
        self.me, self.sock, self.stats, self.staging, self.links = me, sock, stats, staging, links
        self._listeners = listeners
        self.peers: dict[int, Peer] = {}
        self.by_rank: dict[tuple[str, int], int] = {}
        self.by_backend: dict[str, int] = {}
        self.gone: OrderedDict[int, str] = OrderedDict()            # incarnations lost (may reconnect)
        self.gone_endpoint: dict[int, tuple[str, int]] = {}         # ... where to tell them so, and the connection
        self._told_gone: dict[int, float] = {}
        self.replaced: OrderedDict[int, None] = OrderedDict()       # superseded by a newer one: never again

    # -- lookups ------------------------------------------------------------------------------------
    def get(self, incarnation: int) -> Peer | None:
        return self.peers.get(incarnation)

    def of_rank(self, engine_id: str, tp_rank: int) -> Peer | None:
        inc = self.by_rank.get((engine_id, tp_rank))
        return self.peers.get(inc) if inc is not None else None

    def of_backend(self, backend_name: str) -> Peer | None:
        inc = self.by_backend.get(backend_name)
        return self.peers.get(inc) if inc is not None else None

    def connected(self) -> list[Peer]:
        return [p for p in self.peers.values() if p.state == PeerState.CONNECTED]

    # -- changes ------------------------------------------------------------------------------------
    def add(self, peer: Peer, now: float) -> None:
        """A new incarnation of a rank: its previous life (if any) is over, then index it."""
        key = peer.key
        old = self.by_rank.get((key.engine_id, key.tp_rank))
        if old is not None and old != key.incarnation:
            if old in self.peers:
                self.lost(self.peers[old], "the rank restarted (new incarnation)", now)
            self.replaced[old] = None
            while len(self.replaced) > FINISHED_MEMORY:
                self.replaced.popitem(last=False)
        self.peers[key.incarnation] = peer
        self.by_rank[(key.engine_id, key.tp_rank)] = key.incarnation

    def connected_via(self, peer: Peer, backend_name: str) -> None:
        peer.state, peer.backend_name = PeerState.CONNECTED, backend_name
        self.by_backend[backend_name] = peer.key.incarnation

    def came_back(self, incarnation: int) -> bool:
        """A lost incarnation connects again: forget that it was lost."""
        if self.gone.pop(incarnation, None) is None:
            return False
        self.gone_endpoint.pop(incarnation, None)
        return True

    def lost(self, peer: Peer, reason: str, now: float, tell: bool = True, clean: bool = False) -> None:
        if peer.state == PeerState.LOST:
            return
        if tell:  # it may be alive but frozen or cut off: when it wakes up it learns at once
            self.sock.send(peer.endpoint, Goodbye(src=self.me, dst=peer.key.incarnation, conn=peer.conn,
                                                 reason=f"you were declared lost: {reason}"))
        log.warning("peer %s lost: %s", peer.key, reason)
        was = peer.state
        peer.state, peer.reason = PeerState.LOST, reason
        self.peers.pop(peer.key.incarnation, None)
        if self.by_rank.get((peer.key.engine_id, peer.key.tp_rank)) == peer.key.incarnation:
            del self.by_rank[(peer.key.engine_id, peer.key.tp_rank)]
        self.gone[peer.key.incarnation] = reason
        self.gone_endpoint[peer.key.incarnation] = (peer.endpoint, peer.conn)
        while len(self.gone) > FINISHED_MEMORY:
            old, _ = self.gone.popitem(last=False)
            self.gone_endpoint.pop(old, None)
            self._told_gone.pop(old, None)
        if peer.backend_name:
            self.by_backend.pop(peer.backend_name, None)
            if self.links is not None:
                self.links.disconnect(peer.backend_name)  # its pending writes fail
        self.staging.unsubscribe(peer.key.incarnation)
        self.sock.forget(peer.endpoint)
        self.stats.count("peers_lost", str(PeerState.CONNECTING if was == PeerState.CONNECTING else PeerState.CONNECTED))
        for listener in self._listeners():
            listener.peer_lost(peer, reason, now, clean)

    # -- sending ------------------------------------------------------------------------------------
    def send(self, key: PeerKey, msg: PeerMessage) -> None:
        peer = self.peers.get(key.incarnation)
        if peer is None or peer.state == PeerState.LOST:
            self.stats.count("dropped_messages", "to_lost_peer")
            return
        if not self.sock.send(peer.endpoint, msg):
            self.stats.count("dropped_messages", "send_queue_full")

    def tell_gone(self, incarnation: int, now: float) -> None:
        """A peer we declared lost still talks to us: tell it (at most once a second), so it
        fails what it has with us and connects again."""
        where = self.gone_endpoint.get(incarnation)
        if where is None or now - self._told_gone.get(incarnation, -1e9) < 1.0:
            return
        self._told_gone[incarnation] = now
        endpoint, conn = where
        self.sock.send(endpoint, Goodbye(src=self.me, dst=incarnation, conn=conn,
                                             reason=f"you were declared lost: {self.gone[incarnation]}"))
