"""Peers that die, freeze, or lose their rendezvous server, for real.

Each test breaks something in the middle of transfers between real processes, then checks what
users are promised: the surviving side fails the affected requests with a reason within the
configured deadline, no thread hangs (every process finishes and exits 0), ring regions and
handles are released, and the requests after recovery are bit-exact.
"""

import json
import os
import signal
import time

import pytest
from live_stats import wait_for_stat
from records import assert_exact

from kvstage.support.cluster import Cluster, rank_spec

pytestmark = pytest.mark.integration

LEASE = 2.0
FAST = {"lease": LEASE, "heartbeat": 0.25, "connect": 3.0, "bootstrap": 25.0, "close": 3.0, "arrival": 3.0,
        "metadata": 30.0, "write": 5.0, "watermark": 10.0}
GEOM = {"layers": 2, "heads": 2, "head_dim": 32, "dtype": "bfloat16", "page_size": 16, "pages": 512}


def rooms(first: int, n: int, slow: bool) -> list[dict]:
    """Requests of 8 pages; slow ones trickle in 4 chunks 0.4 s apart (a long transfer)."""
    out = []
    for i in range(first, first + n):
        r = {"room": i, "pages": 8, "chunks": [2, 2, 2, 2] if slow else [8]}
        if slow:
            r["chunk_delay_s"] = 0.4
        out.append(r)
    return out


RANK_FIELDS = {"geometry": GEOM, "ring_mb": 1, "buffer_mb": 1, "inflight": 6, "timeouts": FAST, "run_timeout_s": 90}


def spec(role: str, rank: int, tp: int, room_list: list, backend: str, staging: bool, **kw) -> dict:
    return rank_spec(role, rank, tp, room_list, backend, **(RANK_FIELDS | {"staging": staging} | kw))


def wait_file(path: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def rooms_of(proc) -> dict:
    return {r["room"]: r for res in proc.result() for r in res.get("rooms", [])}


def stats_of(proc) -> list:
    return [res["stats"] for res in proc.result()]


def assert_clean_exit(procs):
    for p in procs:
        assert p.proc.returncode == 0, f"{p.log_path} exited {p.proc.returncode}:\n{p.log()}"
        for res in p.result():
            assert not res.get("error"), f"{res['name']}: {res['error']}\n{res.get('traceback')}"


def assert_failed_fast(recs: dict, room_ids, since: float, limit: float, words=()):
    took = [recs[room]["end"] - since for room in room_ids if room in recs and recs[room].get("end")]
    if took:  # the detection time, for the record (pytest -s shows it; docs/operations.md quotes it)
        print(f"\n[detection] {len(took)} rooms failed {min(took):.2f}-{max(took):.2f} s after the fault")
    for room in room_ids:
        r = recs[room]
        assert r["state"] == "Failed", r
        assert r["failure"], r
        assert r["end"] - since <= limit, f"room {room} failed {r['end'] - since:.1f} s after the fault (> {limit})"
        if words:
            assert any(w in r["failure"] for w in words), r["failure"]


def assert_verified(decode_proc, room_ids) -> dict:
    """Every room of `room_ids` arrived bit-exact at this decode rank process (verified is True:
    the decode side checked every byte). Returns its records by room."""
    results = decode_proc.result()
    assert results and all(res["role"] == "decode" for res in results), results
    recs = rooms_of(decode_proc)
    for room in room_ids:
        assert room in recs, f"room {room} has no record"
        assert_exact("decode", recs[room])
    return recs


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_decode_rank_killed_mid_transfer(backend, tmp_path):
    started, release = str(tmp_path / "started"), str(tmp_path / "release")
    with Cluster() as cl:
        early, late = rooms(100, 6, True), rooms(200, 6, False)
        for r in early:
            r["hold_last_until"] = [release]  # no early room can finish before the kill, however slow the start
        prefill = [cl.launch([spec("prefill", r, 2, early + late, backend, True)], f"p{r}") for r in range(2)]
        live = tmp_path / "victim-live.json"
        victim = cl.launch([spec("decode", 0, 1, early, backend, True, started_file=started, live_stats=str(live))],
                           "d-victim")
        wait_file(started)
        wait_for_stat(live, "bytes_received")             # transfers of the slow rooms are under way
        killed_at = time.time()
        victim.kill()
        open(release, "w").close()
        survivor = cl.launch([spec("decode", 0, 1, late, backend, True)], "d-restarted")
        for p in prefill + [survivor]:
            p.proc.wait(150)
        assert_clean_exit(prefill + [survivor])
        for p in prefill:
            recs = rooms_of(p)
            assert_failed_fast(recs, [r["room"] for r in early], killed_at, LEASE + 3)
            assert_verified(survivor, [r["room"] for r in late])
            for st in stats_of(p):
                assert st["staged_pieces_waiting"] == 0 and st["rooms_active"] == 0


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_prefill_rank_killed_mid_transfer(backend, tmp_path):
    started, release = str(tmp_path / "started"), str(tmp_path / "release")
    with Cluster() as cl:
        early, late = rooms(100, 6, True), rooms(200, 6, False)
        for r in early:
            r["hold_last_until"] = [release]  # no early room can finish before the kill, however slow the start
        victim = cl.launch([spec("prefill", 0, 2, early, backend, True, started_file=started)], "p0-victim")
        other = cl.launch([spec("prefill", 1, 2, early + late, backend, True)], "p1")
        live = tmp_path / "decode-live.json"
        decode = cl.launch([spec("decode", 0, 1, early + late, backend, True, live_stats=str(live))], "d0")
        wait_file(started)
        wait_for_stat(live, "bytes_received")             # the victim's writes are landing
        killed_at = time.time()
        victim.kill()
        open(release, "w").close()  # the live prefill rank sends its last chunks of rooms that lost a rank
        restarted = cl.launch([spec("prefill", 0, 2, late, backend, True)], "p0-restarted")
        for p in (other, decode, restarted):
            p.proc.wait(150)
        assert_clean_exit([other, decode, restarted])
        recs = rooms_of(decode)
        assert_failed_fast(recs, [r["room"] for r in early], killed_at, LEASE + 3)
        assert_verified(decode, [r["room"] for r in late])
        (st,) = stats_of(decode)
        assert st["ring_live_regions"] == 0 and st["ring_live_bytes"] == 0, "quarantined regions were released"
        assert_failed_fast(rooms_of(other), [r["room"] for r in early], killed_at, LEASE + 3)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("frozen", ["decode", "prefill"])
def test_peer_frozen_past_its_lease(frozen, tmp_path):
    """SIGSTOP one side for twice the lease in the middle of transfers, then SIGCONT it: the
    other side fails the affected rooms within the lease, the frozen one fails them when it
    wakes up, and both serve the next requests bit-exact."""
    started, release = str(tmp_path / "started"), str(tmp_path / "release")
    with Cluster() as cl:
        early, late = rooms(100, 6, True), rooms(200, 6, False)
        for r in early:
            r["hold_last_until"] = [release]  # no early room can finish before the freeze, however slow the start
        for r in late:
            r["create_delay_s"] = 2 * LEASE + 3           # after the freeze is over
        p = cl.launch([spec("prefill", 0, 1, early + late, "nixl", False, started_file=started)], "p0")
        live = tmp_path / "decode-live.json"
        d = cl.launch([spec("decode", 0, 1, early + late, "nixl", False, live_stats=str(live))], "d0")
        victim, survivor = (d, p) if frozen == "decode" else (p, d)
        wait_file(started)
        wait_for_stat(live, "bytes_received")             # transfers are under way
        stopped_at = time.time()
        victim.proc.send_signal(signal.SIGSTOP)
        open(release, "w").close()  # a live prefill sends the last chunks into the frozen decode rank
        time.sleep(2 * LEASE)
        victim.proc.send_signal(signal.SIGCONT)
        for x in (p, d):
            x.proc.wait(150)
        assert_clean_exit([p, d])
        ids = [r["room"] for r in early]
        assert_failed_fast(rooms_of(survivor), ids, stopped_at, LEASE + 3, words=("lost", "lease", "silent"))
        assert all(rooms_of(victim)[i]["state"] == "Failed" for i in ids)
        assert_verified(d, [r["room"] for r in late])


def wait_progress(path, done: int, timeout: float = 60) -> dict:
    """Until a rank's progress file (pd_rank "progress") counts `done` ended rooms."""
    deadline = time.monotonic() + timeout
    seen = None
    while True:
        try:
            seen = json.loads(open(path).read())
        except (OSError, ValueError):
            pass
        if seen is not None and seen["done"] >= done:
            return seen
        assert time.monotonic() < deadline, f"{path}: {seen} after {timeout} s, waiting for {done} rooms"
        time.sleep(0.1)


@pytest.mark.timeout(240)
def test_bootstrap_server_killed_and_restarted_mid_run(tmp_path):
    """Connected ranks keep transferring while the rendezvous server is down: the rooms in flight
    when it dies, and new rooms created only after it died, complete bit-exact before it comes
    back. After it comes back on the same port the ranks re-register, and a decode engine that
    starts only then finds the prefill engine."""
    started, down = str(tmp_path / "started"), str(tmp_path / "down")
    p_progress, d_progress = str(tmp_path / "p0.progress"), str(tmp_path / "d1.progress")
    with Cluster(server_args=["--lease-s", "3"]) as cl:
        first, during, second = rooms(100, 8, True), rooms(200, 4, False), rooms(300, 4, False)
        for r in first:
            r["hold_last_until"] = [down]       # no first room can finish before the server is dead
        for r in during:
            r["start_after_file"] = down        # neither side creates these before the server is dead
        p = cl.launch([spec("prefill", 0, 1, first + during + second, "nixl", True, started_file=started,
                            progress=p_progress)], "p0")
        d1 = cl.launch([spec("decode", 0, 1, first + during, "nixl", True, progress=d_progress)], "d-first")
        wait_file(started)                      # the first window of slow rooms is transferring
        cl.kill_server()
        down_at = time.time()
        open(down, "w").close()
        # every room of d1 ends, on both sides, while the server is still down (rooms created after it died too)
        seen = wait_progress(d_progress, len(first + during), timeout=90)
        assert seen["ok"] == len(first + during), seen
        seen = wait_progress(p_progress, len(first + during), timeout=30)
        assert seen["ok"] == len(first + during), seen
        up_at = time.time()
        cl.start_server_again()
        d2 = cl.launch([{**spec("decode", 0, 1, second, "nixl", True), "engine": "dc2"}], "d-after-restart")
        for x in (p, d1, d2):
            x.proc.wait(150)
        assert_clean_exit([p, d1, d2])
        recs = assert_verified(d1, [r["room"] for r in first + during])
        for i, r in enumerate(first):
            rec = recs[r["room"]]
            assert down_at < rec["end"] < up_at, (down_at, up_at, rec)
            if i < RANK_FIELDS["inflight"]:   # the first window was in flight when the server died
                assert rec["start"] < down_at, (down_at, rec)
        for r in during:      # created after the server died, bit-exact before it came back
            rec = recs[r["room"]]
            assert down_at < rec["start"] < rec["end"] < up_at, (down_at, up_at, rec)
        pre = rooms_of(p)
        for r in during:      # the prefill side saw the room created and confirmed during the outage too
            assert pre[r["room"]]["state"] == "Success" and pre[r["room"]]["verified"] is None, pre[r["room"]]
            assert down_at < pre[r["room"]]["start"] < pre[r["room"]]["end"] < up_at, (down_at, up_at, pre[r["room"]])
        assert_verified(d2, [r["room"] for r in second])


@pytest.mark.timeout(180)
def test_a_failed_engine_lookup_fails_the_room_on_the_live_prefill_ranks_at_once(tmp_path):
    """A decode rank whose lookup of the prefill engine fails (one of its ranks left and never
    came back) fails the room, and tells the prefill ranks it is still connected to why: they fail
    the room with the decode side's reason, not at their metadata deadline (issue 49's starved
    soak: the surviving prefill rank waited 120 s for metadata that never came)."""
    gone = str(tmp_path / "p0-gone")
    timeouts = FAST | {"bootstrap": 3.0, "metadata": 120.0}
    with Cluster() as cl:
        early, late = rooms(100, 2, False), rooms(200, 3, False)
        for r in late:
            r["start_after_file"] = gone        # neither side starts these before prefill rank 0 is gone
        p0 = cl.launch([spec("prefill", 0, 2, early, "nixl", True, timeouts=timeouts)], "p0-leaves")
        p1 = cl.launch([spec("prefill", 1, 2, early + late, "nixl", True, timeouts=timeouts)], "p1")
        d0 = cl.launch([spec("decode", 0, 1, early + late, "nixl", True, timeouts=timeouts)], "d0")
        p0.proc.wait(120)                       # its rooms done, it closed and left the rendezvous
        open(gone, "w").close()
        for p in (p1, d0):
            p.proc.wait(150)
        assert_clean_exit([p0, p1, d0])
        assert_verified(d0, [r["room"] for r in early])
        decode, prefill = rooms_of(d0), rooms_of(p1)
        for r in late:
            assert decode[r["room"]]["state"] == "Failed", decode[r["room"]]
            assert "looking up prefill engine" in decode[r["room"]]["failure"], decode[r["room"]]
            rec = prefill[r["room"]]
            assert rec["state"] == "Failed", rec
            assert "looking up prefill engine" in rec["failure"], rec   # told by the decode rank, not timed out
