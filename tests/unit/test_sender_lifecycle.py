"""KVSender's late page count and inferred last chunk, in the caller's thread: misuse raises and
changes nothing; good calls hand exactly one event each to the control thread."""

import pytest

from kvstage.transfer.engine.events import InitSender, SendChunk
from kvstage.transfer.engine.handles import KVSender, RoomStatus


def sender(num_pages=None):
    posted = []
    return KVSender(posted.append, 100, 7, num_pages, RoomStatus()), posted


def test_late_init_then_chunks_without_last_end_at_the_count():
    s, posted = sender()
    s.init(5)
    s.send([0, 1])
    s.send([2, 3, 4])
    assert [type(e) for e in posted] == [InitSender, SendChunk, SendChunk]
    assert posted[0].num_pages == 5
    assert [(list(e.pages), e.last) for e in posted[1:]] == [([0, 1], False), ([2, 3, 4], True)]
    with pytest.raises(ValueError, match="after the last chunk"):
        s.send([5])


def test_send_before_init_raises_and_changes_nothing():
    s, posted = sender()
    with pytest.raises(ValueError, match="before init"):
        s.send([0])
    assert posted == []
    s.init(1)
    s.send([0])
    assert posted[-1].last is True


@pytest.mark.parametrize("created_with", [None, 3])
def test_init_twice_or_on_a_counted_sender_raises(created_with):
    s, posted = sender(created_with)
    if created_with is None:
        s.init(3)
    with pytest.raises(ValueError, match="init\\(\\) called twice"):
        s.init(3)
    assert len(posted) == (1 if created_with is None else 0)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "3", None])
def test_init_needs_a_positive_int(bad):
    s, posted = sender()
    with pytest.raises(ValueError, match="positive int"):
        s.init(bad)
    assert posted == [] and s.num_pages is None


def test_explicit_last_must_agree_with_the_count_and_false_keeps_it_open():
    s, posted = sender(4)
    with pytest.raises(ValueError, match="last chunk ends at page 2"):
        s.send([0, 1], last=True)
    assert posted == []
    s.send([0, 1, 2, 3], last=False)       # all pages, but the caller says more is coming
    assert posted[-1].last is False
    s.send([], last=True)                  # ... and ends it with an empty last chunk
    assert posted[-1].last is True


def test_a_closed_manager_leaves_the_handle_unchanged():
    def refuse(event):
        raise RuntimeError("the KVManager is closed")
    s = KVSender(refuse, 100, 7, None, RoomStatus())
    with pytest.raises(RuntimeError, match="the KVManager is closed"):
        s.init(2)
    assert s.num_pages is None


# -- per-request metrics and failure objects ------------------------------------------------------
def test_metrics_appear_when_the_request_ends_and_time_counts_from_init():
    from kvstage.transfer.poll import KVPoll
    from kvstage.transfer.protocol.actions import RoomTotals
    s, _ = sender()
    assert s.metrics() is None and s.failure_exception() is None
    s.init(4)
    s._status.update(KVPoll.Transferring, None, None, False)
    assert s.metrics() is None                           # not ended yet
    s._status.update(KVPoll.Success, None, None, False, RoomTotals(4096, 3, "staged"))
    m = s.metrics()
    assert (m.state, m.nbytes, m.backend_writes, m.path) == (KVPoll.Success, 4096, 3, "staged")
    assert 0 <= m.seconds < 5 and m.gb_per_s == pytest.approx(4096 / m.seconds / 1e9)
    s._status.update(KVPoll.Success, None, None, True, RoomTotals(1, 1, "direct"))   # the release
    assert s.metrics().nbytes == 4096                    # the end is recorded once
    assert s.failure_exception() is None


def test_failure_exception_carries_kind_and_reason_and_a_never_inited_request_has_no_duration():
    from kvstage import KVTransferError
    from kvstage.transfer.poll import KVPoll
    from kvstage.transfer.protocol.actions import RoomTotals
    s, _ = sender()
    s._status.update(KVPoll.Failed, "decode rank 0 lost", "peer_lost", False, RoomTotals())
    exc = s.failure_exception()
    assert isinstance(exc, KVTransferError) and isinstance(exc, RuntimeError)
    assert (exc.room, exc.kind, exc.reason) == (7, "peer_lost", "decode rank 0 lost")
    assert "room 7 failed (peer_lost): decode rank 0 lost" == str(exc)
    m = s.metrics()
    assert (m.state, m.nbytes, m.path, m.seconds, m.gb_per_s) == (KVPoll.Failed, 0, "none", None, None)


# -- clear(): the caller drops a handle -------------------------------------------------------------
def test_clear_after_the_end_forgets_and_before_the_end_aborts_first():
    from kvstage.transfer.engine.events import Abort
    from kvstage.transfer.poll import KVPoll
    forgotten, posted = [], []
    done = KVSender(posted.append, 100, 7, 2, RoomStatus(), lambda room, st: forgotten.append(room))
    done._status.update(KVPoll.Success, None, None, True)
    done.clear()
    assert posted == [] and forgotten == [7]
    live = KVSender(posted.append, 100, 8, 2, RoomStatus(), lambda room, st: forgotten.append(room))
    live.close()                                            # close is clear
    assert [type(e) for e in posted] == [Abort] and forgotten == [7, 8]

    def closed(event):
        raise RuntimeError("the KVManager is closed")
    KVSender(closed, 100, 9, 2, RoomStatus(), lambda room, st: forgotten.append(room)).clear()
    assert forgotten == [7, 8, 9]


def test_the_manager_keeps_a_cleared_status_until_its_room_is_released():
    import threading
    from types import MethodType, SimpleNamespace

    from kvstage.transfer.engine.manager import KVManager
    from kvstage.transfer.poll import KVPoll
    mgr = SimpleNamespace(_rooms={}, _rooms_lock=threading.Lock())
    mgr._prune_cleared = MethodType(KVManager._prune_cleared, mgr)
    claim, forget = MethodType(KVManager._claim, mgr), MethodType(KVManager._forget, mgr)
    a, b = claim(1), claim(2)
    forget(1, a)                                            # cleared while still active: kept
    assert set(mgr._rooms) == {1, 2}
    a.update(KVPoll.Failed, "x", "aborted", True)
    b.update(KVPoll.Success, None, None, True)              # released, never cleared: kept (for a while)
    claim(3)                                                # any later call prunes what was cleared
    assert set(mgr._rooms) == {2, 3}
    forget(2, b)
    assert set(mgr._rooms) == {3}


# -- prefix hits at the handles ------------------------------------------------------------------
def test_receiver_init_with_a_prefix_posts_the_rest_and_k():
    from kvstage.transfer.engine.events import InitReceiver
    from kvstage.transfer.engine.handles import KVReceiver
    posted = []
    r = KVReceiver(posted.append, 100, 7, "p", RoomStatus())
    r.init([9, 8], prefix_pages=3)
    (ev,) = posted
    assert isinstance(ev, InitReceiver) and list(ev.pages) == [9, 8] and ev.prefix_pages == 3


@pytest.mark.parametrize("prefix, pages, match", [(-1, [1], "prefix_pages must be an int >= 0"),
                                                  (1.0, [1], "prefix_pages must be an int"),
                                                  (True, [1], "prefix_pages must be an int"),
                                                  (4, [], "at least one page past the prefix")])
def test_receiver_init_refuses_a_bad_prefix_and_changes_nothing(prefix, pages, match):
    from kvstage.transfer.engine.handles import KVReceiver
    posted = []
    r = KVReceiver(posted.append, 100, 7, "p", RoomStatus())
    with pytest.raises(ValueError, match=match):
        r.init(pages, prefix_pages=prefix)
    assert posted == []
    r.init([1])                                   # still free to init
    assert len(posted) == 1


def test_sender_learns_the_decode_prefix_from_the_status():
    s, _ = sender()
    assert s.decode_prefix_pages is None
    s._status.decode_prefix_pages = 5             # what the control thread sets on DecodePrefix
    assert s.decode_prefix_pages == 5


class Event:
    def synchronize(self):
        pass


def test_layer_wise_sends_in_the_callers_thread_misuse_raises_and_sends_nothing():
    posted = []
    s = KVSender(posted.append, 100, 7, 2, RoomStatus(), layers=range(4))
    s.send([5, 6], layers=range(0, 2), ready=Event())
    assert (posted[-1].layers, posted[-1].last, len(posted[-1].ready)) == (range(0, 2), False, 1)
    bad = [
        (dict(pages=[7], layers=range(4, 5)), "outside this rank's layers"),
        (dict(pages=[5], layers=range(0, 1)), r"\(page 5, layers \[0, 1\)\) was already sent"),
        (dict(pages=[5, 7], layers=range(2, 4)), "page 7 at position 1 differs from page 6"),
        (dict(pages=[5, 6], layers=range(2, 4), ready=object()), "synchronize"),
        (dict(pages=[5, 6], layers=range(2, 4), last=False), None),   # allowed: kept open
    ]
    for kwargs, match in bad:
        before = len(posted)
        if match is None:
            s.send(**kwargs)
            assert len(posted) == before + 1 and posted[-1].last is False
            continue
        with pytest.raises(ValueError, match=match):
            s.send(**kwargs)
        assert len(posted) == before, kwargs
    s.send([], last=True)   # every (page, layer) was sent: the explicit end
    with pytest.raises(ValueError, match="after the last chunk"):
        s.send([8], layers=range(0, 1))


def test_pool_items_with_the_last_send_only_and_never_twice():
    from types import SimpleNamespace
    pools = {"aux": SimpleNamespace(num_items=8), "state": SimpleNamespace(num_items=4)}
    posted = []
    s = KVSender(posted.append, 100, 7, None, RoomStatus(), pools=pools)
    s.init(2, pool_items={"aux": [3]})
    with pytest.raises(ValueError, match="with the last send only"):
        s.send([0], pool_items={"state": [1]})
    with pytest.raises(ValueError, match=r"pool\(s\) aux were given at init\(\) and again"):
        s.send([0, 1], pool_items={"aux": [4]})
    with pytest.raises(ValueError, match="outside \\[0, 4\\)"):
        s.send([0, 1], pool_items={"state": [9]})
    assert len(posted) == 1   # only init(): nothing of a refused send went out
    s.send([0, 1], pool_items={"state": [1]})
    assert posted[-1].last and {k: list(v) for k, v in posted[-1].pool_items.items()} == {"state": [1]}
    counted = KVSender(posted.append, 100, 8, 1, RoomStatus(), pools=pools, pool_items={"aux": [0]})
    with pytest.raises(ValueError, match="given at init"):    # sender(room, n, pool_items=...) counts as init
        counted.send([0], pool_items={"aux": [1]})
