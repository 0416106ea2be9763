"""What an incoming control frame means for this rank, decided without sockets.

The engine's frame router asks `route_frame` where a decoded frame goes: to the handshake, to
a handler, to the "you were declared lost" reply, or nowhere (with the reason counted). Kept
pure so every combination of sender state, epoch and role is tested without a socket.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from .kinds import Role, StrKind
from .messages import Goodbye, Hello, PeerMessage, RoomFailed


class PeerState(StrKind):
    """A peer connection's state, as the engine's peer table keeps it."""

    CONNECTING = "connecting"
    CONNECTED = "connected"
    REJECTED = "rejected"
    LOST = "lost"


PEER_STATES = tuple(PeerState)


class RouteAction(StrKind):
    """Where a decoded frame goes (see Route)."""

    HELLO = "hello"                        # the connection handshake
    DELIVER = "deliver"                    # the handler of its type
    TELL_GONE = "tell_gone"                # drop it and tell the sender it was declared lost
    REJECTED_FAILURE = "rejected_failure"  # a refused peer fails a room (the prefill side must still fail it)
    DROP = "drop"                          # count it under the Route's reason (nothing when empty)


@dataclass(frozen=True)
class Route:
    """What to do with one frame. `heard` says whether the frame renews the sender's lease."""

    action: RouteAction
    reason: str = ""
    heard: bool = False


def route_frame(kind: type[PeerMessage], *, role: Role, me: int, dst: int, peer_state: PeerState | None,
                src_gone: bool, src_replaced: bool, handled: Collection[type[PeerMessage]], conn: int = 0,
                peer_conn: int = 0) -> Route:
    """`kind`: the message's type; `peer_state`: None when the sender is not a current peer;
    `handled`: the message types this rank's role has handlers for; `conn`: the connection a
    Goodbye ends, `peer_conn`: the current connection with its sender (0: not known)."""
    if kind is Hello:
        return Route(RouteAction.HELLO)
    if peer_state is None:
        reason = "stale_peer" if src_gone or src_replaced else "unknown_peer"
        if src_gone and kind is not Goodbye:
            return Route(RouteAction.TELL_GONE, reason)
        return Route(RouteAction.DROP, reason)
    if dst != me:
        return Route(RouteAction.DROP, "stale_epoch")
    if kind is Goodbye and conn and peer_conn and conn != peer_conn:
        return Route(RouteAction.DROP, "stale_connection")  # ends a connection that a newer one replaced
    if peer_state == PeerState.REJECTED:
        if kind is RoomFailed and role == Role.PREFILL:
            return Route(RouteAction.REJECTED_FAILURE)
        return Route(RouteAction.DROP)
    if kind not in handled:
        return Route(RouteAction.DROP, "unexpected", heard=True)
    return Route(RouteAction.DELIVER, heard=True)


class HelloVerdict(StrKind):
    """Prefill side: what a Hello from a decode incarnation means."""

    NEW = "new"              # no current connection
    ACK_AGAIN = "ack_again"  # a retransmission of the current connection's Hello
    STALE = "stale"          # a Hello of an older connection, delivered late
    REPLACE = "replace"      # the decode rank declared the connection lost and opened a new one


def hello_verdict(known_state: PeerState | None, known_conn: int, conn: int) -> HelloVerdict:
    """Prefill side: a Hello from a decode incarnation that may already be connected (on
    REPLACE, the old connection is over here too)."""
    if known_state != PeerState.CONNECTED:
        return HelloVerdict.NEW
    if not conn or not known_conn or conn == known_conn:
        return HelloVerdict.ACK_AGAIN
    return HelloVerdict.STALE if conn < known_conn else HelloVerdict.REPLACE
