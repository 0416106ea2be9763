"""The Prometheus collector of one rank: at each scrape it reads `KVManager.stats()` once and
turns the counters and gauges of the catalog into metric families, so the exporter never keeps
a second count of anything. Imported only when metrics are on (it needs prometheus-client)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.core import Metric as Family

from . import catalog

log = logging.getLogger("kvstage")


class StatsCollector:
    """`stats` returns a `KVManager.stats()` snapshot; `labels` are the rank's own (role, engine,
    rank, backend), put on every series."""

    def __init__(self, stats: Callable[[], Mapping[str, Any]], labels: dict[str, str]) -> None:
        self._stats = stats
        self._labels = labels
        self._metrics = catalog.for_role(labels["role"], catalog.STATS_METRICS)

    def describe(self) -> Iterator[Family]:
        """The names this collector owns, so the registry refuses a clash with them."""
        for m in self._metrics:
            yield self._family(m)

    def collect(self) -> Iterator[Family]:
        try:
            snapshot = self._stats()
            families = [self._fill(m, snapshot) for m in self._metrics]
        except Exception:  # noqa: BLE001 - said here, then the scrape fails (HTTP 500), never half-filled
            log.exception("kvstage metrics: reading the stats for a scrape failed")
            raise
        yield from (f for f in families if f is not None)

    def _family(self, m: catalog.Metric) -> CounterMetricFamily | GaugeMetricFamily:
        names = list(self._labels) + ([m.label] if m.label else [])
        cls = CounterMetricFamily if m.kind == "counter" else GaugeMetricFamily
        return cls(m.name, m.help, labels=names)

    def _fill(self, m: catalog.Metric, snapshot: Mapping[str, Any]) -> CounterMetricFamily | GaugeMetricFamily | None:
        values = catalog.samples(m, snapshot)
        if values is None:
            return None
        family = self._family(m)
        own = list(self._labels.values())
        for label, value in values:
            family.add_metric(own + ([label] if m.label and label is not None else []), value)
        return family
