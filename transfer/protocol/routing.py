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
                src_replaced: bool, handled: frozenset[str] | set[str], conn: int = 0, peer_conn: int = 0) -> Route:
    """`kind`: the message class name; `peer_state`: None when the sender is not a current peer;
    `handled`: the message kinds this rank's role has handlers for; `conn`: the connection a
    Goodbye ends, `peer_conn`: the current connection with its sender (0: not known)."""
    if kind == "Hello":
        return Route("hello")
    if peer_state is None:
        reason = "stale_peer" if src_gone or src_replaced else "unknown_peer"
        if src_gone and kind != "Goodbye":
            return Route("tell_gone", reason)
        return Route("drop", reason)
    if dst != me:
        return Route("drop", "stale_epoch")
    if kind == "Goodbye" and conn and peer_conn and conn != peer_conn:
        return Route("drop", "stale_connection")  # ends a connection that a newer one replaced
    if peer_state == "rejected":
        if kind == "RoomFailed" and role == "prefill":
            return Route("rejected_failure")
        return Route("drop")
    if kind not in handled:
        return Route("drop", "unexpected", heard=True)
    return Route("deliver", heard=True)


def hello_verdict(known_state: str | None, known_conn: int, conn: int) -> str:
    """Prefill side: a Hello from a decode incarnation that may already be connected.
    "ack_again": a retransmission of the current connection's Hello; "stale": a Hello of an
    older connection, delivered late; "replace": the decode rank declared the current
    connection lost and opened a new one (the old one is over here too); "new": no current
    connection."""
    if known_state != "connected":
        return "new"
    if not conn or not known_conn or conn == known_conn:
        return "ack_again"
    return "stale" if conn < known_conn else "replace"



def finished_room_answer(state_ok: bool, kind: str, reason: str, last_session: int, session: int,
                         room: int) -> tuple[str, str] | None:
    """Decode side: a writer asks about room `room`, whose last use here ended (`state_ok`:
    it succeeded). None: answer RoomDone; else the (kind, reason) of the RoomFailed to answer.
    Only the session that use had may hear "done": a writer bound to another use never succeeds."""
    if session != last_session:
        return "protocol", (f"room {room} has no use of session {session} here (a writer bound to metadata "
                            f"of another use of the id)")
    return None if state_ok else (kind, reason)
