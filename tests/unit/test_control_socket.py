"""ControlSocket: a port it cannot bind is a clear error at once, and leaves no socket open
(an open socket would make the owner's zmq Context.term() block forever)."""

from __future__ import annotations

import socket
import threading

import pytest
import zmq

from kvstage.transfer.engine.control_socket import ControlSocket
from kvstage.transfer.protocol.messages import peer_codec


def _term_within(ctx: zmq.Context, seconds: float) -> bool:
    t = threading.Thread(target=ctx.term, daemon=True)
    t.start()
    t.join(seconds)
    return not t.is_alive()


def test_port_in_use_raises_naming_it_and_leaves_no_socket():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ctx = zmq.Context()
        with pytest.raises(OSError, match=f"127.0.0.1:{port}"):
            ControlSocket(ctx, "127.0.0.1", port, peer_codec(None))
        assert _term_within(ctx, 2.0), "a socket was left open: Context.term() blocks"


def test_host_not_local_raises_naming_it():
    ctx = zmq.Context()
    with pytest.raises(OSError, match="192.0.2.1:0"):  # TEST-NET-1: never an address of this machine
        ControlSocket(ctx, "192.0.2.1", 0, peer_codec(None))
    assert _term_within(ctx, 2.0), "a socket was left open: Context.term() blocks"
