"""The SGLang adapter's send gate (adapters/sglang/send_gate.py), without SGLang: a send with an
event to wait for returns at once on the caller's thread; the event is waited on by the gate's
thread, and only then are the indices read and the chunk handed on; a request's later sends keep
their order behind it; an ended request neither waits nor sends; failures reach the caller."""

from __future__ import annotations

import threading
import time

import pytest

from kvstage.adapters.sglang.send_gate import RequestSends, SendGate

DEADLINE_S = 10.0


class GpuEvent:
    """Stands for a CUDA event: synchronize() blocks until the test "completes the GPU work",
    which also writes the page indices (as SGLang's asynchronous copy into a pinned tensor)."""

    def __init__(self, log: list, name: str, indices: list, value: list):
        self.log, self.name, self.indices, self.value = log, name, indices, value
        self.done = threading.Event()
        self.waited_on: str | None = None

    def complete(self) -> None:
        self.indices[:] = self.value
        self.done.set()

    def synchronize(self) -> None:
        self.waited_on = threading.current_thread().name
        self.log.append(("wait", self.name))
        assert self.done.wait(DEADLINE_S)
        self.log.append(("waited", self.name))


class Sink:
    """Records each send proper: which thread, and the indices as they were when read."""

    def __init__(self, log: list, fail_with: str | None = None):
        self.log, self.fail_with = log, fail_with
        self.aborted = 0

    def run(self, kv_indices, state_indices):
        self.log.append(("read", list(kv_indices), threading.current_thread().name))
        return self.fail_with

    def abort(self) -> None:
        self.aborted += 1


def until(predicate) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.001)


@pytest.fixture
def gate():
    g = SendGate()
    yield g
    g.close()


def test_without_events_the_send_runs_on_the_callers_thread(gate):
    log = []
    sink = Sink(log)
    sends = RequestSends(gate, sink.run, sink.abort)
    assert sends.send([1, 2], None, []) is None
    assert log == [("read", [1, 2], threading.current_thread().name)]


def test_the_event_is_waited_on_by_the_gate_before_the_indices_are_read(gate):
    log = []
    sink = Sink(log)
    sends = RequestSends(gate, sink.run, sink.abort)
    indices = [0, 0]                          # not yet written by the "copy"
    ev = GpuEvent(log, "early", indices, [5, 6])
    started = time.monotonic()
    assert sends.send(indices, None, [ev]) is None
    assert time.monotonic() - started < 1.0   # the caller did not wait
    sends.send([7], None, [])                 # a later chunk of the same request, no event
    other = RequestSends(gate, Sink(log).run, sink.abort)
    other.send([9], None, [])                 # another request: not held behind the event
    until(lambda: ("wait", "early") in log)
    assert ("read", [9], threading.current_thread().name) in log
    assert not [e for e in log if e[0] == "read" and e[1] in ([5, 6], [0, 0], [7])]
    ev.complete()
    until(lambda: len([e for e in log if e[0] == "read"]) == 3)
    assert ev.waited_on == "kvstage-send-gate"
    mine = [e for e in log if e[:2] != ("read", [9])]
    assert mine == [("wait", "early"), ("waited", "early"), ("read", [5, 6], "kvstage-send-gate"),
                    ("read", [7], "kvstage-send-gate")]
    assert sends.failure is None and sink.aborted == 0


def test_both_events_of_a_send_are_waited_on(gate):
    log = []
    sink = Sink(log)
    sends = RequestSends(gate, sink.run, sink.abort)
    indices = [0]
    early, copy = GpuEvent(log, "early", [], []), GpuEvent(log, "indices", indices, [3])
    sends.send(indices, None, [early, copy])
    early.complete()
    until(lambda: ("wait", "indices") in log)
    assert not [e for e in log if e[0] == "read"]
    copy.complete()
    until(lambda: [e for e in log if e[0] == "read"])
    assert [e for e in log if e[0] == "read"] == [("read", [3], "kvstage-send-gate")]


def test_an_ended_request_neither_waits_nor_sends(gate):
    log = []
    sink = Sink(log)
    sends = RequestSends(gate, sink.run, sink.abort)
    blocker = GpuEvent(log, "blocker", [], [])
    RequestSends(gate, Sink(log).run, sink.abort).send([1], None, [blocker])   # holds the gate
    ev = GpuEvent(log, "early", [], [])
    sends.send([2], None, [ev])
    sends.cancel()
    blocker.complete()
    marker = GpuEvent(log, "marker", [], [])
    marker.complete()
    RequestSends(gate, Sink(log).run, sink.abort).send([3], None, [marker])     # runs after ours
    until(lambda: ("read", [3], "kvstage-send-gate") in log)
    assert ("wait", "early") not in log and not [e for e in log if e[0] == "read" and e[1] == [2]]


@pytest.mark.parametrize("how", ["send", "event"])
def test_a_failure_on_the_gate_aborts_and_reaches_the_caller(gate, how):
    log = []
    sink = Sink(log, fail_with="send: page 99 out of range" if how == "send" else None)
    sends = RequestSends(gate, sink.run, sink.abort)

    class Broken:
        def synchronize(self):
            raise RuntimeError("CUDA error: an illegal memory access")

    ok = GpuEvent(log, "ok", [], [])
    ok.complete()
    sends.send([1], None, [Broken() if how == "event" else ok])
    until(lambda: sends.failure is not None)
    assert sink.aborted == 1
    assert ("illegal memory access" if how == "event" else "page 99") in sends.failure
    assert sends.send([2], None, []) is None     # the request failed: nothing more is sent
    assert not [e for e in log if e[0] == "read" and e[1] == [2]] and sink.aborted == 1
