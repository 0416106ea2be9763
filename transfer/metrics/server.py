"""The HTTP endpoint of one rank's metrics: `/metrics` on its own daemon thread, stopped (and
its port freed) by close(). Built on the standard library's WSGI server and prometheus-client's
WSGI app; its own small wrapper only so that a failing scrape is logged to the `kvstage`
logger and a bad path gets a 404. The thread blocks on the listening socket and a wake-up pipe
(not serve_forever's half-second polling), so between scrapes it never runs."""

from __future__ import annotations

import logging
import os
import selectors
import socket
import threading
from collections.abc import Iterable
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from ...staging.thread_meter import ThreadMeter

if TYPE_CHECKING:  # wsgiref.types is new in Python 3.11
    from wsgiref.types import StartResponse, WSGIApplication, WSGIEnvironment

log = logging.getLogger("kvstage")

PATHS = ("/metrics", "/metrics/")


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True      # a scrape in progress never holds the process at exit


class _Server6(_Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the stdlib's signature
        pass                                         # one line per scrape on stderr is noise


def guarded(app: WSGIApplication) -> WSGIApplication:
    """`app` at PATHS only; an exception in it is logged and answered with a 500."""
    def wsgi(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        if environ.get("PATH_INFO", "") not in PATHS:
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"kvstage serves its metrics at /metrics\n"]
        try:
            return app(environ, start_response)
        except Exception as exc:  # noqa: BLE001 - a scrape must never take a thread down silently
            log.exception("kvstage metrics: a scrape failed")
            start_response("500 Internal Server Error", [("Content-Type", "text/plain")])
            return [f"kvstage metrics: {type(exc).__name__}: {exc}\n".encode()]
    return wsgi


class MetricsServer:
    """Binds at construction (so a port in use fails the caller at once: OSError) and serves."""

    def __init__(self, host: str, port: int, app: WSGIApplication) -> None:
        server = _Server6 if ":" in host else _Server
        self._httpd = make_server(host, port, guarded(app), server_class=server, handler_class=_QuietHandler)
        self.port: int = self._httpd.server_port
        self._httpd.timeout = 0            # handle_request() after select: never blocks
        self.meter = ThreadMeter("metrics")
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._serve, name="kvstage-metrics", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        self.meter.started()
        sel = selectors.DefaultSelector()
        sel.register(self._httpd.socket, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        try:
            while True:
                ready = sel.select()          # no timeout: a scrape or close() wakes it
                self.meter.wake()
                if any(key.fd == self._wake_r for key, _ in ready):
                    return
                self._httpd.handle_request()   # accept (timeout 0: never blocks), a thread per request
        except Exception:  # noqa: BLE001 - said, not swallowed: the endpoint is gone
            log.exception("kvstage metrics: the HTTP server stopped on an error")
        finally:
            sel.close()
            self.meter.stopped()

    def close(self) -> None:
        os.write(self._wake_w, b"x")
        self._thread.join(5)
        self._httpd.server_close()
        os.close(self._wake_r)
        os.close(self._wake_w)
