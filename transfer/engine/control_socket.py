"""The control plane's sockets: one ROUTER this rank binds, one DEALER per peer it talks to.

Owned by the control thread alone. Frames are signed and versioned (kvstage.wire); what
fails to decode comes back as a WireError for the caller to count, never as an exception.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import zmq

from ...hop_trace import TRACE, Hop
from ...wire import Codec, WireError
from ..protocol.messages import PeerMessage

if TYPE_CHECKING:
    from ..backends.faults import ControlFaults

log = logging.getLogger(__name__)

HWM = 100_000
MAX_BATCH = 512


class ControlSocket:
    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], host: str, port: int, codec: Codec[PeerMessage],
                 faults: ControlFaults | None = None):
        self.codec = codec
        self.faults = faults  # transfer.backends.faults.ControlFaults, tests only
        self._ctx = ctx
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.RCVHWM, HWM)
        self.router.setsockopt(zmq.MAXMSGSIZE, codec.max_frame + 4096)
        try:
            self.router.bind(f"tcp://{_bracket(host)}:{port if port else '*'}")
        except zmq.ZMQError as exc:
            # an open socket would block the owner's Context.term() forever
            self.router.close(0)
            raise OSError(exc.errno, f"cannot bind the kvstage control port {host}:{port} ({exc.strerror}): "
                                     "is the port in use, or the host not an address of this machine? "
                                     "(EngineConfig.host, EngineConfig.ctrl_port or KVSTAGE_CTRL_PORT)") from None
        self.endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._dealers: dict[str, zmq.Socket[bytes]] = {}
        self.dropped_sends = 0

    def recv_batch(self) -> list[PeerMessage | WireError]:
        """Decoded messages (or WireErrors) waiting on the ROUTER, without blocking."""
        out: list[PeerMessage | WireError] = []
        for _ in range(MAX_BATCH):
            try:
                parts = self.router.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                break
            try:
                msg = self.codec.decode(parts[1:])
            except WireError as exc:
                out.append(exc)
                continue
            if TRACE.on:
                TRACE.hop(Hop.SOCKET_RECV, getattr(msg, "room", None), type(msg).__name__)
            out.append(msg)
        return out

    def send(self, endpoint: str, msg: PeerMessage) -> bool:
        if TRACE.on:
            TRACE.hop(Hop.SOCKET_SEND, getattr(msg, "room", None), type(msg).__name__)
        frames = self.codec.encode(msg)
        if self.faults is None:
            return self._send_frames(endpoint, frames)
        ok = True
        for ep, f in self.faults.outgoing(endpoint, frames, type(msg).__name__):
            ok &= self._send_frames(ep, f)
        return ok

    def flush_held(self) -> None:
        """Send frames a fault plan held back (tests only)."""
        if self.faults is not None:
            for ep, f in self.faults.due():
                self._send_frames(ep, f)

    def _send_frames(self, endpoint: str, frames: list[bytes]) -> bool:
        sock = self._dealers.get(endpoint)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, HWM)
            sock.connect(endpoint)
            self._dealers[endpoint] = sock
        try:
            sock.send_multipart(frames, zmq.NOBLOCK)
            return True
        except zmq.Again:
            self.dropped_sends += 1
            return False

    def forget(self, endpoint: str) -> None:
        sock = self._dealers.pop(endpoint, None)
        if sock is not None:
            sock.close(0)

    def close(self) -> None:
        for ep in list(self._dealers):
            self.forget(ep)
        self.router.close(0)


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
