"""Where incoming control frames and backend notifications go.

A frame from the control socket is classified by protocol/routing.py (handshake, handler,
"you were declared lost", or a counted drop) and handed to the handler registered for its
type by the role's side or by liveness. A backend notification is matched to the peer that
wrote it and its tag decoded before the role's side sees it.
"""

from __future__ import annotations

import time
from typing import cast

from ...hop_trace import TRACE, Hop
from ...wire import WireError
from ..backends.base import ArrivedTag
from ..protocol.kinds import Role
from ..protocol.messages import EngineBeat, Hello, PeerMessage, RoomFailed
from ..protocol.routing import RouteAction, route_frame
from ..protocol.tags import TagCodec
from .interfaces import Counters, FailureSink, HelloSink, MessageHandler, SiblingBeats, TagSink
from .peers import PeerTable


class FrameRouter:
    """Rank `me`'s (of `role`) incoming frames and notifications: `handlers` by message type (the
    role's side's and liveness's), `failures` (the role's side) for a RoomFailed of a refused
    peer, `hello` for a Hello (the prefill side; None on a decode rank, which is not connected
    to), `landed` for a decoded notification (the decode side; None on a prefill rank, which is
    not written to). `tags` decodes notifications, `stats` counts drops. `siblings` takes the
    beats of our own engine's ranks, which are no peers (engine-pair leases, engine_liveness.py;
    None with rank-pair leases: such a beat is dropped as from an unknown peer)."""

    def __init__(self, *, me: int, role: Role, peers: PeerTable, tags: TagCodec, stats: Counters,
                 handlers: dict[type, MessageHandler], failures: FailureSink, hello: HelloSink | None,
                 landed: TagSink | None, siblings: SiblingBeats | None = None):
        self.me, self.role, self.peers, self.tags, self.stats = me, role, peers, tags, stats
        self.handlers, self.failures, self.hello, self.landed = handlers, failures, hello, landed
        self.siblings = siblings
        self._handled = frozenset(handlers)

    def on_frame(self, item: object, now: float) -> None:
        if isinstance(item, WireError):
            self.stats.count("dropped_messages", item.kind)
            return
        msg = cast(PeerMessage, item)
        if self.siblings is not None and isinstance(msg, EngineBeat) and msg.sibling:
            return self.siblings.on_sibling_beat(msg, now)
        peer = self.peers.get(msg.src)
        route = route_frame(type(msg), role=self.role, me=self.me, dst=msg.dst,
                            peer_state=peer.state if peer is not None else None,
                            src_gone=msg.src in self.peers.gone, src_replaced=msg.src in self.peers.replaced,
                            handled=self._handled, conn=getattr(msg, "conn", 0),
                            peer_conn=peer.conn if peer is not None else 0)
        if route.action is RouteAction.HELLO:
            if self.hello is None:   # decode ranks connect, they are not connected to
                self.stats.count("dropped_messages", "unexpected")
                return
            return self.hello.on_hello(cast(Hello, msg), now)
        if route.action is RouteAction.TELL_GONE:
            self.peers.tell_gone(msg.src, now)
        if route.reason:
            self.stats.count("dropped_messages", route.reason)
        if peer is None:   # route_frame hears from and delivers to known peers only
            return
        if route.heard:
            peer.lease.heard(now)
        match route.action:
            case RouteAction.DELIVER:
                self.handlers[type(msg)](peer, msg, now)
            case RouteAction.REJECTED_FAILURE:
                self.failures.on_RoomFailed(peer, cast(RoomFailed, msg), now)
            case RouteAction.HELLO | RouteAction.TELL_GONE | RouteAction.DROP:
                pass   # handled above, or nothing to deliver

    def on_tags(self, tags: list[ArrivedTag]) -> None:
        """Notifications of writes that landed in this rank's memory."""
        now = time.monotonic()
        for arrived in tags:
            peer = self.peers.of_backend(arrived.peer)
            if peer is None:
                self.stats.count("dropped_tags", "unknown_sender")
                continue
            try:
                tag = self.tags.decode(arrived.tag)
            except WireError as exc:
                self.stats.count("dropped_tags", exc.kind)
                continue
            if TRACE.on:
                TRACE.hop(Hop.BACKEND_TAG, tag.room, f"chunk {tag.chunk} piece {tag.piece}")
            if self.landed is None:   # only decode ranks are written to: a confused or forged peer
                self.stats.count("dropped_tags", "tag_at_prefill_rank")
                continue
            self.landed.on_tag(peer, tag, now)
