"""What a finished request reports to its caller: `TransferMetrics` (bytes, backend writes,
path, time from init to the end, the timeline of its phases) and, when it failed, a `KVTransferError` with its kind and
reason. Serving engines surface these as their transfer metrics and failure exceptions."""

from __future__ import annotations

from dataclasses import dataclass

from .poll import KVPoll
from .protocol.kinds import FailureKind, TransferPath, remote_kind

__all__ = ["FailureKind", "KVTransferError", "TransferMetrics", "TransferPath", "remote_kind"]
from .timeline import Timeline


class KVTransferError(RuntimeError):
    """A request failed. `kind` is a FailureKind, or "remote_<kind>" for one a peer reported
    (docs/operations.md), `reason` the human-readable why."""

    def __init__(self, room: int, kind: str, reason: str):
        super().__init__(f"room {room} failed ({kind}): {reason}")
        self.room, self.kind, self.reason = room, kind, reason


@dataclass(frozen=True, kw_only=True)
class TransferMetrics:
    """One request on one rank, once it ended. `nbytes`: KV bytes this rank wrote (prefill) or
    that landed in it (decode); `backend_writes`: the backend writes those took (one tagged
    write per (writer, chunk) direct, per piece staged); `path`: a TransferPath
    (a rank with nothing to write, e.g. it holds only replicas nobody needs); `seconds`: from
    init() (or a sender created with its page count) until the request ended, None if it
    ended before init(); `timeline`: when each phase happened on this rank (timeline.py);
    `merged_sends`: prefill, direct path, layer-wise sends that went out inside an earlier
    send's write because they were ready while it waited (EngineConfig.layer_batching);
    `predicted_s` and `path_reason`: decode, the time the path choice predicted for the path
    taken (None: no prediction, e.g. a forced path or no measured costs) and why it took it
    (protocol/path_choice.PathReason; "" on the prefill side)."""

    state: KVPoll
    nbytes: int
    backend_writes: int
    path: TransferPath
    seconds: float | None
    timeline: Timeline = Timeline()
    merged_sends: int = 0
    predicted_s: float | None = None
    path_reason: str = ""

    @property
    def gb_per_s(self) -> float | None:
        if not self.seconds or self.state is not KVPoll.Success:
            return None
        return self.nbytes / self.seconds / 1e9
