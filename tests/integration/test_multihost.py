"""Prefill and decode ranks on separate "hosts" (network namespaces joined by veth): NIXL over
UCX_TLS=tcp and Mooncake over tcp, bit-exact; then the link is taken down mid-transfer and the
rooms fail cleanly on both sides."""

import os
import time

import pytest
from live_stats import wait_for_stat
from netns import can_make_namespaces, delete_hosts, make_hosts
from records import assert_all_exact

from kvstage.support.cluster import Cluster, rank_spec

pytestmark = [pytest.mark.integration, pytest.mark.netns]

WHY = can_make_namespaces()
GEOM = {"layers": 4, "heads": 8, "head_dim": 64, "dtype": "bfloat16", "page_size": 16, "pages": 512}
TIMEOUTS = {"lease": 3.0, "heartbeat": 0.3, "connect": 10.0, "bootstrap": 30.0, "close": 3.0, "write": 6.0,
            "arrival": 4.0, "metadata": 30.0}


@pytest.fixture
def hosts():
    if WHY:
        if os.environ.get("CI"):  # CI runs as root with iproute2 installed by `make`: never hide it
            pytest.fail(f"network namespaces are required in CI: {WHY}")
        pytest.skip(WHY)
    h = make_hosts(f"{os.getpid() % 10000}")
    yield h
    delete_hosts(h)


RANK_FIELDS = {"staging": True, "geometry": GEOM, "ring_mb": 2, "buffer_mb": 1, "inflight": 4, "timeouts": TIMEOUTS,
               "run_timeout_s": 120}


def spec(role, rank, tp, rooms, backend, host, **kw):
    return rank_spec(role, rank, tp, rooms, backend, **(RANK_FIELDS | {"host": host} | kw))


def launch_pair(cl, h, backend, rooms, started=None, barrier=None, live=None):
    env_a = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": h.dev_a}
    env_b = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": h.dev_b}
    procs = []
    for r in range(2):
        procs.append(cl.launch([spec("prefill", r, 2, rooms, backend, h.ip_a, barrier=barrier)], f"p{r}", env=env_a,
                               netns=h.a))
    extra = {"live_stats": str(live)} if live is not None else {}
    procs.append(cl.launch([spec("decode", 0, 1, rooms, backend, h.ip_b, started_file=started, barrier=barrier,
                                 **extra)], "d0", env=env_b, netns=h.b))
    return procs


def all_rooms(procs):
    return [r for p in procs for res in p.result() for r in res.get("rooms", [])]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_across_hosts_bit_exact_then_link_down(backend, hosts, tmp_path):
    h = hosts
    with Cluster(server_host=h.ip_a, server_netns=h.a) as cl:
        rooms = [{"room": 100 + i, "pages": 8 + 5 * i, "chunks": [4, 4 + 5 * i]} for i in range(6)]
        procs = launch_pair(cl, h, backend, rooms, barrier=cl.barrier(3, timeout_s=60))
        for p in procs:
            p.proc.wait(200)
        for p in procs:
            assert p.proc.returncode == 0, p.log()
            assert len(p.result()) == 1, p.log()
            assert_all_exact(p.result(), rooms=len(rooms))   # 2 prefill ranks + 1 decode rank, 6 rooms each

    started = str(tmp_path / "started")
    with Cluster(server_host=h.ip_a, server_netns=h.a) as cl:
        release = str(tmp_path / "release")  # no room can finish before the link goes down
        slow = [{"room": 300 + i, "pages": 8, "chunks": [2, 2, 2, 2], "chunk_delay_s": 0.5, "hold_last_until": [release]}
                for i in range(4)]
        live = tmp_path / "decode-live.json"
        procs = launch_pair(cl, h, backend, slow, started=started, live=live)
        deadline = time.monotonic() + 90
        while not os.path.exists(started):
            assert time.monotonic() < deadline, "transfers never started"
            time.sleep(0.05)
        wait_for_stat(live, "bytes_received")   # bytes cross the link before it goes down
        down_at = time.time()
        h.link(up=False)
        open(release, "w").close()
        for p in procs:
            p.proc.wait(200)
        h.link(up=True)
        for p in procs:
            assert p.proc.returncode == 0, p.log()
        recs = all_rooms(procs)
        assert len(recs) == 12
        for r in recs:
            assert r["state"] == "Failed" and r["failure"], r
            assert r["end"] - down_at <= TIMEOUTS["lease"] + TIMEOUTS["write"] + 3, r
