"""The histograms of one rank, fed by the control thread as each backend write and each
request ends (the engine's observer, see engine/context.py NoObserver). Imported only when
metrics are on (it needs prometheus-client)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram

from . import catalog


class RequestHistograms:
    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]) -> None:
        self._labels = labels
        names = list(labels) + ["path"]
        mine = {m.name for m in catalog.for_role(labels["role"], catalog.HISTOGRAMS)}
        made: dict[str, Histogram] = {}
        for m in catalog.HISTOGRAMS:
            if m.name in mine:
                buckets = catalog.SECONDS_BUCKETS if m.name.endswith("_seconds") else catalog.COUNT_BUCKETS
                made[m.name] = Histogram(m.name, m.help, names, buckets=buckets, registry=registry)
        self._transfer = made["kvstage_transfer_seconds"]         # both roles have these two
        self._writes = made["kvstage_request_backend_writes"]
        self._write = made.get("kvstage_write_seconds")
        self._descriptors = made.get("kvstage_request_descriptors")
        for h in made.values():       # both paths shown from the start, at 0, for dashboards
            for path in catalog.PATHS:
                h.labels(**labels, path=path)

    def write_done(self, path: str, seconds: float) -> None:
        if self._write is not None:
            self._write.labels(**self._labels, path=path).observe(seconds)

    def request_done(self, path: str, seconds: float | None, writes: int, descriptors: int | None) -> None:
        if seconds is not None:
            self._transfer.labels(**self._labels, path=path).observe(seconds)
        self._writes.labels(**self._labels, path=path).observe(writes)
        if descriptors is not None and self._descriptors is not None:
            self._descriptors.labels(**self._labels, path=path).observe(descriptors)
