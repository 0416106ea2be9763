"""The hop trace between real processes (examples/trace_request.py's core): a staged one-page
request, prefill TP 1 -> decode TP 2 over NIXL, traced on both sides, in causal order, its write
into a ring credit with no ring-space round trip."""

import re

import pytest

from kvstage.hop_trace import Hop
from kvstage.support import hop_report, trace_request

pytestmark = pytest.mark.integration

ROOM_HOPS = {Hop.HANDLE_CALL, Hop.BACKEND_POST, Hop.BACKEND_DONE, Hop.BACKEND_TAG, Hop.GATHER_START,
             Hop.GATHER_END, Hop.SCATTER_START, Hop.SCATTER_END, Hop.WAITER_WOKEN, Hop.STATUS}


def first(hops, kind, process_prefix, detail=None):
    """Index of the first hop of `kind` on a process whose name starts with `process_prefix`."""
    for i, r in enumerate(hops):
        if r.kind is kind and r.process.startswith(process_prefix) and (detail is None or r.detail == detail):
            return i
    raise AssertionError(f"no {kind.value} {detail or ''} on {process_prefix}: "
                         + "; ".join(f"{r.process} {r.kind.value} {r.detail}" for r in hops))


@pytest.mark.timeout(300)
def test_a_one_page_request_is_traced_on_both_sides_in_causal_order(tmp_path):
    a = trace_request.parse(["--warmup", "1", "--pages", "4", "--timeout", "120", "--credits"])
    traced = trace_request.run(a, str(tmp_path))
    records = hop_report.load_dir(tmp_path)
    assert {r.process for r in records} == {"prefill0", "decode0", "decode1"}
    rooms = {r.room for r in records if r.room is not None}
    assert rooms == {1, *traced.values()}
    # every hop that belongs to a request names it, whichever thread made it
    assert not [r for r in records if r.kind in ROOM_HOPS and r.room is None]

    room = traced[trace_request.ONE_PAGE]
    before, hops = hop_report.request_hops(records, room)
    assert all(r.room == room for r in before + hops)
    assert hops[0].kind is Hop.HANDLE_CALL and hops[0].process.startswith("decode")
    assert [r.t_ns for r in hops] == sorted(r.t_ns for r in hops)
    # the prefill side was ready before: its send() came before the decode side's init()
    assert any(r.kind is Hop.HANDLE_CALL and r.detail == "send()" and r.process == "prefill0" for r in before)

    order = [
        first(hops, Hop.SOCKET_SEND, "decode", "RoomMeta"),
        first(hops, Hop.SOCKET_RECV, "prefill", "RoomMeta"),
        first(hops, Hop.GATHER_START, "prefill"),
        first(hops, Hop.GATHER_END, "prefill"),
        first(hops, Hop.BACKEND_POST, "prefill"),
        first(hops, Hop.BACKEND_TAG, "decode"),
        first(hops, Hop.SCATTER_START, "decode"),
        first(hops, Hop.SCATTER_END, "decode"),
        first(hops, Hop.EVENT_TAKEN, "decode", "ctrl ScatterDone"),
        first(hops, Hop.SOCKET_SEND, "decode", "RoomDone"),
        first(hops, Hop.SOCKET_RECV, "prefill", "RoomDone"),
    ]
    assert order == sorted(order), [hops[i].kind.value + " " + hops[i].detail for i in order]
    # a piece of 256 KiB (inline_gather_kb): gathered and posted by the prefill's control thread,
    # no hand-off to a transfer worker and back (docs/trace.md)
    gathers = [r for r in hops if r.kind in (Hop.GATHER_START, Hop.GATHER_END)]
    assert len(gathers) == 4 and {r.thread for r in gathers} == {"kvstage-ctrl"}, gathers
    assert not [r for r in hops if r.detail in ("xfer GatherJob", "backend write")]
    # ring credits: the write goes into the credit the decode rank sent ahead of its metadata, with
    # no ring-space round trip on the request's path (docs/protocol.md, "Ring credits")
    assert not [r for r in hops if r.detail in ("AllocRequest", "AllocGrant")], \
        [r.kind.value + " " + r.detail for r in hops if r.detail in ("AllocRequest", "AllocGrant")]
    # each decode rank: its tag, then its scatter, then Success, then its caller wakes
    for d in ("decode0", "decode1"):
        mine = [r for r in hops if r.process == d]
        assert [r.kind for r in mine if r.kind in (Hop.BACKEND_TAG, Hop.SCATTER_END, Hop.WAITER_WOKEN)] == \
            [Hop.BACKEND_TAG, Hop.SCATTER_END, Hop.WAITER_WOKEN]
        assert [r.detail for r in mine if r.kind is Hop.STATUS][-2:] == ["Success", "Success (released)"]
    # a gather's and a scatter's end say how long the host took and how long it waited for the device
    split = re.compile(r"(ok: )?host \d+\.\d{3} ms, device wait \d+\.\d{3} ms")
    ends = [r.detail for r in hops if r.kind in (Hop.GATHER_END, Hop.SCATTER_END)]
    assert len(ends) == 4 and all(split.fullmatch(d) for d in ends), ends
    # one write per decode rank: posted and completed (the completion reported where it completes)
    assert sum(r.kind is Hop.BACKEND_POST for r in hops) == 2
    assert sum(r.kind is Hop.BACKEND_DONE for r in hops) == 2
    assert [r.detail for r in hops if r.kind is Hop.WAITER_WOKEN and r.process == "prefill0"][-1] == "wait() returned"

    # the writes answer the metadata that completed the room's plan (prefill/room.py answers_meta):
    # a MetaAck goes only to the decode rank whose metadata came first; each decode rank tells its
    # writer the outcome once: a WriterDone that crossed it gets no second RoomDone
    # (room_uses.repeats_outcome), unless the writer asked again a heartbeat later
    sends = [r.detail for r in hops if r.kind is Hop.SOCKET_SEND]
    assert sends.count("MetaAck") == 1, sends
    assert sends.count("RoomDone") == 2 or sends.count("WriterDone") > 2, sends

    c = hop_report.counts(hops)
    assert c.hops == len(hops) and c.process_switches >= 4 and c.wakes >= 10
    # the multi-piece request: 4 pages of 256 KiB per decode rank in 0.5 MiB pieces: 2 writes each
    _, multi = hop_report.request_hops(records, traced[trace_request.MULTI])
    assert sum(r.kind is Hop.BACKEND_POST for r in multi) == 4
    # its 0.5 MiB pieces are past the inline limit: a transfer worker gathers each
    assert sum(r.kind is Hop.EVENT_TAKEN and r.detail == "xfer GatherJob" for r in multi) == 4
    assert {r.thread for r in multi if r.kind is Hop.GATHER_START} <= {"kvstage-xfer-0", "kvstage-xfer-1"}
    assert sum(r.kind is Hop.SCATTER_END for r in multi) == 4
