"""10,000 random and malformed frames at every socket the ranks and the bootstrap server listen
on (their control plane, and the NIXL/UCX and Mooncake listeners), with and without a token:
nothing crashes, and real transfers afterwards are bit-exact."""

import time

import pytest
from fuzz_frames import fuzz_raw, fuzz_zmq, listening_ports
from live_stats import wait_for_drops
from records import assert_exact

from kvstage.bootstrap import BootstrapClient
from kvstage.support.cluster import Cluster

pytestmark = pytest.mark.integration

GEOM = {"layers": 2, "heads": 4, "head_dim": 32, "dtype": "bfloat16", "page_size": 16, "pages": 256}
FRAMES = 10_000


def managers(role, backend_rooms, live_dir):
    out = []
    for backend, rooms in backend_rooms.items():
        engine = f"{role[0]}-{backend}"
        s = {"role": role, "rank": 0, "tp": 1, "engine": engine, "backend": backend, "staging": False,
             "geometry": GEOM, "rooms": rooms, "timeouts": {"lease": 20.0, "heartbeat": 0.5}, "run_timeout_s": 150,
             "live_stats": str(live_dir / f"{engine}.json")}
        if role == "decode":
            s["peer_engine"] = f"p-{backend}"
        out.append(s)
    return out


@pytest.mark.timeout(400)
@pytest.mark.parametrize("token", [None, "fuzz-token"])
def test_fuzzing_every_listening_socket(token, tmp_path):
    gate = str(tmp_path / "fuzzed")
    env = {"KVSTAGE_AUTH_TOKEN": token} if token else None
    rooms = {}
    for i, backend in enumerate(("nixl", "mooncake")):
        before = [{"room": 100 * (i + 1) + j, "pages": 3 + j, "chunks": [1, 2 + j]} for j in range(3)]
        after = [{"room": 100 * (i + 1) + 50 + j, "pages": 5, "chunks": [5], "start_after_file": gate} for j in range(3)]
        rooms[backend] = before + after
    with Cluster(env=env) as cl:
        p = cl.launch(managers("prefill", rooms, tmp_path), "prefill")
        d = cl.launch(managers("decode", rooms, tmp_path), "decode")
        # wait until all four managers registered (so every listener they open exists), then
        # take the ports: a rank process holds two managers that start at different speeds
        client = BootstrapClient(cl.addr, token=token)
        deadline = time.monotonic() + 120
        while len(ctrl := {r["engine_id"]: int(r["ctrl_endpoint"].rsplit(":", 1)[1])
                           for r in client.status()["ranks"]}) < 4:
            assert time.monotonic() < deadline and p.proc.poll() is None and d.proc.poll() is None, \
                f"ranks never registered: {ctrl}\n{p.log()}\n{d.log()}"
            time.sleep(0.2)
        client.close()
        # a manager registers once its backend is up, so its listeners are open; both backends
        # (NIXL/UCX and Mooncake) listen beside the two control sockets of each rank process
        ports = {name: listening_ports(pr.proc.pid) for name, pr in (("prefill", p), ("decode", d))}
        for engine, port in ctrl.items():
            assert port in {pt for _, pt in ports["prefill" if engine.startswith("p-") else "decode"]}, \
                (engine, port, ports)
        server_host, server_port = cl.addr.rsplit(":", 1)
        zmq_ports = {int(server_port), *ctrl.values()}   # the others never get past zmq's greeting
        for name, ps in ports.items():
            assert len({pt for _, pt in ps} - zmq_ports) >= 2, f"{name}: no backend listener besides control: {ps}"
        targets = [("server", (server_host, int(server_port)))] + [(n, hp) for n, ps in ports.items() for hp in ps]
        for i, (name, (host, port)) in enumerate(targets):
            if port in zmq_ports:
                fuzz_zmq(port, FRAMES, seed=i, host=host)
            # every listener took bytes: a refused connection (a wrong address) would send nothing
            assert fuzz_raw(port, FRAMES, seed=1000 + i, host=host) > 0, f"{name} {host}:{port} was never reached"
            for pr in (p, d):
                assert pr.proc.poll() is None, f"{name}:{port} fuzzing killed a rank:\n{pr.log()}"
            assert cl.server.proc.poll() is None, "fuzzing killed the bootstrap server"
        # every frame is in the ranks' socket buffers now, but a control thread on a busy box can be
        # seconds behind: let each count what it got before real requests (and the final stats) come
        wait_for_drops({engine: tmp_path / f"{engine}.json" for engine in ctrl}, 0.9 * FRAMES)
        open(gate, "w").close()   # now real requests again
        for pr in (p, d):
            pr.proc.wait(150)
        for pr in (p, d):
            assert pr.proc.returncode == 0, pr.log()
        assert len(p.result()) == 2 and len(d.result()) == 2, (p.result(), d.result())   # a manager per backend
        for res in p.result() + d.result():
            assert not res.get("error"), res.get("traceback")
            assert len(res["rooms"]) == 6
            for r in res["rooms"]:
                assert_exact(res["role"], r)
            dropped = res["stats"].get("dropped_messages", {})
            assert sum(dropped.values()) > 0.9 * FRAMES, dropped
            if token:   # two thirds of the zmq frames are well formed: all refused for want of the token
                assert dropped.get("auth", 0) > FRAMES / 2, dropped
                assert set(dropped) <= {"auth", "malformed", "oversized"}, dropped
