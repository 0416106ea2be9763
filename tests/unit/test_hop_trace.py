"""The hop trace's pure parts: the recorder (off records nothing, on keeps a bounded list and
writes it as JSON lines), and support/hop_report.py's merge, cut, counts and hand-off pairs."""

import threading

import pytest

from kvstage.hop_trace import ENV, Hop, HopRecord, HopRecorder, load
from kvstage.support import hop_report


def rec(t, process, thread, kind, room=1, detail=""):
    return HopRecord(t_ns=t, process=process, thread=thread, kind=kind, room=room, detail=detail)


def test_off_records_nothing_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    r = HopRecorder.from_env()
    assert not r.on
    r.name_process("decode0")
    r.hop(Hop.SOCKET_SEND, 1, "RoomMeta")
    assert r.records() == [] and r.dump(str(tmp_path / "x.jsonl")) is None
    assert list(tmp_path.iterdir()) == []


def test_on_records_thread_and_process_and_writes_json_lines(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, str(tmp_path))
    r = HopRecorder.from_env()
    r.name_process("prefill0")
    r.name_process("decode0")   # the first name stays (the first manager of the process)
    r.hop(Hop.EVENT_QUEUED, 3, "ctrl SendChunk")
    t = threading.Thread(target=r.hop, args=(Hop.EVENT_TAKEN, 3, "ctrl SendChunk"), name="kvstage-ctrl")
    t.start()
    t.join()
    r.hop(Hop.SOCKET_RECV, None, "Heartbeat")
    path = r.dump()
    head, got = load(path)
    assert head.process == "prefill0" and head.records == 3 and head.dropped == 0 and head.clock == "CLOCK_MONOTONIC"
    assert [(g.kind, g.room, g.thread) for g in got] == [
        (Hop.EVENT_QUEUED, 3, threading.current_thread().name), (Hop.EVENT_TAKEN, 3, "kvstage-ctrl"),
        (Hop.SOCKET_RECV, None, threading.current_thread().name)]
    assert all(g.process == "prefill0" for g in got)
    assert got[0].t_ns <= got[1].t_ns <= got[2].t_ns


def test_the_list_is_bounded_and_says_what_it_dropped(tmp_path):
    r = HopRecorder(str(tmp_path), limit=2)
    for i in range(5):
        r.hop(Hop.STATUS, i, "Transferring")
    assert [g.room for g in r.records()] == [0, 1] and r.dropped == 3
    assert load(r.dump())[0].dropped == 3


def test_a_bad_limit_names_the_variable(monkeypatch):
    monkeypatch.setenv(ENV, "/tmp/x")
    monkeypatch.setenv("KVSTAGE_TRACE_MAX", "lots")
    with pytest.raises(ValueError, match="KVSTAGE_TRACE_MAX"):
        HopRecorder.from_env()


def test_merge_sorts_processes_on_one_clock_and_keeps_ties_in_process_order():
    p = [rec(10, "prefill0", "ctrl", Hop.SOCKET_RECV), rec(30, "prefill0", "ctrl", Hop.SOCKET_SEND),
         rec(30, "prefill0", "ctrl", Hop.STATUS)]
    d = [rec(5, "decode0", "ctrl", Hop.SOCKET_SEND), rec(20, "decode0", "ctrl", Hop.STATUS)]
    got = hop_report.merge([p, d])
    assert [(g.t_ns, g.process) for g in got] == [(5, "decode0"), (10, "prefill0"), (20, "decode0"),
                                                  (30, "prefill0"), (30, "prefill0")]
    assert [g.kind for g in got[3:]] == [Hop.SOCKET_SEND, Hop.STATUS]


def test_a_request_starts_at_the_decode_callers_init():
    recs = [rec(1, "prefill0", "drv", Hop.HANDLE_CALL, 7, "send()"), rec(2, "prefill0", "drv", Hop.STATUS, 8),
            rec(3, "decode0", "drv", Hop.HANDLE_CALL, 7, "receiver init()"), rec(4, "decode0", "ctrl", Hop.STATUS, 7)]
    before, after = hop_report.request_hops(recs, 7)
    assert [r.t_ns for r in before] == [1] and [r.t_ns for r in after] == [3, 4]
    assert hop_report.request_hops(recs, 8) == ([], [recs[1]])   # no init(): from its first hop


def one_handoff_each():
    return [
        rec(0, "decode0", "drv", Hop.HANDLE_CALL, detail="receiver init()"),
        rec(1, "decode0", "drv", Hop.EVENT_QUEUED, detail="ctrl InitReceiver"),
        rec(2, "decode0", "ctrl", Hop.EVENT_TAKEN, detail="ctrl InitReceiver"),
        rec(3, "decode0", "ctrl", Hop.SOCKET_SEND, detail="RoomMeta"),
        rec(4, "decode0", "ctrl", Hop.SOCKET_SEND, detail="Heartbeat"),
        rec(5, "prefill0", "ctrl", Hop.SOCKET_RECV, detail="RoomMeta"),
        rec(6, "prefill0", "ctrl", Hop.BACKEND_POST),
        rec(7, "decode0", "ctrl", Hop.BACKEND_TAG),
        rec(8, "decode0", "ctrl", Hop.STATUS, detail="Success"),
        rec(9, "decode0", "drv", Hop.WAITER_WOKEN, detail="wait() returned"),
    ]


def test_counts_hops_wakeups_and_switches():
    c = hop_report.counts(one_handoff_each())
    assert (c.hops, c.wakes, c.threads) == (10, 4, 3)   # taken, received, tag read, waiter woken; 3 lanes
    # drv->ctrl, ctrl->prefill ctrl, prefill->decode ctrl, ctrl->drv
    assert (c.lane_switches, c.process_switches) == (4, 2)
    assert c.by_kind["socket_send"] == 2 and sum(c.by_kind.values()) == 10


def test_an_event_a_thread_queued_for_itself_wakes_nobody():
    """A small piece scattered by the control thread reports through its own event queue: that
    hand-off is counted as hops, not as a wake-up."""
    hops = [rec(1, "decode0", "ctrl", Hop.BACKEND_TAG),
            rec(2, "decode0", "ctrl", Hop.EVENT_QUEUED, detail="ctrl ScatterDone"),
            rec(3, "decode0", "ctrl", Hop.EVENT_TAKEN, detail="ctrl ScatterDone"),
            rec(4, "decode0", "scatter", Hop.EVENT_QUEUED, detail="ctrl ScatterDone"),
            rec(5, "decode0", "ctrl", Hop.EVENT_TAKEN, detail="ctrl ScatterDone")]
    c = hop_report.counts(hops)
    assert (c.hops, c.wakes) == (5, 2)   # the tag read, and the event the scatter thread handed over


def test_pairs_match_each_receiving_hop_to_what_handed_it_over():
    assert hop_report.pairs(one_handoff_each()) == [(1, 2), (3, 5), (6, 7), (8, 9)]


def test_a_message_is_never_paired_inside_one_process_nor_with_another_type():
    hops = [rec(1, "decode0", "ctrl", Hop.SOCKET_SEND, detail="AllocGrant"),
            rec(2, "prefill0", "ctrl", Hop.SOCKET_SEND, detail="RoomMeta"),
            rec(3, "prefill0", "ctrl", Hop.SOCKET_RECV, detail="RoomMeta"),
            rec(4, "prefill0", "ctrl", Hop.SOCKET_RECV, detail="AllocGrant")]
    assert hop_report.pairs(hops) == [(0, 3)]


def test_the_printed_timeline_has_a_line_per_hop_in_ms_since_the_origin():
    hops = one_handoff_each()
    lines = hop_report.timeline_lines(hops, origin_ns=0)
    assert len(lines) == 1 + len(hops)
    assert lines[-1].split()[:5] == ["0.000", "0.000", "decode0", "drv", "waiter_woken"]


def test_the_critical_path_follows_what_each_hop_waited_for():
    hops = one_handoff_each()
    path = hop_report.critical_path(hops, 9)
    # the Heartbeat (4) is off it; the tag (7) waited for the post (6), not for its own thread
    assert path.steps == (0, 1, 2, 3, 5, 6, 7, 8, 9)
    assert (path.wakes, path.process_switches) == (4, 2)


def test_a_busy_thread_takes_its_hand_off_off_the_critical_path():
    """A hand-off taken after the thread's own later work: the thread was busy, not waiting."""
    hops = [rec(0, "decode0", "drv", Hop.HANDLE_CALL, detail="receiver init()"),
            rec(1, "decode0", "scatter", Hop.EVENT_QUEUED, detail="ctrl ScatterDone"),
            rec(2, "decode0", "ctrl", Hop.BACKEND_TAG),
            rec(3, "decode0", "ctrl", Hop.EVENT_TAKEN, detail="ctrl ScatterDone"),
            rec(4, "decode0", "drv", Hop.WAITER_WOKEN, detail="wait() returned")]
    path = hop_report.critical_path(hops, 3)
    assert path.steps == (2, 3) and path.wakes == 0


def test_the_latency_ends_where_the_last_decode_caller_woke():
    hops = one_handoff_each() + [rec(10, "prefill0", "drv", Hop.WAITER_WOKEN, detail="wait() returned"),
                                 rec(11, "prefill0", "ctrl", Hop.SOCKET_RECV, detail="RoomDone")]
    assert hop_report.decode_woken(hops) == 9
    lines = hop_report.summary_lines("one page", hops)
    assert lines[0].startswith("one page: init() -> wait() returned on the decode side in 0.000 ms: 10 hops, 4 wake-ups")
    assert lines[1].startswith("  its critical path (what the decode caller's wake-up waited for): 9 hops, 4 wake-ups "
                               "(2 between processes): decode0 handle_call > decode0 event_queued ctrl InitReceiver")
    assert "12 hops, 6 wake-ups" in lines[2]
    assert hop_report.decode_woken(hops[:9]) is None
