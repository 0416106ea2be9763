"""What an incoming control frame means for this rank, decided without sockets.

The engine's frame router asks `route_frame` where a decoded frame goes: to the handshake, to
a handler, to the "you were declared lost" reply, or nowhere (with the reason counted). Kept
pure so every combination of sender state, epoch and role is tested without a socket.
"""

from __future__ import annotations

from dataclasses import dataclass

PEER_STATES = ("connecting", "connected", "rejected", "lost")


@dataclass(frozen=True)
class Route:
    """deliver: hand it to the handler; hello: the connection handshake; tell_gone: drop it and
    tell the sender it was declared lost; rejected_failure: a refused peer fails a room (the
    prefill side must still fail it); drop: count it under `reason` (nothing when empty).
    `heard` says whether the frame renews the sender's lease."""

    action: str
    reason: str = ""
    heard: bool = False


def route_frame(kind: str, *, role: str, me: int, dst: int, peer_state: str | None, src_gone: bool,
                src_replaced: bool, handled: frozenset[str] | set[str]) -> Route:
    """`kind`: the message class name; `peer_state`: None when the sender is not a current peer;
    `handled`: the message kinds this rank's role has handlers for."""
    if kind == "Hello":
        return Route("hello")
    if peer_state is None:
        reason = "stale_peer" if src_gone or src_replaced else "unknown_peer"
        if src_gone and kind != "Goodbye":
            return Route("tell_gone", reason)
        return Route("drop", reason)
    if dst != me:
        return Route("drop", "stale_epoch")
    if peer_state == "rejected":
        if kind == "RoomFailed" and role == "prefill":
            return Route("rejected_failure")
        return Route("drop")
    if kind not in handled:
        return Route("drop", "unexpected", heard=True)
    return Route("deliver", heard=True)
