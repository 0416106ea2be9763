"""Engine-pair leases (EngineConfig.leases = "engine", transfer/engine/engine_liveness.py) between
real processes over real NIXL and the real rendezvous server: a prefill engine of 2 ranks (which
find each other at the rendezvous and beat each other) and a decode engine of 1 rank.

- Requests complete bit-exact; a killed prefill rank's requests fail on the decode rank within
  the lease of its last stamp (plus ticks), with the lease's reason, and on the live prefill
  rank; a restarted prefill rank (a new incarnation its sibling learns of) serves the next
  requests bit-exact.
- Heartbeat messages per rank (stats(): heartbeats_sent and heartbeats_received) fall at the
  decode rank against rank-pair leases, both pairs running side by side over the same window.
"""

import json
import time
from pathlib import Path

import pytest
from live_stats import wait_for_stat
from test_failures import assert_clean_exit, assert_failed_fast, assert_verified, rooms, rooms_of, wait_file

from kvstage.support.cluster import Cluster, rank_spec

pytestmark = pytest.mark.integration

LEASE = 3.0    # heartbeat <= lease / 8 (engine_leases.check_engine_timeouts)
TIMEOUTS = {"lease": LEASE, "heartbeat": 0.25, "connect": 3.0, "bootstrap": 25.0, "close": 3.0, "arrival": 3.0,
            "metadata": 30.0, "write": 5.0, "watermark": 10.0}
GEOM = {"layers": 2, "heads": 2, "head_dim": 32, "dtype": "bfloat16", "page_size": 16, "pages": 512}
FIELDS = {"geometry": GEOM, "ring_mb": 1, "buffer_mb": 1, "inflight": 6, "timeouts": TIMEOUTS, "run_timeout_s": 60,
          "calibrate": False,
          "staging": True}


def spec(role: str, rank: int, room_list: list, leases: str, **kw) -> dict:
    tp = 2 if role == "prefill" else 1
    return rank_spec(role, rank, tp, room_list, "nixl", **(FIELDS | {"leases": leases} | kw))


def beats(path: Path) -> tuple[float, int, int]:
    """(when, heartbeats sent, received) in a rank's live stats."""
    st = json.loads(path.read_text())
    return st["at"], sum(st.get("heartbeats_sent", {}).values()), sum(st.get("heartbeats_received", {}).values())


def rates(paths: dict, window_s: float = 2.0) -> dict:
    """Heartbeat messages per second (sent and received) at each rank, between two of its live
    stats files `window_s` apart by the rank's own clock (waited for by what it wrote, not by
    sleeping)."""
    first = {key: beats(path) for key, path in paths.items()}
    out = {}
    deadline = time.monotonic() + 30
    for key, path in paths.items():
        t0, s0, r0 = first[key]
        while True:
            try:
                t1, s1, r1 = beats(path)
            except (OSError, ValueError, KeyError):
                t1 = t0
            if t1 - t0 >= window_s:
                out[key] = (s1 - s0 + r1 - r0) / (t1 - t0)
                break
            assert time.monotonic() < deadline, f"{path} was not rewritten"
            time.sleep(0.05)
    return out


@pytest.mark.timeout(180)
def test_engine_pair_leases_bit_exact_and_a_killed_prefill_rank_fails_its_requests_within_the_lease(tmp_path):
    started, release = str(tmp_path / "started"), str(tmp_path / "release")
    with Cluster() as cl:
        early, late = rooms(100, 6, True), rooms(200, 6, False)
        for r in early:
            r["hold_last_until"] = [release]   # no early room can finish before the kill
        live = {n: tmp_path / f"{n}-live.json" for n in ("p0", "p1", "d0")}
        victim = cl.launch([spec("prefill", 0, early, "engine", started_file=started, live_stats=str(live["p0"]))],
                           "p0-victim")
        other = cl.launch([spec("prefill", 1, early + late, "engine", live_stats=str(live["p1"]))], "p1")
        decode = cl.launch([spec("decode", 0, early + late, "engine", live_stats=str(live["d0"]))], "d0")
        wait_file(started)
        wait_for_stat(live["d0"], "bytes_received")              # the victim's writes are landing
        for n in ("p0", "p1"):
            wait_for_stat(live[n], "heartbeats_received")        # the siblings found each other
        st = json.loads(live["d0"].read_text())
        assert st["heartbeats_received"].get("engine", 0) > 0 and "rank" not in st.get("heartbeats_sent", {}), st
        killed_at = time.time()
        victim.kill()
        open(release, "w").close()   # the live prefill rank sends the last chunks of rooms that lost a rank
        restarted = cl.launch([spec("prefill", 0, late, "engine")], "p0-restarted")
        for p in (other, decode, restarted):
            p.proc.wait(120)
        assert_clean_exit([other, decode, restarted])
        recs = rooms_of(decode)
        # declared lost within the lease of the victim's last stamp (no later than the kill), plus
        # a tick, a slot and the loaded machine's lateness
        assert_failed_fast(recs, [r["room"] for r in early], killed_at, LEASE + 2,
                           words=("lease expired", "said goodbye"))
        assert any("lease expired" in recs[r["room"]]["failure"] for r in early), [recs[r["room"]] for r in early]
        assert_verified(decode, [r["room"] for r in late])
        assert_failed_fast(rooms_of(other), [r["room"] for r in early], killed_at, LEASE + 2)


@pytest.mark.timeout(180)
def test_heartbeats_per_rank_fall_with_engine_pair_leases(tmp_path):
    """Two pairs side by side, one per lease mode, each a prefill engine of TP 4 (one process of
    4 managers) and a decode rank of TP 1: over the same window, the decode rank of the
    engine-pair one sends and receives fewer heartbeat messages. With a 3 s lease and a 0.375 s
    heartbeat: rank-pair, 4 peers x 2 ways every 0.375 to 0.75 s (pair_interval settles on the
    longer gap of the two, up to a quarter lease), 10.7 to 21 a second; engine-pair, one beat
    each way per 0.375 s slot, 5.3 a second."""
    release = str(tmp_path / "release")
    timeouts = TIMEOUTS | {"heartbeat": 0.375}   # lease / 8, the longest engine-pair leases allow
    geom = GEOM | {"heads": 4}
    with Cluster() as cl:
        procs, live = [], {}
        for mode in ("rank", "engine"):
            held = rooms(100, 2, True)
            for r in held:
                r["hold_last_until"] = [release]
            names = {"prefill_engine": f"pf-{mode}", "decode_engine": f"dc-{mode}"}
            for role, ranks in (("prefill", 4), ("decode", 1)):
                specs = []
                for rank in range(ranks):
                    live[(mode, role, rank)] = tmp_path / f"{mode}-{role}{rank}-live.json"
                    specs.append(rank_spec(role, rank, ranks, held, "nixl", **(FIELDS | names | {
                        "leases": mode, "timeouts": timeouts, "geometry": geom, "staging": False,
                        "live_stats": str(live[(mode, role, rank)])})))
                procs.append(cl.launch(specs, f"{mode}-{role}"))
        for path in live.values():
            wait_for_stat(path, "heartbeats_received")
        per_s = rates(live)
        print(f"\n[heartbeats per second, sent and received] "
              f"{ {'/'.join(map(str, k)): round(v, 1) for k, v in per_s.items()} }")
        open(release, "w").close()
        for p in procs:
            p.proc.wait(120)
        assert_clean_exit(procs)
        assert per_s[("engine", "decode", 0)] < 0.75 * per_s[("rank", "decode", 0)], per_s
