"""KVManager() with a control port it cannot bind fails at once with a clear error (it used to
hang in zmq Context.term() during cleanup). The bind comes before bootstrap registration, so
no bootstrap server is needed."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from kvstage.transfer import EngineConfig, KVBuffers, KVLayout, KVManager

pytestmark = pytest.mark.integration


def _start(host: str, port: int) -> tuple[BaseException | None, float]:
    """KVManager() in a daemon thread, so a hang fails the test instead of freezing it."""
    layout = KVLayout(num_layers=1, total_kv_heads=1, head_dim=8, dtype=torch.float32, page_size=4,
                      tp_size=1, tp_rank=0)
    buffers = KVBuffers(k=[torch.zeros(16, 1, 8)], v=[torch.zeros(16, 1, 8)])
    cfg = EngineConfig(role="decode", engine_id="e", bootstrap="127.0.0.1:9", host=host, ctrl_port=port,
                       staging=False)
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
