"""Prometheus metrics of one rank, served at http://HOST:PORT/metrics when `EngineConfig(
metrics_port=...)` or KVSTAGE_METRICS_PORT asks for them (docs/operations.md lists them).

prometheus-client is optional (the `metrics` extra) and imported only here, when metrics are
requested, so `import kvstage` works without it. Each manager has its own registry: several
managers in one process (tests) never share or clash.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ...staging.thread_meter import ThreadMeter

log = logging.getLogger("kvstage")

INSTALL_HINT = "pip install 'kvstage[metrics]' (prometheus-client)"


class MetricsExporter:
    """The registry, the collector over stats(), the histograms (`observer`, for the control
    thread) and the HTTP server of one manager."""

    def __init__(self, host: str, port: int, labels: dict[str, str], stats: Callable[[], Mapping[str, Any]],
                 option: str = "metrics_port") -> None:
        try:
            from prometheus_client import CollectorRegistry, make_wsgi_app
        except ImportError as exc:
            raise ValueError(f"{option}={port}: metrics need prometheus-client, which is not installed: "
                             f"{INSTALL_HINT}; or leave metrics off (metrics_port=None and "
                             f"KVSTAGE_METRICS_PORT unset)") from exc
        from .collector import StatsCollector
        from .histograms import RequestHistograms
        from .server import MetricsServer

        self.registry = CollectorRegistry()
        self.registry.register(StatsCollector(stats, labels))
        self.observer = RequestHistograms(self.registry, labels)
        try:
            self._server: MetricsServer | None = MetricsServer(host, port, make_wsgi_app(self.registry))
        except OSError as exc:
            raise ValueError(f"{option}={port}: cannot serve metrics on {host}:{port}: "
                             f"{exc.strerror or exc}") from exc
        self.port = self._server.port
        log.info("kvstage metrics at http://%s:%d/metrics", host, self.port)

    @property
    def meters(self) -> list[ThreadMeter]:
        """The HTTP thread's wake-ups and CPU (staging/thread_meter.py), for stats()."""
        return [self._server.meter] if self._server is not None else []

    def close(self) -> None:
        """Stop serving and free the port. Idempotent."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
