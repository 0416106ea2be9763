"""kvstage ranks with their rendezvous on a real etcd cluster (three members on localhost), as
separate processes: bit-exact transfers over NIXL and Mooncake while a member is down; a prefill
rank SIGKILLed, its key gone within the TTL and the decode side failing its rooms from etcd's
watch (its own peer lease is set far longer); etcd lost in the middle of a run (running and new
rooms to known ranks go on, a lookup of an unknown engine fails with kind "bootstrap" at its
deadline); etcd unreachable when a rank starts."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from engine_cases import Case, Topo, each_rank, problems, random_rooms, run_cases
from live_stats import wait_for_stat
from records import assert_exact

from kvstage.bootstrap import BootstrapError
from kvstage.support.cluster import Cluster, free_port, rank_spec
from kvstage.support.etcd_cluster import EtcdCluster
from kvstage.transfer import EngineConfig, KVBuffers, KVLayout, KVManager, Timeouts

pytestmark = pytest.mark.integration

TTL = 2
GEOM = {"layers": 2, "heads": 2, "head_dim": 32, "dtype": "bfloat16", "page_size": 16, "pages": 256}
# the peer lease is far longer than etcd's TTL: a fast failure can only come from etcd's watch
SLOW_LEASE = {"lease": 30.0, "heartbeat": 0.5, "connect": 5.0, "bootstrap": 20.0, "close": 3.0, "arrival": 30.0,
              "metadata": 60.0, "write": 10.0}


def spec(role: str, rooms: list, **kw) -> dict:
    return rank_spec(role, 0, 1, rooms, "nixl", **({"geometry": GEOM, "ring_mb": 1, "buffer_mb": 1, "inflight": 4,
                                                     "staging": False, "timeouts": SLOW_LEASE, "run_timeout_s": 60}
                                                    | kw))


def slow_rooms(first: int, n: int, release: str) -> list[dict]:
    """Rooms whose last chunk waits for `release`: in flight until the test says so."""
    return [{"room": i, "pages": 8, "chunks": [2, 2, 2, 2], "chunk_delay_s": 0.2, "hold_last_until": [release]}
            for i in range(first, first + n)]


def until(cond, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (got := cond()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.05)
    return got


def rooms_of(proc) -> dict:
    return {r["room"]: r for res in proc.result() for r in res.get("rooms", [])}


def clean_exit(procs) -> None:
    for p in procs:
        assert p.proc.returncode == 0, f"{p.log_path} exited {p.proc.returncode}:\n{p.log()}"
        for res in p.result():
            assert not res.get("error"), f"{res['name']}: {res['error']}\n{res.get('traceback')}"


@pytest.mark.timeout(240)
def test_bit_exact_over_both_backends_with_a_member_down():
    """Prefill TP 2 -> decode TP 1, NIXL staged and Mooncake direct, every rank registering and
    looking up through etcd while the member every client asks first is dead."""
    cases = [Case(topo=Topo(P=2, D=1, H=2), staging=True, backend="nixl", rooms=random_rooms(1, 6, 16)),
             Case(topo=Topo(P=2, D=1, H=2), staging=False, backend="mooncake", rooms=random_rooms(2, 6, 16))]
    with EtcdCluster(3) as ec:
        ec.kill(0)
        results, codes, logs, _ = run_cases(cases, timeout=150, rendezvous=ec.url("engines", TTL))
        assert not problems(results, codes, logs), "\n".join(problems(results, codes, logs))
        checked = [r["room"] for c, side, res in each_rank(cases, results) if side == "decode" for r in res["rooms"]]
        assert len(checked) == 12
        assert ec.keys("/engines/ranks/") == []      # every rank revoked its lease when it closed


@pytest.mark.timeout(180)
def test_prefill_killed_keys_expire_and_decode_fails_its_rooms_from_the_watch(tmp_path):
    started, release = str(tmp_path / "started"), str(tmp_path / "release")
    with EtcdCluster(3) as ec, Cluster(rendezvous=ec.url("kill", TTL)) as cl:
        victim = cl.launch([spec("prefill", slow_rooms(100, 4, release), started_file=started)], "p-victim")
        live = tmp_path / "decode-live.json"
        decode = cl.launch([spec("decode", slow_rooms(100, 4, release), live_stats=str(live))], "d0")
        until(lambda: (tmp_path / "started").exists(), 90, "the prefill rank started its rooms")
        wait_for_stat(live, "bytes_received")        # the victim's writes are landing
        assert ec.keys("/kill/ranks/pf/") == ["/kill/ranks/pf/0"]
        killed_at = time.time()
        victim.kill()
        until(lambda: ec.keys("/kill/ranks/pf/") == [], TTL + 4.0, "the killed rank's key expired")
        decode.proc.wait(60)
        clean_exit([decode])
        recs = rooms_of(decode)
        for room in range(100, 104):
            r = recs[room]
            assert r["state"] == "Failed" and "deleted from etcd" in r["failure"], r
            # far sooner than the 30 s peer lease: etcd's watch told the decode rank
            assert r["end"] - killed_at <= TTL + 8.0, f"room {room} failed {r['end'] - killed_at:.1f} s after the kill"


@pytest.mark.timeout(180)
def test_etcd_lost_mid_run_running_transfers_go_on_and_new_lookups_fail_at_their_deadline(tmp_path):
    started, down = str(tmp_path / "started"), str(tmp_path / "down")
    first = slow_rooms(100, 4, down)
    during = [{"room": i, "pages": 8, "chunks": [8], "start_after_file": down} for i in range(200, 203)]
    unknown = [{"room": 300, "pages": 4, "chunks": [4], "start_after_file": down, "source": {"engine": "nobody"}}]
    fast_lookup = SLOW_LEASE | {"bootstrap": 3.0}
    with EtcdCluster(3) as ec, Cluster(rendezvous=ec.url("outage", TTL)) as cl:
        p = cl.launch([spec("prefill", first + during, started_file=started)], "p0")
        until(lambda: ec.keys("/outage/ranks/pf/"), 90, "the prefill rank registered")
        d = cl.launch([spec("decode", first + during + unknown, timeouts=fast_lookup)], "d0")
        until(lambda: (tmp_path / "started").exists(), 90, "the rooms started")
        until(lambda: ec.keys("/outage/ranks/dc/"), 30, "the decode rank registered")
        for i in range(3):
            ec.kill(i)
        down_at = time.time()
        open(down, "w").close()
        for x in (p, d):
            x.proc.wait(90)
        clean_exit([p, d])
        recs = rooms_of(d)
        for r in first + during:
            assert_exact("decode", recs[r["room"]])
        for r in during:
            assert recs[r["room"]]["start"] > down_at
        lost = recs[300]
        assert lost["state"] == "Failed" and lost["kind"] == "bootstrap", lost
        assert "no etcd member answered" in lost["failure"] and "nobody" in lost["failure"], lost["failure"]
        # at its deadline, and no hang: the deadline counts from the receiver's creation, a moment
        # before the record's start (its init()), so the failure may come a hair under 3 s after it
        assert 3.0 - 0.1 <= lost["end"] - lost["start"] <= 3.0 + 10.0, lost


def test_etcd_unreachable_when_a_rank_starts_names_the_endpoints():
    ports = [free_port(), free_port(), free_port()]
    url = "etcd://" + ",".join(f"127.0.0.1:{p}" for p in ports) + "/nowhere"
    layout = KVLayout(num_layers=1, total_kv_heads=1, head_dim=8, dtype=torch.float32, page_size=4,
                      tp_size=1, tp_rank=0)
    buffers = KVBuffers(k=[torch.zeros(16, 1, 8)], v=[torch.zeros(16, 1, 8)])
    cfg = EngineConfig(role="decode", engine_id="e", bootstrap=url, staging=False, timeouts=Timeouts(bootstrap=1.0))
    out: list = []

    def run():
        t0 = time.monotonic()
        try:
            KVManager(cfg, layout, buffers).close()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out.append((exc, time.monotonic() - t0))
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(30)
    assert out, "KVManager() neither started nor failed within 30 s"
    exc, took = out[0]
    assert isinstance(exc, BootstrapError) and exc.kind == "timeout", exc
    assert f"registering at the rendezvous {url} failed: no etcd member answered" in str(exc), exc
    assert all(f"http://127.0.0.1:{p}" in str(exc) for p in ports), exc
    assert took < 10.0, took
