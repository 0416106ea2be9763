"""BackendOwner bookkeeping when a backend cannot release a write (a fake backend: pure
bookkeeping), NIXL's side of that contract, and shutdown that must finish even when draining
raises."""

import threading
import time
from types import SimpleNamespace

import numpy as np

from kvstage.transfer.backends.base import WriteHandle, WriteState
from kvstage.transfer.backends.nixl_backend import NixlBackend
from kvstage.transfer.engine.backend_owner import BackendOwner
from kvstage.transfer.engine.loop import EngineLoop
from kvstage.transfer.engine.manager import KVManager

ROW = np.zeros((1, 3), dtype=np.uint64)


class FakeBackend:
    """Writes stay PENDING until `fail_all()`; release_write behaves like NIXL refusing to cancel."""

    def __init__(self, returned_event: bool):
        self.handles: list[WriteHandle] = []
        self.returned_event = returned_event
        self.closed = False

    def post_write(self, peer, src, dst, tag, dst_kind=None):
        h = WriteHandle(peer=peer, nbytes=8, ndesc=1, handle=object())
        self.handles.append(h)
        return h

    def poll_write(self, h):
        return h.state

    def fail_all(self, reason="peer disconnected"):
        for h in self.handles:
            h.state, h.reason = WriteState.FAILED, reason

    def release_write(self, h):
        if h.handle is None:
            return
        h.handle = None
        if h.state is WriteState.PENDING:
            h.state, h.reason = WriteState.FAILED, "released while pending"
        h.extra["may_touch_memory"] = True  # the library refused to let go: it may still write
        if self.returned_event:
            h.extra["returned"] = threading.Event()

    def disconnect(self, peer):
        pass

    def drain_tags(self):
        return []

    def progress(self):
        pass

    def close(self):
        self.closed = True


def owner_with_write(returned_event: bool):
    fake = FakeBackend(returned_event)
    owner = BackendOwner(fake)
    done = []
    owner.submit_write("peer", ROW, ROW, b"t", lambda ok, reason: done.append((ok, reason)))
    owner.step()  # posts it
    assert owner.pending and not done
    return fake, owner, done


def test_step_survives_a_release_failure_without_a_returned_event():
    # today's NIXL: may_touch_memory set, extra["returned"] never set -> step() raised KeyError
    fake, owner, done = owner_with_write(returned_event=False)
    owner.fence("peer", time.monotonic() - 1)  # lease ran out: the write is given up on
    owner.step()
    owner.step()
    assert done == []  # it may still land: not finished
    assert owner.draining


def test_disconnected_write_whose_release_failed_is_not_finished_until_the_library_returns():
    fake, owner, done = owner_with_write(returned_event=True)
    owner.disconnect("peer")
    fake.fail_all()  # the transport reports it failed; releasing it fails: it may still land
    owner.step()
    assert done == [], "finished (room released) while the library may still write"
    fake.handles[0].extra["returned"].set()
    owner.step()
    assert done and done[0][0] is False and "disconnected" in done[0][1]


def test_owner_close_closes_the_backend_even_when_draining_raises():
    fake, owner, done = owner_with_write(returned_event=True)

    def boom(drain_s=60.0):
        raise KeyError("returned")
    owner.abort_writes = boom
    try:
        owner.close()
    except KeyError:
        pass
    assert fake.closed


def test_manager_stop_loop_stops_workers_even_when_abort_raises():
    stopped = []
    mgr = KVManager.__new__(KVManager)
    mgr.config = SimpleNamespace(timeouts=SimpleNamespace(close=0.1))
    mgr._loop = loop = SimpleNamespace(thread=SimpleNamespace(is_alive=lambda: False, ident=1),   # ran, ended
                                       workers=SimpleNamespace(stop=lambda: stopped.append("workers")),
                                       waiter=SimpleNamespace(stop=lambda: stopped.append("waiter")),
                                       scatter=SimpleNamespace(stop=lambda: stopped.append("scatter")))
    loop.stop_workers = lambda: EngineLoop.stop_workers(loop)   # the real one, on this loop's parts

    def boom():
        raise KeyError("returned")
    mgr._backend = SimpleNamespace(adopt=lambda: None, abort_writes=boom)
    try:
        mgr._stop_loop()
    except KeyError:
        pass
    assert stopped == ["workers", "waiter", "scatter"]


class RefusingAgent:
    def __init__(self):
        self.refuse = True

    def release_xfer_handle(self, xfer):
        if self.refuse:
            raise RuntimeError("NIXL_ERR_REPOST_ACTIVE")

    def get_new_notifs(self):
        return {}


def test_nixl_release_failure_hands_out_a_returned_event_set_once_released():
    b = NixlBackend.__new__(NixlBackend)
    b._agent, b._inflight, b._abandoned, b._tags, b._closed, b._name = RefusingAgent(), {}, [], [], False, "x"
    h = WriteHandle(peer="p", nbytes=8, ndesc=1, handle=object())
    b.release_write(h)
    assert h.extra.get("may_touch_memory") is True
    returned = h.extra["returned"]
    b.progress()
    assert not returned.is_set()
    b._agent.refuse = False
    b.progress()
    assert returned.is_set()
