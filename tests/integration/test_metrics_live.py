"""Prometheus metrics and request timelines of real ranks: a bootstrap server, a prefill rank and
two decode ranks (TP 1 -> 2, real NIXL or Mooncake), each serving /metrics on its own port, the
staged and the direct path side by side (each rank process hosts one manager of each).

The test scrapes every rank with a real HTTP GET while a request is held mid-transfer (its last
chunk waits for a file) and once every request ended, parses the exposition format with
prometheus-client's parser, and checks the figures against what was moved (bytes from the
geometry, requests from the per-request records) and against the rank's own stats(). Every wait
is for a condition the ranks or the endpoint show, with a deadline."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import pytest
from engine_cases import TEST_TIMEOUTS, Case, Topo, manager_specs  # first: puts examples/ on the path
from prometheus_client.parser import text_string_to_metric_families
from records import exact

from kvstage.support.cluster import Cluster
from kvstage.transfer.metrics import catalog

pytestmark = pytest.mark.integration

ROOMS = [{"room": 100, "pages": 1, "chunks": [1]},
         {"room": 101, "pages": 5, "chunks": [2, 3]},
         {"room": 102, "pages": 9, "chunks": [9]},
         {"room": 103, "pages": 3, "chunks": [1, 1, 1]}]
HELD = {"room": 104, "pages": 4, "chunks": [2, 2]}          # its last chunk waits for a file
ABORTED = {"room": 105, "pages": 2, "chunks": [2], "abort_before_init": True}   # fails on both sides
TOPO = Topo(P=1, D=2, H=2)            # each decode rank takes one of the prefill rank's two heads


def head_page_bytes(case: Case) -> int:
    """Bytes of one KV head of one page, all layers, K and V."""
    g = case.geometry()
    return g["layers"] * 2 * g["page_size"] * g["head_dim"] * 2   # bf16


def scrape(port: int) -> dict:
    """{(sample name, (extra labels...)): value}; every series must carry its rank's labels."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            assert set(catalog.RANK_LABELS) <= set(s.labels), s
            extra = tuple(sorted((k, v) for k, v in s.labels.items() if k not in catalog.RANK_LABELS))
            out[(s.name, extra)] = s.value
    return out


def value(got: dict, name: str, **labels) -> float | None:
    return got.get((name, tuple(sorted(labels.items()))))


def wait_for(what: str, check, procs, timeout_s: float = 120):
    """Until check() returns something truthy; fail at once if a rank process died, or at the
    deadline with the last thing check() saw."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        dead = [p for p in procs if p.proc.poll() is not None]
        if dead:
            raise AssertionError(f"a rank process exited while waiting for {what}: "
                                 + "\n".join(f"{p.log_path}: {p.log(3000)}" for p in dead))
        ok, last = check()
        if ok:
            return last
        time.sleep(0.1)
    raise AssertionError(f"never saw {what}; last: {last}")


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_metrics_endpoint_and_timelines(backend):
    with Cluster() as cl:
        work = Path(cl.workdir)
        release, close = work / "release-held", work / "close-managers"
        held = dict(HELD, hold_last_until=[str(release)])
        cases = [Case(topo=TOPO, staging=staged, backend=backend, rooms=ROOMS + [held, ABORTED],
                      extra={"timeouts": dict(TEST_TIMEOUTS), "run_timeout_s": 200})
                 for staged in (True, False)]
        barrier = cl.barrier(len(cases) * (TOPO.P + TOPO.D), timeout_s=200)
        managers = {}          # (case name, role, rank) -> files
        for role, count in (("prefill", TOPO.P), ("decode", TOPO.D)):
            for rank in range(count):
                specs = []
                for case in cases:
                    key = (case.name, role, rank)
                    tag = f"{case.name}-{role}{rank}"
                    files = {"metrics_file": work / f"{tag}.port", "final_stats": work / f"{tag}.final"}
                    managers[key] = files
                    spec = manager_specs(case, role, rank, barrier)
                    spec.update({k: str(v) for k, v in files.items()}, metrics_port=0, hold_open_until=str(close))
                    specs.append(spec)
                cl.launch(specs, f"{role}{rank}")
        procs = cl.procs
        try:
            ports = wait_for("every rank's metrics port", lambda: _ports(managers), procs)
            for case in cases:
                _check_during(case, ports, procs)
            release.touch()
            finals = wait_for("every request ended on every rank", lambda: _finals(managers), procs, timeout_s=200)
            for case in cases:
                _check_after(case, ports, finals)
                _check_timelines(case, finals)
        finally:
            release.touch()
            close.touch()
        cl.wait(120)
        codes = [p.proc.returncode for p in procs]
        assert not any(codes), (codes, [p.log(2000) for p in procs])


def _ports(managers: dict):
    ports = {key: (read_json(files["metrics_file"]) or {}).get("port") for key, files in managers.items()}
    return all(ports.values()), ports


def _finals(managers: dict):
    finals = {key: read_json(files["final_stats"]) for key, files in managers.items()}
    if all(f is not None for f in finals.values()):
        return True, finals
    return False, {key: f is not None for key, f in finals.items()}


def _expected_bytes(case: Case, rooms: list[dict], role: str) -> int:
    """What one rank moves for these rooms: each decode rank gets one head; the prefill rank
    writes both."""
    per_page = head_page_bytes(case) * (TOPO.D if role == "prefill" else 1)
    return sum(r["pages"] for r in rooms) * per_page


def _check_during(case: Case, ports: dict, procs) -> None:
    """The held request is mid-transfer: every other one succeeded, its first chunk landed, and
    the endpoint shows exactly that."""
    path = "staged" if case.staging else "direct"
    landed = ROOMS + [{"pages": HELD["chunks"][0]}]
    for role, count in (("prefill", TOPO.P), ("decode", TOPO.D)):
        name = "kvstage_sent_bytes_total" if role == "prefill" else "kvstage_received_bytes_total"
        want = _expected_bytes(case, landed, role)
        for rank in range(count):
            port = ports[(case.name, role, rank)]

            def check(port=port, name=name, want=want):
                got = scrape(port)
                seen = (value(got, name, path=path), value(got, "kvstage_requests_total", outcome="success"),
                        value(got, "kvstage_requests_total", outcome="failed"))
                return (True, got) if seen == (want, len(ROOMS), 1) else (False, f"(bytes, successes, failures) {seen}")
            got = wait_for(f"{case.name} {role}{rank}: {want} bytes and {len(ROOMS)} successes while a request "
                           f"is held", check, procs)
            assert value(got, "kvstage_requests_active") >= 1, "the held request is in flight"
            assert value(got, "kvstage_transfer_seconds_count", path=path) == len(ROOMS)
            other = "direct" if case.staging else "staged"
            assert value(got, name, path=other) == 0, "nothing went the other path"


def _check_after(case: Case, ports: dict, finals: dict) -> None:
    path = "staged" if case.staging else "direct"
    for role, count in (("prefill", TOPO.P), ("decode", TOPO.D)):
        for rank in range(count):
            key = (case.name, role, rank)
            final, got = finals[key], scrape(ports[key])
            stats, recs = final["stats"], final["rooms"]
            where = f"{case.name} {role}{rank}"
            # what was moved: every byte of every request that succeeded, by path
            ok = [r for r in recs if exact(role, r)]
            assert sorted(r["room"] for r in ok) == sorted(r["room"] for r in ROOMS + [HELD]), (where, recs)
            name = "kvstage_sent_bytes_total" if role == "prefill" else "kvstage_received_bytes_total"
            moved = _expected_bytes(case, ROOMS + [HELD], role)
            assert value(got, name, path=path) == moved, (where, got)
            assert stats["bytes_sent" if role == "prefill" else "bytes_received"] == moved, where
            # requests by outcome and failure kind, as the per-request records say
            assert value(got, "kvstage_requests_total", outcome="success") == len(ok), where
            failed = [r for r in recs if r["state"] == "Failed"]
            assert [r["room"] for r in failed] == [ABORTED["room"]], (where, failed)
            assert value(got, "kvstage_requests_total", outcome="failed") == 1, where
            assert value(got, "kvstage_request_failures_total", kind=failed[0]["kind"]) == 1, (where, got)
            # the same numbers as the rank's own stats(), for every counter and gauge it has (a
            # peer may still retransmit about a finished request, which this rank drops and counts;
            # the threads' wake-ups, CPU and backend steps go on with every tick)
            for m in catalog.for_role(role, catalog.STATS_METRICS):
                want = catalog.samples(m, stats)
                if want is None:
                    assert not any(n == m.name for n, _ in got), (where, m.name)
                    continue
                for label, number in want:
                    labels = {m.label: label} if m.label else {}
                    shown = value(got, m.name, **labels)
                    if m.source in ("dropped_messages", "dropped_tags", "thread_wakeups", "thread_cpu_s",
                                    "backend_steps"):
                        assert shown >= number, (where, m.name, labels, number, shown)
                    else:
                        assert shown == number, (where, m.name, labels, number, shown)
            assert value(got, "kvstage_requests_active") == 0 and value(got, "kvstage_quarantined_bytes") == 0, where
            # histograms: one observation per successful request, one per backend write
            assert value(got, "kvstage_transfer_seconds_count", path=path) == len(ok), where
            assert value(got, "kvstage_request_backend_writes_sum", path=path) == sum(
                r["metrics"]["backend_writes"] for r in ok), where
            if role == "prefill":
                assert value(got, "kvstage_write_seconds_count", path=path) == stats["write_requests"], where
                assert value(got, "kvstage_request_descriptors_sum", path=path) == stats["descriptors"], where
            if case.staging and role == "decode":
                assert value(got, "kvstage_staging_ring_occupied_bytes") == 0, where
                assert value(got, "kvstage_staging_ring_high_water_bytes") > 0, where


def _check_timelines(case: Case, finals: dict) -> None:
    """Phases in order on both sides; a phase that cannot happen on a side is None."""
    for (name, role, rank), final in finals.items():
        if name != case.name:
            continue
        for r in final["rooms"]:
            t = r["metrics"]["timeline"]
            where = (case.name, role, rank, r["room"], t)
            assert t["created"] is not None and t["ended"] is not None, where
            if r["state"] == "Failed":
                assert t["first_write"] is None and t["last_write"] is None, where   # aborted before any write
                continue
            chain = [t["created"], t["init"], t["first_write"], t["last_write"]]
            if role == "decode" and case.staging:
                chain.append(t["scattered"])
            chain.append(t["ended"])
            assert None not in chain and chain == sorted(chain), where
            assert t["metadata"] is not None and t["created"] <= t["metadata"] <= t["first_write"], where
            if role == "decode":
                assert t["init"] <= t["metadata"], where           # its metadata goes out after init()
            if role == "prefill" or not case.staging:
                assert t["scattered"] is None, where
