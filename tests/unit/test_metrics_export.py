"""The metrics exporter over a stand-in stats() (real HTTP, real prometheus-client parser), the
catalog's reading of stats(), the documentation of every metric, and the bad-input errors at
KVManager start (a port in use, prometheus-client missing): clear, and before anything starts."""

from __future__ import annotations

import logging
import re
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from kvstage.transfer import EngineConfig, KVBuffers, KVLayout, KVManager
from kvstage.transfer.config import METRICS_PORT_ENV
from kvstage.transfer.metrics import MetricsExporter, catalog

ROOT = Path(__file__).resolve().parents[2]
LABELS = {"role": "prefill", "engine": "p0", "rank": "1", "backend": "nixl"}


def scrape(port: int) -> dict:
    """{(sample name, labels without the rank's own): value} from a real GET of /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            assert {k: s.labels[k] for k in LABELS} == LABELS, s   # every series names its rank
            extra = tuple(sorted((k, v) for k, v in s.labels.items() if k not in LABELS))
            out[(s.name, extra)] = s.value
    return out


@pytest.fixture
def exporter():
    snapshot = {"bytes_sent_by_path": {"staged": 4096, "direct": 512}, "write_requests_by_path": {"staged": 3},
                "descriptors_by_path": {"staged": 3}, "rooms": {"success": 5, "failed": 2},
                "rooms_failed_by_kind": {"aborted": 1, "timeout": 1}, "watermark_waits": 4, "watermark_wait_s": 0.25,
                "gather_s": 1.5, "write_failures": {"failed": 2}, "dropped_messages": {"auth": 3},
                "rooms_active": 2, "peers_connected": 3, "staged_pieces_waiting": 1, "quarantined_bytes": 8192,
                "ring_bytes": 1 << 20}   # a decode-only figure: a prefill rank does not show it
    e = MetricsExporter("127.0.0.1", 0, dict(LABELS), lambda: snapshot)
    e.snapshot = snapshot
    yield e
    e.close()


def test_a_scrape_shows_what_stats_says(exporter):
    got = scrape(exporter.port)
    want = {
        ("kvstage_sent_bytes_total", (("path", "staged"),)): 4096, ("kvstage_sent_bytes_total", (("path", "direct"),)): 512,
        ("kvstage_backend_writes_total", (("path", "staged"),)): 3,
        ("kvstage_backend_writes_total", (("path", "direct"),)): 0,      # both paths, from the start
        ("kvstage_requests_total", (("outcome", "success"),)): 5, ("kvstage_requests_total", (("outcome", "failed"),)): 2,
        ("kvstage_request_failures_total", (("kind", "aborted"),)): 1,
        ("kvstage_watermark_stalls_total", ()): 4, ("kvstage_watermark_stall_seconds_total", ()): 0.25,
        ("kvstage_gather_seconds_total", ()): 1.5, ("kvstage_write_failures_total", ()): 2,
        ("kvstage_dropped_messages_total", (("reason", "auth"),)): 3,
        ("kvstage_requests_active", ()): 2, ("kvstage_peers_connected", ()): 3,
        ("kvstage_staged_pieces_waiting", ()): 1, ("kvstage_quarantined_bytes", ()): 8192,
    }
    assert {k: got.get(k) for k in want} == want
    names = {name for name, _ in got}
    assert "kvstage_received_bytes_total" not in names and "kvstage_staging_ring_size_bytes" not in names
    exporter.snapshot["bytes_sent_by_path"]["staged"] = 8192        # read at each scrape: no copy kept
    assert scrape(exporter.port)[("kvstage_sent_bytes_total", (("path", "staged"),))] == 8192


def test_histograms_count_what_the_control_thread_reports(exporter):
    obs = exporter.observer
    obs.write_done("staged", 0.003)
    obs.write_done("staged", 0.03)
    obs.request_done("direct", 0.2, 3, 777)
    obs.request_done("direct", None, 1, 1)        # never inited: no duration, still a request
    got = scrape(exporter.port)
    staged, direct = (("path", "staged"),), (("path", "direct"),)
    assert got[("kvstage_write_seconds_count", staged)] == 2
    assert got[("kvstage_write_seconds_sum", staged)] == pytest.approx(0.033)
    assert got[("kvstage_write_seconds_bucket", (("le", "0.005"),) + staged)] == 1
    assert got[("kvstage_transfer_seconds_count", direct)] == 1
    assert got[("kvstage_transfer_seconds_count", staged)] == 0
    assert got[("kvstage_request_backend_writes_count", direct)] == 2
    assert got[("kvstage_request_backend_writes_sum", direct)] == 4
    assert got[("kvstage_request_descriptors_sum", direct)] == 778


def test_only_metrics_is_served_and_a_failing_scrape_is_a_logged_500(caplog):
    def broken() -> dict:
        raise RuntimeError("the stats are gone")
    e = MetricsExporter("127.0.0.1", 0, dict(LABELS), broken)
    try:
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"http://127.0.0.1:{e.port}/", timeout=10)
        assert err.value.code == 404
        with caplog.at_level(logging.ERROR, logger="kvstage"), pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"http://127.0.0.1:{e.port}/metrics", timeout=10)
        assert err.value.code == 500
        assert any("the stats are gone" in (r.exc_text or "") for r in caplog.records), caplog.records
    finally:
        e.close()


def test_close_stops_serving_and_frees_the_port_and_several_exporters_share_a_process():
    a = MetricsExporter("127.0.0.1", 0, dict(LABELS), dict)
    b = MetricsExporter("127.0.0.1", 0, dict(LABELS), dict)   # own registries: no duplicate names
    port = a.port
    assert scrape(port) and scrape(b.port)
    a.close()
    a.close()                                                   # idempotent
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
    with socket.socket() as s:   # free for a new listener (REUSEADDR: the scrape's TIME_WAIT, not a listener)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()
    assert scrape(b.port)
    b.close()


# -- the catalog ------------------------------------------------------------------------------------
def test_catalog_reads_groups_numbers_and_missing_figures():
    by_name = {m.name: m for m in catalog.ALL}
    m = by_name["kvstage_requests_total"]
    assert catalog.samples(m, {}) == [("failed", 0.0), ("success", 0.0)]
    assert catalog.samples(m, {"rooms": {"success": 2}}) == [("failed", 0.0), ("success", 2.0)]
    assert catalog.samples(by_name["kvstage_write_failures_total"], {"write_failures": {"failed": 2, "x": 1}}) == [(None, 3.0)]
    assert catalog.samples(by_name["kvstage_watermark_stalls_total"], {}) == [(None, 0.0)]   # a counter starts at 0
    assert catalog.samples(by_name["kvstage_staging_ring_size_bytes"], {}) is None           # no ring: not shown
    assert catalog.samples(by_name["kvstage_request_failures_total"], {}) == []


def test_names_follow_prometheus_conventions_and_every_stats_key_exists():
    names = [m.name for m in catalog.ALL]
    assert len(names) == len(set(names))
    for m in catalog.ALL:
        assert re.fullmatch(r"kvstage_[a-z_]+", m.name), m.name
        assert m.name.endswith("_total") == (m.kind == "counter"), m.name
        assert m.label not in catalog.RANK_LABELS
        if "seconds" in m.name or "bytes" in m.name:
            assert re.search(r"_(seconds|bytes)(_total)?$", m.name), f"{m.name}: the unit comes last"
    engine = "\n".join(p.read_text() for p in (ROOT / "transfer" / "engine").glob("*.py"))
    for m in catalog.STATS_METRICS:   # a metric reads a key the engine really writes
        assert f'"{m.source}"' in engine or f"{m.source}=" in engine, m.source


def test_every_metric_is_documented_with_its_type():
    doc = (ROOT / "docs" / "operations.md").read_text()
    for m in catalog.ALL:
        row = next((line for line in doc.splitlines() if line.startswith(f"| `{m.name}`")), None)
        assert row is not None, f"{m.name} is not in the metrics table of docs/operations.md"
        assert f"| {m.kind} |" in row, row


# -- bad input at KVManager start -----------------------------------------------------------------
def _manager(**kw) -> KVManager:
    layout = KVLayout(num_layers=1, total_kv_heads=1, head_dim=8, dtype=torch.float32, page_size=4, tp_size=1,
                      tp_rank=0)
    buffers = KVBuffers(k=[torch.zeros(16, 1, 8)], v=[torch.zeros(16, 1, 8)])
    # an unreachable rendezvous server: the metrics check comes first, so nothing else is tried
    return KVManager(EngineConfig(role="decode", engine_id="e", bootstrap="127.0.0.1:9", staging=False, **kw),
                     layout, buffers)


def test_a_metrics_port_in_use_fails_the_manager_at_once_naming_it(monkeypatch):
    monkeypatch.delenv(METRICS_PORT_ENV, raising=False)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=rf"metrics_port={port}: .*127.0.0.1:{port}.*in use"):
            _manager(metrics_port=port)
        monkeypatch.setenv(METRICS_PORT_ENV, str(port))
        with pytest.raises(ValueError, match=rf"{METRICS_PORT_ENV}={port}: .*in use"):
            _manager()


def test_metrics_without_prometheus_client_fail_the_manager_naming_it(monkeypatch):
    monkeypatch.delenv(METRICS_PORT_ENV, raising=False)
    for name in [n for n in sys.modules if n == "prometheus_client" or n.startswith("prometheus_client.")]:
        monkeypatch.setitem(sys.modules, name, None)   # import prometheus_client now raises ImportError
    with pytest.raises(ValueError, match=r"metrics_port=0: .*prometheus-client.*not installed"):
        _manager(metrics_port=0)


@pytest.mark.parametrize("value", [-1, 70000, 1.5, True, "9400"])
def test_a_bad_metrics_port_names_the_option(value, monkeypatch):
    monkeypatch.delenv(METRICS_PORT_ENV, raising=False)
    with pytest.raises(ValueError, match="metrics_port"):
        EngineConfig(role="decode", engine_id="e", bootstrap="h:1", metrics_port=value).resolved()


@pytest.mark.parametrize("raw, want", [("", None), ("9400", 9400), ("0", 0), ("x", ValueError), ("-2", ValueError)])
def test_the_metrics_port_from_the_environment(raw, want, monkeypatch):
    monkeypatch.setenv(METRICS_PORT_ENV, raw)
    cfg = EngineConfig(role="decode", engine_id="e", bootstrap="h:1")
    if want is ValueError:
        with pytest.raises(ValueError, match=METRICS_PORT_ENV):
            cfg.resolved()
    else:
        assert cfg.resolved().metrics_port == want
    monkeypatch.delenv(METRICS_PORT_ENV)
    assert cfg.resolved().metrics_port is None                       # off by default
    assert EngineConfig(role="decode", engine_id="e", bootstrap="h:1", metrics_port=9401).resolved().metrics_port == 9401


def test_kvstage_imports_without_prometheus_client():
    code = ("import sys; sys.modules['prometheus_client'] = None\n"
            "import kvstage\n"
            "from kvstage import KVManager, EngineConfig, TransferMetrics\n"
            "import kvstage.transfer.metrics\n"
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
