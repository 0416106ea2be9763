"""Liveness with one lease per pair of engines (EngineConfig.leases = "engine", env
KVSTAGE_LEASES=engine): the thin shell around protocol/engine_leases.py, which decides everything
(docs/scale.md#engine-pair-leases).

What the shell does, on the control thread:

- Siblings (the other ranks of this rank's engine) are looked up at this rank's own rendezvous,
  on a lookup thread of their own (it blocks until every rank of the engine registered), and
  again when a beat comes from a sibling not known yet (a restarted rank, a new incarnation).
  A sibling is no peer of the peer table: the frame router hands its beats here
  (`on_sibling_beat`), and its beats go to its control endpoint from the rendezvous record.
- The peer table's connected peers are the remote ranks: each tick links the ones connected
  since the last tick (the fence starts when the connection's lease began here, never later)
  and unlinks the ones that ended.
- Each tick: the verdicts (silent past the lease from the dead rank's last stamp, judged up to
  the socket's last complete read; on a prefill rank, a fence run out) end those peers through
  `PeerTable.lost`, so what depended on them fails with the reason; a prefill rank's write
  fences move to what the acknowledgements allow (BackendOwner.fence: no write is driven past
  it); then the beats due go out (sibling beats by endpoint, engine beats through the table).
- A Heartbeat from a peer means it runs rank-pair leases: it is declared lost with that reason.

Counters (stats()): `heartbeats_sent` and `heartbeats_received` by kind (sibling, engine),
`sibling_lookups` by outcome. What it does not carry that rank-pair Heartbeats do: the decode
ring's watermark (a WatermarkUpdate lost without its connection is then found at the watermark
deadline, not at the next heartbeat).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ...bootstrap import RankRecord
from ..config import Timeouts
from ..protocol.engine_leases import BeatKind, EngineLeases
from ..protocol.messages import EngineBeat, Goodbye, Heartbeat
from ..protocol.routing import PeerState
from .interfaces import Counters, EventHandler, LeaseHooks, MessageHandler, Sockets, WriteFences
from .liveness import MODE_MISMATCH
from .peers import Peer, PeerTable

log = logging.getLogger("kvstage")


@dataclass(frozen=True)
class SiblingsFound:
    """The lookup thread's answer: the records of every rank of our engine, or why not."""

    records: list[RankRecord] | None
    error: str | None


class EngineLiveness:
    """The engine-pair leases of rank `me` of engine `engine_id`: `peers` (the remote ranks),
    `timeouts` (lease; heartbeat, the sibling beat and the base engine slot), `side` (whether
    this role writes, and a connection that never came up), `sock` (sibling beats by endpoint),
    `fences` (a prefill rank's write fences; None on a decode rank), `lookup(timeout)` (the
    records of our engine's ranks at our rendezvous; blocks, run on a lookup thread), `post`
    (hands the lookup's answer to the control thread), `stats`; `now` starts our stamps."""

    def __init__(self, *, me: int, engine_id: str, peers: PeerTable, timeouts: Timeouts, stats: Counters,
                 side: LeaseHooks, sock: Sockets, fences: WriteFences | None,
                 lookup: Callable[[float], list[RankRecord]], post: Callable[[object], None], now: float):
        self.me, self.peers, self.t, self.stats, self.side = me, peers, timeouts, stats, side
        self.sock, self.fences, self._lookup, self._post = sock, fences, lookup, post
        self.leases = EngineLeases(me=me, engine=engine_id, lease=timeouts.lease, sibling_every=timeouts.heartbeat,
                                   base=timeouts.heartbeat, now=now)
        self.endpoints: dict[int, str] = {}     # sibling incarnation -> its control endpoint
        self._looking = False
        self._look_at = now                     # when to look our siblings up (again)
        self._looked_up = -float("inf")         # when the last lookup started
        self._dropped: dict[int, float] = {}    # silent sibling -> when its queued beats were dropped
        self.handlers: dict[type, MessageHandler] = {EngineBeat: self.on_EngineBeat, Heartbeat: self.on_Heartbeat,
                                                     Goodbye: self.on_Goodbye}
        self.events: dict[type, EventHandler] = {SiblingsFound: self.on_siblings}

    # -- inputs ---------------------------------------------------------------------------------
    def on_EngineBeat(self, peer: Peer, msg: EngineBeat, now: float) -> None:
        """A beat of a peer engine's rank (routed as any peer message: a connected peer)."""
        if msg.sibling:   # a sibling beat from a rank of another engine: a confused or forged peer
            self.stats.count("dropped_messages", "unexpected")
            return
        self.stats.count("heartbeats_received", "engine")
        self.leases.on_beat(msg, now)
        self._move_fences()

    def on_sibling_beat(self, msg: EngineBeat, now: float) -> None:
        if msg.dst != self.me:
            self.stats.count("dropped_messages", "stale_epoch")
            return
        if msg.src not in self.leases.siblings:   # a sibling we do not know yet (it restarted)
            self.stats.count("dropped_messages", "unknown_sibling")
            self._look_at = min(self._look_at, now)
            return
        self.stats.count("heartbeats_received", "sibling")
        self.leases.on_beat(msg, now)
        self._move_fences()

    def on_Heartbeat(self, peer: Peer, msg: Heartbeat, now: float) -> None:
        self.peers.lost(peer, MODE_MISMATCH.format(theirs="rank", ours="engine"), now)

    def on_Goodbye(self, peer: Peer, msg: Goodbye, now: float) -> None:
        self.peers.lost(peer, f"it said goodbye: {msg.reason or 'closing'}", now, tell=False, clean=msg.clean)

    def on_siblings(self, ev: SiblingsFound, now: float) -> None:
        self._looking = False
        if ev.records is None:
            self.stats.count("sibling_lookups", "failed")
            log.warning("kvstage rank %x: looking up the ranks of its own engine failed (again in %g s): %s",
                        self.me, self.t.lease, ev.error)
            self._look_at = now + self.t.lease
            return
        self.stats.count("sibling_lookups", "ok")
        found = {r.incarnation: r.ctrl_endpoint for r in ev.records if r.incarnation != self.me}
        for inc, endpoint in self.endpoints.items():
            if inc not in found:
                self.sock.forget(endpoint)   # a previous incarnation: no more beats to it
        self.endpoints = found
        self.leases.set_siblings(set(found), now)

    # -- the tick -------------------------------------------------------------------------------
    def tick(self, now: float, looked: float | None = None) -> None:
        self._silent_siblings(now)
        if not self._looking and now >= self._look_at:
            self._look_at = float("inf")
            self._looking = True
            self._looked_up = now
            threading.Thread(target=self._do_lookup, name="kvstage-siblings", daemon=True).start()
        upto = now if looked is None else min(now, looked)
        self._link(now, upto)
        writes = self.side.writes_to_peers
        for lost in self.leases.verdicts(now, looked, writes=writes):
            peer = self.peers.get(lost.rank)
            self.leases.disconnect(lost.rank)
            if peer is not None:
                self.peers.lost(peer, lost.reason, now)
        self._move_fences()
        for out in self.leases.beats(now, clock=time.time()):
            if out.kind is BeatKind.SIBLING:
                endpoint = self.endpoints.get(out.to)
                if endpoint is None or not self.sock.send(endpoint, out.beat):
                    self.stats.count("dropped_messages", "send_queue_full" if endpoint else "unknown_sibling")
                    continue
                self.stats.count("heartbeats_sent", "sibling")
            else:
                peer = self.peers.get(out.to)
                if peer is not None:
                    self.peers.send(peer.key, out.beat)
                    self.stats.count("heartbeats_sent", "engine")

    def _silent_siblings(self, now: float) -> None:
        """A sibling silent past the lease (dead, not restarted yet): the beats queued to it are
        dropped once a lease (its socket is closed; the next beat opens it again), and our engine
        is looked up again, at most once a lease, in case it came back as a new incarnation."""
        for rank, sib in self.leases.siblings.items():
            endpoint = self.endpoints.get(rank)
            if endpoint is None or now - sib.seen.heard <= self.t.lease:
                self._dropped.pop(rank, None)
                continue
            if now - self._dropped.get(rank, -float("inf")) > self.t.lease:
                self._dropped[rank] = now
                self.sock.forget(endpoint)
                self._look_at = min(self._look_at, max(now, self._looked_up + self.t.lease))

    def _move_fences(self) -> None:
        """Each remote rank's write fence where its acknowledgements put it: the peer's lease
        (the write queue asks it before a write) and, on a prefill rank, the backend's (no write
        is driven past it)."""
        for rank, remote in self.leases.remotes.items():
            peer = self.peers.get(rank)
            if peer is None:
                continue
            peer.lease.fence_from(remote.fence)
            if self.fences is not None and peer.backend_name:
                self.fences.fence(peer.backend_name, peer.lease.fence_base + self.t.lease)

    def _link(self, now: float, upto: float) -> None:
        """The peer table's connected peers are our remote ranks; a connection that never came
        up fails as with rank-pair leases."""
        connected: set[int] = set()
        for peer in list(self.peers.peers.values()):
            if peer.state == PeerState.CONNECTING and upto - peer.since > self.t.connect:
                self.side.connect_failed(peer, now)
            elif peer.state == PeerState.CONNECTED:
                inc = peer.key.incarnation
                connected.add(inc)
                if inc not in self.leases.remotes:   # the fence from when its lease began here
                    self.leases.connect(inc, peer.key.engine_id, now, since=min(now, peer.lease.fence_base))
                heard = self.leases.heard(inc)
                if heard is not None:
                    self.stats.maximum("heard_gap_max_s", round(now - heard, 4))
                    self.stats.maximum("silence_max_s", round(max(0.0, upto - heard), 4))
        for gone in [r for r in self.leases.remotes if r not in connected]:
            self.leases.disconnect(gone)

    def _do_lookup(self) -> None:
        """On the lookup thread: the ranks of our engine, once all are registered."""
        try:
            records = self._lookup(self.t.bootstrap)
            event = SiblingsFound(list(records), None)
        except Exception as exc:  # noqa: BLE001 - said to the control thread, which looks again later
            event = SiblingsFound(None, f"{type(exc).__name__}: {exc}")
        try:
            self._post(event)
        except RuntimeError:   # the control thread stopped: nobody needs the answer
            pass
