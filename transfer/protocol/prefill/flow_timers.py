"""A prefill room's flows over time: which control messages to send again, and which flow is
overdue. Pure: the time is an argument; the room turns the answers into messages or a failure."""

from __future__ import annotations

from collections.abc import Iterable

from ...timeouts import Timeouts
from .flows import Flow, FlowState

__all__ = ["due_again", "overdue"]


def due_again(flows: Iterable[Flow], retry: float, now: float) -> list[tuple[Flow, int | None]]:
    """What to send again (a message may be lost): (flow, chunk) for a ring allocation not
    granted within `retry` of the last ask, (flow, None) for a WriterDone not confirmed within
    `retry` of the last one. Stamps each as sent now."""
    out: list[tuple[Flow, int | None]] = []
    for flow in flows:
        for chunk, first in flow.requested_at.items():
            if not flow.is_granted(chunk) and now - flow.asked_again.get(chunk, first) >= retry:
                flow.note_asked_again(chunk, now)
                out.append((flow, chunk))
        if flow.state is not FlowState.DONE_SENT:
            continue
        last_done = flow.done_again_at if flow.done_again_at is not None else flow.done_sent_at
        assert last_done is not None, "a flow in DONE_SENT has sent its WriterDone"
        if now - last_done >= retry:
            flow.done_again_at = now
            out.append((flow, None))
    return out


def overdue(flows: Iterable[Flow], t: Timeouts, now: float) -> str | None:
    """Why the room times out, if a flow waited too long for a ring allocation or for the decode
    rank's confirmation after its last write; None if none did."""
    for flow in flows:
        for chunk, asked in flow.requested_at.items():
            if not flow.is_granted(chunk) and now - asked > t.watermark:
                return f"no ring allocation for chunk {chunk} from {flow.peer} within {t.watermark:g} s"
        if (flow.state is FlowState.DONE_SENT and flow.done_sent_at is not None
                and now - flow.done_sent_at > t.arrival + t.scatter):
            return (f"decode rank {flow.peer.tp_rank} did not confirm the room within {t.arrival + t.scatter:g} s "
                    f"of the last write")
    return None
