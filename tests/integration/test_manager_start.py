"""KVManager() start-up failures are fast and clear: a control port it cannot bind (it used to hang
in zmq Context.term() during cleanup; the bind comes before bootstrap registration, so no
server is needed there) and a bootstrap server that refuses the registration for good."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch
import zmq

from kvstage.bootstrap import BootstrapError
from kvstage.bootstrap import messages as m
from kvstage.transfer import EngineConfig, KVBuffers, KVLayout, KVManager, Timeouts

pytestmark = pytest.mark.integration


def _start(host: str, port: int, bootstrap: str = "127.0.0.1:9",
           bootstrap_s: float = 30.0) -> tuple[BaseException | None, float]:
    """KVManager() in a daemon thread, so a hang fails the test instead of freezing it."""
    layout = KVLayout(num_layers=1, total_kv_heads=1, head_dim=8, dtype=torch.float32, page_size=4,
                      tp_size=1, tp_rank=0)
    buffers = KVBuffers(k=[torch.zeros(16, 1, 8)], v=[torch.zeros(16, 1, 8)])
    cfg = EngineConfig(role="decode", engine_id="e", bootstrap=bootstrap, host=host, ctrl_port=port,
                       staging=False, timeouts=Timeouts(bootstrap=bootstrap_s))
    out: list = []

    def run():
        t0 = time.monotonic()
        try:
            KVManager(cfg, layout, buffers).close()
            out.append((None, time.monotonic() - t0))
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out.append((exc, time.monotonic() - t0))
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(20)
    assert out, "KVManager() did not return within 20 s"
    return out[0]


@pytest.mark.parametrize("where", ["in_use", "not_local"])
def test_unbindable_control_port_fails_fast(where):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        host, port = ("127.0.0.1", taken.getsockname()[1]) if where == "in_use" else ("192.0.2.1", 0)
        exc, took = _start(host, port)
    assert isinstance(exc, OSError) and f"{host}:{port}" in str(exc), exc
    # backend start-up comes first (NIXL agent, memory registration); the failure itself is immediate
    assert took < 5.0, took


class Refuser:
    """A minimal real bootstrap endpoint that answers every request with Error(kind, text)."""

    def __init__(self, kind: str):
        self.kind, self.requests = kind, 0
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self.addr = f"127.0.0.1:{port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        req, rep = m.request_codec(None), m.reply_codec(None)
        while not self._stop.is_set():
            if not self._sock.poll(50):
                continue
            ident, *frames = self._sock.recv_multipart()
            self.requests += 1
            rid = req.decode(frames).rid
            self._sock.send_multipart([ident, *rep.encode(m.Error(rid=rid, kind=self.kind, text="the reason"))])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close(0)
        self._ctx.term()


@pytest.mark.parametrize("kind", ["bad_request", "malformed", "version", "oversized", "conflict", "full"])
def test_permanent_refusal_fails_at_once_with_the_reason(kind):
    server = Refuser(kind)
    try:
        exc, took = _start("127.0.0.1", 0, server.addr, bootstrap_s=8.0)
    finally:
        server.close()
    assert server.requests == 1 and took < 4.0, (server.requests, took)
    assert isinstance(exc, BootstrapError) and exc.kind == kind and "the reason" in str(exc), exc


def test_transient_refusal_is_retried_until_the_deadline():
    server = Refuser("internal")
    try:
        exc, took = _start("127.0.0.1", 0, server.addr, bootstrap_s=1.5)
    finally:
        server.close()
    assert isinstance(exc, BootstrapError) and "internal" in str(exc), exc
    assert server.requests >= 3 and took >= 1.5, (server.requests, took)
