"""The control plane is authenticated; a rank's previous life is never applied to its new one."""

import time

import numpy as np
import pytest
import zmq
from live_stats import wait_for_drops
from records import assert_exact

from kvstage.bootstrap import BootstrapClient
from kvstage.support.cluster import Cluster
from kvstage.transfer.protocol.messages import RoomMeta, WatermarkUpdate, encode_pages, peer_codec

pytestmark = pytest.mark.integration

GEOM = {"layers": 2, "heads": 4, "head_dim": 32, "dtype": "bfloat16", "page_size": 16, "pages": 256}
FAST = {"lease": 3.0, "heartbeat": 0.25, "connect": 3.0, "bootstrap": 10.0, "close": 2.0}


def spec(role, rooms, token=None, **kw):
    s = {"role": role, "rank": 0, "tp": 1, "engine": "pf" if role == "prefill" else "dc", "backend": "nixl",
         "staging": False, "geometry": GEOM, "rooms": rooms, "timeouts": FAST, "run_timeout_s": 60, "token": token}
    if role == "decode":
        s["peer_engine"] = "pf"
    s.update(kw)
    return s


@pytest.mark.timeout(120)
def test_frames_without_the_right_token_are_refused_and_the_peers_still_work(tmp_path):
    """Someone who reaches a rank's control port but lacks the cluster's token (unsigned, or
    signed with another secret) is dropped and counted; the real peers then work as usual."""
    gate = str(tmp_path / "go")
    rooms = [{"room": 1, "pages": 2, "chunks": [2], "start_after_file": gate}]
    with Cluster(env={"KVSTAGE_AUTH_TOKEN": "right"}) as cl:
        live = tmp_path / "pf.json"
        p = cl.launch([spec("prefill", rooms, live_stats=str(live))], "p")
        client = BootstrapClient(cl.addr, token="right")
        deadline = time.monotonic() + 60
        while not (rows := {r["engine_id"]: r for r in client.status()["ranks"]}).get("pf"):
            assert time.monotonic() < deadline and p.proc.poll() is None, p.log()
            time.sleep(0.2)
        client.close()
        prefill = rows["pf"]
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(prefill["ctrl_endpoint"])
        forged = WatermarkUpdate(src=5, dst=prefill["incarnation"], epoch=5, round=0, tail=0)
        for token in (None, b"wrong"):
            for _ in range(3):
                sock.send_multipart(peer_codec(token).encode(forged))
        sock.close()
        ctx.term()
        wait_for_drops({"pf": live}, 6, kinds=("auth",))
        d = cl.launch([spec("decode", rooms)], "d")
        open(gate, "w").close()
        cl.wait(90)
        assert p.proc.returncode == 0 and d.proc.returncode == 0, p.log() + d.log()
        (pre,), (dec,) = p.result(), d.result()
        assert pre["stats"]["dropped_messages"].get("auth", 0) >= 6, pre["stats"]["dropped_messages"]
        assert len(pre["rooms"]) == len(dec["rooms"]) == len(rooms), (pre["rooms"], dec["rooms"])
        for r in pre["rooms"]:
            assert_exact("prefill", r)
        for r in dec["rooms"]:
            assert_exact("decode", r)   # verified is True: every byte checked


@pytest.mark.timeout(120)
def test_the_bootstrap_server_refuses_a_rank_without_its_token():
    with Cluster(env={"KVSTAGE_AUTH_TOKEN": "server-secret"}) as cl:
        d = cl.launch([spec("decode", [], token="other")], "d", env={"KVSTAGE_AUTH_TOKEN": "other"})
        cl.wait(60)
        (res,) = d.result()
        assert "BootstrapAuthError" in res["error"] or "token" in res["error"], res


@pytest.mark.timeout(180)
def test_messages_from_a_previous_life_are_dropped(tmp_path):
    """The decode rank restarts; a straggler message carrying its old incarnation (a watermark
    from the old ring, room metadata for the old life) reaches the prefill rank afterwards. It
    is dropped and counted, and the new life's transfers are bit-exact."""
    gate = str(tmp_path / "go")
    first = [{"room": 1, "pages": 3, "chunks": [3]}]
    later = [{"room": 10 + i, "pages": 4, "chunks": [2, 2], "start_after_file": gate} for i in range(4)]
    with Cluster() as cl:
        live = tmp_path / "pf.json"
        p = cl.launch([spec("prefill", first + later, live_stats=str(live))], "p")
        old = cl.launch([spec("decode", first)], "d-old")
        old.proc.wait(60)
        (old_res,) = old.result()
        old_inc = old_res["incarnation"]
        client = BootstrapClient(cl.addr)
        rows = {r["engine_id"]: r for r in client.status()["ranks"]}
        prefill = rows["pf"]
        new = cl.launch([spec("decode", later)], "d-new")
        deadline = time.monotonic() + 60
        while rows.get("dc", {}).get("incarnation", old_inc) == old_inc:
            assert time.monotonic() < deadline
            time.sleep(0.2)
            rows = {r["engine_id"]: r for r in client.status()["ranks"]}
        client.close()
        codec = peer_codec(None)
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(prefill["ctrl_endpoint"])
        for room in range(10, 14):  # forged stragglers: old ring's watermark, old-life metadata
            sock.send_multipart(codec.encode(WatermarkUpdate(src=old_inc, dst=prefill["incarnation"], epoch=old_inc,
                                                             round=10**6, tail=0)))
            sock.send_multipart(codec.encode(RoomMeta(src=old_inc, dst=prefill["incarnation"], room=room, session=7,
                                                      num_pages=4, staged=False, dst_pages=encode_pages(np.arange(4)))))
        sock.close()
        ctx.term()
        wait_for_drops({"pf": live}, 8, kinds=("stale_peer",))
        open(gate, "w").close()
        for x in (p, new):
            x.proc.wait(90)
        assert p.proc.returncode == 0 and new.proc.returncode == 0, p.log() + new.log()
        (pre,), (dec,) = p.result(), new.result()
        assert pre["stats"]["dropped_messages"].get("stale_peer", 0) >= 8, pre["stats"]["dropped_messages"]
        assert sorted(r["room"] for r in dec["rooms"]) == [r["room"] for r in later], dec["rooms"]
        for r in dec["rooms"]:
            assert_exact("decode", r)
