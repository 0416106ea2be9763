"""A failure at ANY step of KVManager() raises the original error in the caller's thread within
seconds and leaves nothing behind: no thread, no socket, no port (a second manager on the same
control and metrics ports starts), whatever step failed.

The steps are KVManager's own list (STARTUP_STEPS, one `_start_<step>` method each): the first
test checks that list against the methods and against what a real start runs, so a new step
cannot escape the injection below. Each failure is injected right after one step did its work
(everything before it must be undone), and inside the steps that create several things (a
socket bound, then a worker that cannot start; a backend refusing a registration).
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from kvstage.support.cluster import free_port, start_bootstrap
from kvstage.transfer import EngineConfig, KVBuffers, KVLayout, KVManager, KVPoll, Timeouts
from kvstage.transfer.engine import loop as loop_module
from kvstage.transfer.engine import manager as manager_module
from kvstage.transfer.engine.manager import STARTUP_STEPS

pytestmark = pytest.mark.integration

RETURN_WITHIN_S = 10.0   # the injected error must reach the caller within this (a hang never returns)


class Injected(Exception):
    """The failure this test injects; the caller must get this very exception back."""


@pytest.fixture(scope="module")
def bootstrap():
    server = start_bootstrap()
    yield server.addr
    assert server.stop() == 0


def make(role: str, backend: str, bootstrap: str, ctrl_port: int, metrics_port: int):
    layout = KVLayout(num_layers=2, total_kv_heads=2, head_dim=8, dtype=torch.float32, page_size=4,
                      tp_size=1, tp_rank=0)
    buffers = KVBuffers(k=[torch.zeros(32, 2, 8) for _ in range(2)], v=[torch.zeros(32, 2, 8) for _ in range(2)])
    # staging on, so the prefill starts transfer workers and the decode a ring and its scatter thread
    cfg = EngineConfig(role=role, engine_id=f"startup-{role}-{backend}", bootstrap=bootstrap, backend=backend,
                       staging=True, ctrl_port=ctrl_port, metrics_port=metrics_port, staging_buffer_mb=1,
                       ring_mb=1, timeouts=Timeouts(bootstrap=5.0, close=2.0))
    return cfg, layout, buffers


def start_in_thread(cfg, layout, buffers) -> tuple[object, float]:
    """KVManager() in a daemon thread: (the manager or the exception it raised, seconds taken);
    a hang fails the test instead of freezing it."""
    out: list = []

    def run():
        t0 = time.monotonic()
        try:
            out.append((KVManager(cfg, layout, buffers), time.monotonic() - t0))
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out.append((exc, time.monotonic() - t0))
    t = threading.Thread(target=run, name="test-startup", daemon=True)
    t.start()
    t.join(RETURN_WITHIN_S * 3)
    assert out, f"KVManager() did not return within {RETURN_WITHIN_S * 3:g} s"
    return out[0]


def socket_fds() -> set[str]:
    """This process's open sockets (their inode names), from /proc."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:"):
            found.add(target)
    return found


def kvstage_threads() -> set[threading.Thread]:
    """The threads themselves, not their names: every manager's threads have the same names."""
    return {t for t in threading.enumerate() if t.name.startswith("kvstage")}


def test_the_steps_are_the_managers_start_methods(bootstrap):
    methods = {name[len("_start_"):] for name in dir(KVManager) if name.startswith("_start_")}
    assert methods == set(STARTUP_STEPS), "every _start_<step> method must be listed in STARTUP_STEPS"
    ran: list[str] = []
    with pytest.MonkeyPatch.context() as mp:
        for step in STARTUP_STEPS:
            original = getattr(KVManager, f"_start_{step}")
            mp.setattr(KVManager, f"_start_{step}", lambda self, cfg, _s=step, _f=original: (ran.append(_s), _f(self, cfg)))
        mgr, _ = start_in_thread(*make("prefill", "nixl", bootstrap, 0, 0))
    assert isinstance(mgr, KVManager), mgr
    mgr.close()
    assert ran == list(STARTUP_STEPS)


def _after(step: str):
    """Patch: run the step, then fail (what it created must be undone with the rest)."""
    def patch(mp):
        original = getattr(KVManager, f"_start_{step}")

        def failing(self, cfg):
            original(self, cfg)
            raise Injected(f"after {step}")
        mp.setattr(KVManager, f"_start_{step}", failing)
    return patch


def _worker_cannot_start(mp):
    """Inside control_loop: the control socket is bound, then a worker thread cannot start."""
    def refuse(*args, **kwargs):
        raise Injected("a worker that cannot start")
    mp.setattr(loop_module, "TransferWorkers", refuse)
    mp.setattr(loop_module, "ScatterWorker", refuse)


def _backend_refuses_registration(nth: int):
    """Inside regions (nth=1: the KV region) or staging (nth=2 with no pools): the backend
    refuses to register memory."""
    def patch(mp):
        real_create = manager_module.create_backend

        def create(*args, **kwargs):
            backend = real_create(*args, **kwargs)
            real_register, calls = backend.register, []

            def register(regions):
                calls.append(regions)
                if len(calls) == nth:
                    raise Injected(f"registration {nth} refused")
                return real_register(regions)
            backend.register = register
            return backend
        mp.setattr(manager_module, "create_backend", create)
    return patch


POINTS = {**{f"after_{step}": _after(step) for step in STARTUP_STEPS},
          "inside_control_loop": _worker_cannot_start,
          "inside_regions": _backend_refuses_registration(1),
          "inside_staging": _backend_refuses_registration(2)}


@pytest.mark.parametrize("role, backend", [("prefill", "nixl"), ("decode", "mooncake")])
@pytest.mark.parametrize("point", list(POINTS))
def test_a_failed_start_raises_and_leaves_nothing_behind(bootstrap, point, role, backend):
    ctrl_port, metrics_port = free_port(), free_port()
    # a first manager in this process creates the process-wide things (backend libraries' own
    # state, zmq's global context) that rightly stay; only what a manager owns must go
    warm, _ = start_in_thread(*make(role, backend, bootstrap, 0, 0))
    assert isinstance(warm, KVManager), warm
    warm.close()
    sockets, threads = socket_fds(), kvstage_threads()
    with pytest.MonkeyPatch.context() as mp:
        POINTS[point](mp)
        exc, took = start_in_thread(*make(role, backend, bootstrap, ctrl_port, metrics_port))
    assert isinstance(exc, Injected), f"the caller got {exc!r}, not the injected error"
    assert took < RETURN_WITHIN_S, f"the error came after {took:.1f} s"
    assert kvstage_threads() == threads, f"threads left behind: {[t.name for t in kvstage_threads() - threads]}"
    assert socket_fds() <= sockets, f"sockets left open: {len(socket_fds() - sockets)}"
    again, _ = start_in_thread(*make(role, backend, bootstrap, ctrl_port, metrics_port))
    assert isinstance(again, KVManager), f"a second manager on the same ports did not start: {again!r}"
    again.close()


@pytest.mark.parametrize("role, backend", [("prefill", "nixl"), ("decode", "mooncake")])
def test_a_dead_control_thread_fails_its_requests_and_close_releases_everything(bootstrap, role, backend):
    ctrl_port, metrics_port = free_port(), free_port()
    warm, _ = start_in_thread(*make(role, backend, bootstrap, 0, 0))
    assert isinstance(warm, KVManager), warm
    warm.close()
    sockets, threads = socket_fds(), kvstage_threads()
    mgr, _ = start_in_thread(*make(role, backend, bootstrap, ctrl_port, metrics_port))
    assert isinstance(mgr, KVManager), mgr

    def broken():
        raise Injected("the control socket broke")
    mgr._loop.ctx.sock.recv_batch = broken   # outside the per-input guards: the loop itself dies
    handle = mgr.sender(room=7) if role == "prefill" else mgr.receiver(room=7, prefill_engine="nobody")
    deadline = time.monotonic() + RETURN_WITHIN_S
    while handle.poll() != KVPoll.Failed and time.monotonic() < deadline:
        mgr._loop.thread.join(0.05)   # a poll with a deadline: the loop dies at its next wake-up
    assert handle.poll() == KVPoll.Failed, handle.poll()
    assert "control thread stopped" in handle.failure and "the control socket broke" in handle.failure
    with pytest.raises(RuntimeError, match="control thread stopped: Injected: the control socket broke"):
        mgr.sender(room=8) if role == "prefill" else mgr.receiver(room=8, prefill_engine="nobody")
    t0 = time.monotonic()
    mgr.close()
    assert time.monotonic() - t0 < RETURN_WITHIN_S
    assert kvstage_threads() == threads, f"threads left behind: {[t.name for t in kvstage_threads() - threads]}"
    assert socket_fds() <= sockets, f"sockets left open: {len(socket_fds() - sockets)}"
    again, _ = start_in_thread(*make(role, backend, bootstrap, ctrl_port, metrics_port))
    assert isinstance(again, KVManager), f"a second manager on the same ports did not start: {again!r}"
    again.close()
