"""A bootstrap server on a daemon thread of the calling process: what a serving engine's adapter
runs when it hosts the rendezvous itself (SGLang's prefill instance, vLLM's TP rank 0), so
nothing else has to be started beside the servers."""

from __future__ import annotations

import threading

from ..wire import load_token
from .server import BootstrapServer


def join_host_port(host: str, port: int) -> str:
    """`host:port`, with an IPv6 literal in brackets."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class InProcessServer:
    """The server bound and serving once constructed; `close()` stops and joins it. The shared
    token (KVSTAGE_AUTH_TOKEN) is read from the environment, as for a standalone server."""

    def __init__(self, host: str, port: int = 0):
        self._server = BootstrapServer(host, port, token=load_token())
        self._server.start()
        self.port = self._server.port
        self.address = join_host_port(host.strip("[]"), self.port)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._server.serve, args=(self._stop,), name="kvstage-rendezvous",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._server.close()
