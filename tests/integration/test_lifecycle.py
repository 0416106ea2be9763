"""The request lifecycle serving engines drive (issue 16), between real processes over real NIXL
and Mooncake, staged and direct: senders created before the page count is known (init() once
the request polls WaitingForInput, or at once, before the decode side's metadata), chunks sent
without a last flag (the request ends when its pages reach the count), room ids up to 2**64 - 1,
caches handed over as raw addresses (KVBuffers.from_pointers)."""

import zlib

import pytest
from engine_cases import TEST_TIMEOUTS, Case, Topo, each_rank, problems, random_rooms, run_cases

pytestmark = pytest.mark.integration

KNOBS = [{"late_init": "wait", "infer_last": True}, {"late_init": "now", "infer_last": True},
         {"late_init": "wait"}, {"infer_last": True}, {}]


def lifecycle_cases() -> list[Case]:
    out = []
    for backend in ("nixl", "mooncake"):
        for staging in (False, True):
            for topo in (Topo(P=2, D=1, H=4), Topo(P=1, D=2, H=2)):
                seed = zlib.crc32(repr((backend, staging, topo)).encode()) & 0xFFFF
                base = 2**64 - 10 if staging else 2**63 + 7   # room ids are unsigned 64-bit
                rooms = random_rooms(seed, 10, 16, base=base)
                for i, r in enumerate(rooms):
                    r.update(KNOBS[i % len(KNOBS)])
                extra = {"timeouts": {**TEST_TIMEOUTS, "write": 120.0}} if backend == "mooncake" else {}
                extra["from_pointers"] = topo.P == 2     # half the cases: the cache handed over as raw addresses
                out.append(
                    Case(
                        topo=topo,
                        page_size=16,
                        dtype="bfloat16",
                        staging=staging,
                        backend=backend,
                        rooms=rooms,
                        extra=extra,
                    )
                )
    return out


@pytest.mark.timeout(400)
def test_late_init_and_inferred_last_bit_exact():
    case_list = lifecycle_cases()
    results, codes, logs, _ = run_cases(case_list, timeout=240)
    bad = problems(results, codes, logs)
    assert not bad, "\n".join(bad[:30])
    waited = 0
    for c in case_list:
        late = {r["room"] for r in c.rooms if r.get("late_init") == "wait"}
        for res in results[c.name]["prefill"]:
            for rec in res["rooms"]:
                if rec["room"] in late:
                    # Bootstrapping (or nothing, when the metadata was already there), then
                    # WaitingForInput, and only then init()
                    assert rec["waited_for_input"] is True, (c.name, rec)
                    assert set(rec["seen_before_init"]) <= {"Bootstrapping"}, (c.name, rec)
                    waited += 1
        for res in results[c.name]["decode"]:
            assert len(res["rooms"]) == len(c.rooms)
            assert all(r["verified"] is True for r in res["rooms"]), c.name
        check_metrics(c, results[c.name])
    assert waited == sum(c.topo.P * sum(r.get("late_init") == "wait" for r in c.rooms) for c in case_list)


def check_metrics(c: Case, sides: dict) -> None:
    """Each request's metrics: the decode rank's own bytes exactly, the path taken, one tag per
    backend write (the prefill ranks' writes of a room sum to the decode ranks' tags)."""
    local_heads = max(1, c.topo.H // c.topo.D)
    path = "staged" if c.staging else "direct"
    writes = {r["room"]: [0, 0] for r in c.rooms}
    for r in c.rooms:
        want = r["pages"] * c.page_size * c.layers * 2 * local_heads * c.head_dim * 2  # K and V, bf16
        for res in sides["decode"]:
            m = next(x for x in res["rooms"] if x["room"] == r["room"])["metrics"]
            assert (m["state"], m["nbytes"], m["path"]) == ("Success", want, path), (c.name, r["room"], m)
            assert m["seconds"] > 0 and m["gb_per_s"] > 0
            writes[r["room"]][1] += m["backend_writes"]
        for res in sides["prefill"]:
            m = next(x for x in res["rooms"] if x["room"] == r["room"])["metrics"]
            assert m["state"] == "Success" and m["path"] in (path, "none"), (c.name, r["room"], m)
            writes[r["room"]][0] += m["backend_writes"]
    assert all(sent == landed > 0 for sent, landed in writes.values()), (c.name, writes)


ABORTS = [  # (knobs, who aborts)
    ({"late_init": "wait", "abort_at": "Bootstrapping", "init_delay_s": 1.0}, "prefill"),  # decode not there yet
    ({"late_init": "wait", "abort_at": "WaitingForInput"}, "prefill"),  # metadata in, no init
    ({"abort_at": "WaitingForInput"}, "prefill"),  # counted, nothing sent
    ({"abort_before_init": True}, "decode"),
    # before its sender exists; when the metadata had not gone out yet, the parked failure binds a
    # lease after the sender is created
    ({"create_delay_s": 1.0, "abort_after_s": 0.2}, "decode"),
    ({"create_delay_s": 1.0, "abort_before_init": True}, "decode"),  # no metadata, ever
]


@pytest.mark.timeout(300)
def test_abort_in_every_state_fails_both_sides_and_releases():
    cases = []
    for backend in ("nixl", "mooncake"):
        for staging in (True, False):
            rooms = random_rooms(11, 8, 16, base=2**64 - 20)
            for i, (knobs, _) in enumerate(ABORTS):
                rooms[i].update(knobs, pages=2, chunks=[1, 1])
            cases.append(
                Case(
                    topo=Topo(P=2, D=1, H=4),
                    page_size=16,
                    dtype="bfloat16",
                    staging=staging,
                    backend=backend,
                    rooms=rooms,
                )
            )
    results, codes, logs, _ = run_cases(cases, timeout=200)
    assert not any(codes), codes
    for c in cases:
        aborted = {c.rooms[i]["room"] for i in range(len(ABORTS))}
        for side in ("prefill", "decode"):
            for res in results[c.name][side]:
                assert not res.get("error"), res.get("traceback")
                recs = {r["room"]: r for r in res["rooms"]}
                assert set(recs) == {r["room"] for r in c.rooms}  # every room ended and was released
                for room, rec in recs.items():
                    if room in aborted:
                        assert rec["state"] == "Failed" and "abort" in rec["failure"], (c.name, side, rec)
                        assert rec["exception"]["kind"] in ("aborted", "remote_aborted"), (c.name, side, rec)
                    else:
                        assert rec["state"] == "Success" and rec["verified"] is (True if side == "decode" else None)


@pytest.mark.timeout(400)
def test_ten_thousand_short_requests_leave_no_per_room_state():
    """Cleared handles and released rooms: the engine's per-room state returns to zero."""
    rooms = [{"room": 2**63 + i, "pages": 1, "tokens": 16, "chunks": [1]} for i in range(10_000)]
    case = Case(
        topo=Topo(P=1, D=1, H=2),
        page_size=16,
        dtype="bfloat16",
        staging=False,
        backend="nixl",
        rooms=rooms,
        pages=256,
        extra={"clear_handles": True, "inflight": 64, "run_timeout_s": 300},
    )
    results, codes, logs, wall = run_cases([case], timeout=330)
    bad = problems(results, codes, logs)
    assert not bad, "\n".join(bad[:10])
    for side in ("prefill", "decode"):
        (res,) = results[case.name][side]
        assert len(res["rooms"]) == 10_000
        st = res["stats"]
        assert st["rooms"] == {"success": 10_000}, st["rooms"]
        assert st["rooms_tracked"] == 0 and st["rooms_active"] == 0, st
        assert st["room_state"] and not any(st["room_state"].values()), st["room_state"]


@pytest.mark.timeout(400)
def test_prefix_hits_send_only_the_rest_and_never_touch_the_prefix():
    """Decode ranks that hold the request's first k pages (k = 0, a chunk boundary, inside a
    chunk, all but one; late init on some rooms), and one room whose decode ranks disagree."""
    cases = []
    for backend in ("nixl", "mooncake"):
        for staging in (False, True):
            for topo in (Topo(P=2, D=1, H=4), Topo(P=1, D=2, H=2)):
                rooms = [
                    {"room": 500 + i, "pages": 12, "tokens": 190, "chunks": [4, 0, 8], "prefix_pages": k}
                    for i, k in enumerate((0, 4, 5, 11))
                ]
                rooms[1]["late_init"] = "wait"
                rooms[2]["late_init"] = "now"
                rooms[3]["infer_last"] = True
                if topo.D == 2:
                    rooms.append(
                        {
                            "room": 599,
                            "pages": 6,
                            "tokens": 96,
                            "chunks": [3, 3],
                            "prefix_pages_by_rank": {"0": 1, "1": 2},
                        }
                    )
                extra = {"timeouts": {**TEST_TIMEOUTS, "write": 120.0}} if backend == "mooncake" else {}
                cases.append(
                    Case(
                        topo=topo,
                        page_size=16,
                        dtype="bfloat16",
                        staging=staging,
                        backend=backend,
                        rooms=rooms,
                        extra=extra,
                    )
                )
    results, codes, logs, _ = run_cases(cases, timeout=240)
    assert not any(codes), codes
    for c in cases:
        for side in ("prefill", "decode"):
            for res in results[c.name][side]:
                assert not res.get("error"), res.get("traceback")
                for rec in res["rooms"]:
                    spec = next(r for r in c.rooms if r["room"] == rec["room"])
                    if "prefix_pages_by_rank" in spec:
                        assert rec["state"] == "Failed" and "prefix" in rec["failure"], (c.name, side, rec)
                        if side == "decode":  # each decode rank held a prefix (1 or 2 pages)
                            assert rec["prefix_intact"] is True, (c.name, rec)
                        continue
                    k = spec["prefix_pages"]
                    assert rec["state"] == "Success", (c.name, side, rec)
                    if side == "decode":
                        assert rec["verified"] is True, (c.name, rec)  # pages k.. bit-exact
                        if k:  # the k prefix pages kept their marker bytes
                            assert rec["prefix_intact"] is True, (c.name, rec)
                        else:
                            assert "prefix_intact" not in rec, (c.name, rec)
                        assert (
                            rec["metrics"]["nbytes"]
                            == (12 - k) * 16 * c.layers * 2 * max(1, c.topo.H // c.topo.D) * c.head_dim * 2
                        ), (c.name, rec)
                    else:
                        assert rec["decode_prefix_pages"] == k, (c.name, rec)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_prefill_instances_at_their_own_rendezvous_servers(backend):
    """A decode engine receives from three prefill engines: one by engine id at its own server,
    two by (rendezvous address, DP rank) of a second instance; a room naming a server nobody
    runs fails with the reason, and the others go on."""
    from kvstage.support.cluster import Cluster, rank_spec, start_bootstrap

    timeouts = {**TEST_TIMEOUTS, "bootstrap": 6.0, "write": 120.0}
    base = {
        "geometry": {
            "layers": 2,
            "heads": 2,
            "head_dim": 16,
            "dtype": "bfloat16",
            "page_size": 16,
            "pages": 64,
            "mla": False,
        },
        "timeouts": timeouts,
        "inflight": 8,
    }
    with Cluster() as cl:
        second = start_bootstrap()
        try:
            srcs = {
                "pa": None,
                "pb0": {"bootstrap": second.addr, "dp_rank": 0},
                "pb1": {"bootstrap": second.addr, "dp_rank": 1},
            }
            rooms = {
                e: [{"room": 7000 + 100 * i + j, "pages": 3, "chunks": [1, 2]} for j in range(4)]
                for i, e in enumerate(srcs)
            }
            dead = {"room": 9999, "pages": 2, "chunks": [2], "source": {"bootstrap": "127.0.0.1:9", "dp_rank": 0}}
            decode_rooms = [dict(r, source=srcs[e]) if srcs[e] else dict(r) for e in srcs for r in rooms[e]]
            procs = [
                cl.launch([rank_spec("prefill", 0, 1, rooms["pa"], backend, prefill_engine="pa", **base)], "pa"),
                cl.launch(
                    [rank_spec("prefill", 0, 1, rooms["pb0"], backend, prefill_engine="pb0", dp_rank=0, **base)],
                    "pb0",
                    bootstrap=second.addr,
                ),
                cl.launch(
                    [rank_spec("prefill", 0, 1, rooms["pb1"], backend, prefill_engine="pb1", dp_rank=1, **base)],
                    "pb1",
                    bootstrap=second.addr,
                ),
                cl.launch(
                    [rank_spec("decode", 0, 1, decode_rooms + [dead], backend, prefill_engine="pa", **base)], "dc"
                ),
            ]
            for p in procs:
                p.proc.wait(200)
            assert [p.proc.returncode for p in procs] == [0, 0, 0, 0], [p.log() for p in procs]
            (dec,) = procs[3].result()
            assert not dec.get("error"), dec.get("traceback")
            recs = {r["room"]: r for r in dec["rooms"]}
            assert set(recs) == {r["room"] for r in decode_rooms} | {9999}
            for r in decode_rooms:
                assert recs[r["room"]]["state"] == "Success" and recs[r["room"]]["verified"] is True, recs[r["room"]]
            bad = recs[9999]
            assert bad["state"] == "Failed" and bad["kind"] == "bootstrap" and "127.0.0.1:9" in bad["failure"], bad
            for p in procs[:3]:
                (res,) = p.result()
                assert all(r["state"] == "Success" for r in res["rooms"]), res["rooms"]
        finally:
            second.stop()


@pytest.mark.timeout(300)
def test_a_reused_room_id_is_untouched_by_its_earlier_use(tmp_path):
    """Room 42 is used four times, each use starting once the previous one ended on both sides
    (each rank waits for the others' done files, never for a delay): aborted by the decode side
    before its metadata went out, its failure reaching the prefill rank (unless the connection is
    slow) before the sender exists (which fails a lease later, no other session having come: the
    next use waits for that, or its metadata would be taken for this use's); aborted by the decode
    side mid-transfer (its last chunk waits for the abort, so no load can let the use finish
    first; the abort then races that last write); then prefill first; then decode first (its
    metadata reaches the prefill rank before the new sender exists, while the id's last use is
    remembered as finished there). Each use has its own bytes (pattern_key); nothing of an
    earlier use may fail or touch a later one. A sender left waiting for metadata fails at its
    own deadline (40 s), inside the driver's time, naming it."""
    cases = []
    for backend in ("nixl", "mooncake"):
        for staging in (True, False):
            uses = [
                {
                    "room": 42,
                    "pages": 4,
                    "chunks": [4],
                    "abort_before_init": True,
                    "create_delay_s": 1.0,
                    "pattern_key": 42,
                },
                {
                    "room": 42,
                    "pages": 6,
                    "chunks": [2, 2, 2],
                    "chunk_delay_s": 0.3,
                    "drain_before": True,
                    "abort_after_s": 0.2,
                    "touch_after_abort": str(tmp_path / f"{backend}-{staging}-use1-aborted-{{rank}}"),
                    "hold_last_until": [str(tmp_path / f"{backend}-{staging}-use1-aborted-0")],
                    "pattern_key": 1042,
                },
                {
                    "room": 42,
                    "pages": 6,
                    "chunks": [2, 2, 2],
                    "pattern_key": 2042,
                    "drain_before": True,
                    "init_delay_s": 1.5,
                },
                {
                    "room": 42,
                    "pages": 6,
                    "chunks": [3, 3],
                    "pattern_key": 3042,
                    "drain_before": True,
                    "create_delay_s": 1.5,
                },
            ]
            # a use starts once the one before it ended on both sides (README: the reuse contract)
            ranks = ["prefill-0", "prefill-1", "decode-0"]
            for i, use in enumerate(uses):
                use["done_file"] = str(tmp_path / f"{backend}-{staging}-use{i}-{{role}}-{{rank}}")
                if i:
                    use["start_after_file"] = [str(tmp_path / f"{backend}-{staging}-use{i - 1}-{r}") for r in ranks]
            cases.append(
                Case(
                    topo=Topo(P=2, D=1, H=4),
                    page_size=16,
                    dtype="bfloat16",
                    staging=staging,
                    backend=backend,
                    rooms=uses,
                    extra={"timeouts": {**TEST_TIMEOUTS, "metadata": 40.0}},
                )
            )
    results, codes, logs, _ = run_cases(cases, timeout=200)
    assert not any(codes), codes
    for c, side, res in each_rank(cases, results):
        states = [(r["room"], r["state"]) for r in res["rooms"]]
        assert states == [(42, "Failed"), (42, "Failed"), (42, "Success"), (42, "Success")], (c.name, side, res["rooms"])
        assert all("abort" in r["failure"] for r in res["rooms"][:2]), res["rooms"]
        if side == "decode":
            assert [r["verified"] for r in res["rooms"][2:]] == [True, True], (c.name, res["rooms"])


@pytest.mark.timeout(300)
def test_a_room_id_reused_back_to_back_under_late_and_duplicated_messages():
    """Room 77 is used eight times in a row, each use starting once the previous one ended on the
    decode side, while the decode ranks' control messages are duplicated and held back up to a
    second: metadata of an earlier use arrives at the next use's sender, and the next use's
    metadata at a sender whose own writes are still completing. Every use succeeds with its own
    bytes."""
    cases = []
    for backend in ("nixl", "mooncake"):
        for staging in (True, False):
            uses = [
                {"room": 77, "pages": 3, "chunks": [1, 2], "pattern_key": 7700 + i, "drain_before": i > 0}
                for i in range(8)
            ]
            faults = {"dup_msgs": 0.5, "reorder_msgs": 0.5, "hold_s": 1.0, "seed": 5}
            cases.append(
                Case(
                    topo=Topo(P=2, D=1, H=4),
                    page_size=16,
                    dtype="bfloat16",
                    staging=staging,
                    backend=backend,
                    rooms=uses,
                    decode_extra={"faults": faults},
                )
            )
    results, codes, logs, _ = run_cases(cases, timeout=200)
    bad = problems(results, codes, logs)
    assert not bad, "\n".join(bad[:10])
