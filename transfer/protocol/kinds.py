"""The kinds and verdicts that leave the protocol: why a request failed, how its bytes moved.

Every verdict, state and kind of kvstage is an enum of str (StrKind): it compares equal to its
value, prints as its value and is encoded on the wire as its value, so stats keys, metric labels,
logs and RoomFailed.kind read the same as before they were enums.
"""

from __future__ import annotations

from enum import Enum


class StrKind(str, Enum):
    """A str enum that prints as its value on every Python version (3.11 made format() of a
    plain (str, Enum) print the member's name)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class Role(StrKind):
    """Which side of a transfer a rank is (EngineConfig.role, Hello.role on the wire): its value
    is the name users and the wire spell."""

    PREFILL = "prefill"
    DECODE = "decode"


class FailureKind(StrKind):
    """Why a request failed on this rank: the table of docs/operations.md (a test keeps the two
    equal). On the wire (RoomFailed.kind) it is its value."""

    ABORTED = "aborted"
    PEER_LOST = "peer_lost"
    TIMEOUT = "timeout"
    WRITE = "write"
    TAG_MISMATCH = "tag_mismatch"
    CORRUPT = "corrupt"
    PROTOCOL = "protocol"
    LAYOUT = "layout"
    CONNECT = "connect"
    BOOTSTRAP = "bootstrap"
    STAGING = "staging"
    POOL = "pool"
    SCATTER = "scatter"
    CLOSED = "closed"
    INTERNAL = "internal"


REMOTE_PREFIX = "remote_"


def remote_kind(kind: str) -> str:
    """The kind of a failure a peer reported with `kind` (its own kind, as it sent it): the
    peer's kind prefixed once, "remote_<kind>", whatever the peer's version calls it."""
    return kind if kind.startswith(REMOTE_PREFIX) else REMOTE_PREFIX + kind


class TransferPath(StrKind):
    """How a request's bytes moved on this rank (RoomTotals, TransferMetrics, metrics labels)."""

    STAGED = "staged"
    DIRECT = "direct"
    NONE = "none"          # nothing to write: e.g. a rank holding only replicas nobody needs
