"""The HTTP endpoint of one rank's metrics: `/metrics` on its own daemon thread, stopped (and
its port freed) by close(). Built on the standard library's WSGI server and prometheus-client's
WSGI app; its own small wrapper only so that a failing scrape is logged to the `kvstage`
logger and a bad path gets a 404."""

from __future__ import annotations

import logging
import socket
import threading
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

log = logging.getLogger("kvstage")

PATHS = ("/metrics", "/metrics/")


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True      # a scrape in progress never holds the process at exit


class _Server6(_Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args) -> None:  # noqa: A002 - the stdlib's signature
        pass                                         # one line per scrape on stderr is noise


def guarded(app):
    """`app` at PATHS only; an exception in it is logged and answered with a 500."""
    def wsgi(environ, start_response):
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

    def __init__(self, host: str, port: int, app):
        server = _Server6 if ":" in host else _Server
        self._httpd = make_server(host, port, guarded(app), server_class=server, handler_class=_QuietHandler)
        self.port: int = self._httpd.server_port
        self._thread = threading.Thread(target=self._serve, name="kvstage-metrics", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            self._httpd.serve_forever(poll_interval=0.5)
        except Exception:  # noqa: BLE001 - said, not swallowed: the endpoint is gone
            log.exception("kvstage metrics: the HTTP server stopped on an error")

    def close(self) -> None:
        self._httpd.shutdown()          # returns once serve_forever has left its loop
        self._httpd.server_close()
        self._thread.join(5)
