"""The etcd rendezvous' pure parts: key layout, record codec, registration verdicts, lookup
completeness and what a watch event takes away (bootstrap/etcd_records.py)."""

import msgspec
import pytest

from kvstage.bootstrap.etcd_records import (
    EtcdRecord,
    ParsedKey,
    RankGone,
    Sighting,
    Verdict,
    WatchedRanks,
    decode_record,
    encode_record,
    engine_prefix,
    parse_key,
    prefix_end,
    rank_key,
    read_engine,
    register_verdict,
)
from kvstage.bootstrap.messages import RankEntry

NS = "kvstage/test"


def entry(rank=0, inc=7, eng="pf", role="prefill", tp=2, **kw) -> RankEntry:
    return RankEntry(engine_id=eng, role=role, tp_size=tp, tp_rank=rank, ctrl_endpoint="tcp://h:1", backend="nixl",
                     backend_identity="agent", layout={"layers": 2}, pools={"kv": 4096}, incarnation=inc, **kw)


def rec(rank=0, inc=7, epoch=5, **kw) -> EtcdRecord:
    return EtcdRecord(rank=entry(rank, inc, **kw), epoch=epoch, registered_at=1.5)


def test_keys_escape_engine_ids_and_parse_back():
    assert rank_key(NS, "pf", 3) == "/kvstage/test/ranks/pf/3"
    assert rank_key(NS, "sglang-prefill@10.0.0.1:8998/dp0", 1) == "/kvstage/test/ranks/sglang-prefill%4010.0.0.1%3A8998%2Fdp0/1"
    for eid in ("pf", "a/b", "a%2Fb", "x y", "ü"):
        assert parse_key(NS, rank_key(NS, eid, 12)) == ParsedKey(eid, 12)
    assert not rank_key(NS, "a/b", 0).startswith(engine_prefix(NS, "a"))     # engine "a" never sees "a/b"
    assert parse_key(NS, "/kvstage/other/ranks/pf/0") is None
    assert parse_key(NS, "/kvstage/test/ranks/pf/x") is None
    assert parse_key(NS, "/kvstage/test/ranks/0") is None
    assert prefix_end(engine_prefix(NS, "pf")) == "/kvstage/test/ranks/pf0"
    with pytest.raises(ValueError):
        prefix_end("")


def test_records_are_versioned_json_checked_against_the_protocol_bounds():
    r = rec()
    raw = encode_record(r)
    assert raw.startswith(b'{"v":1,') and decode_record(raw) == r
    assert r.wire().epoch == 5 and r.wire().incarnation == 7
    with pytest.raises(ValueError, match="version 2"):
        decode_record(raw.replace(b'"v":1', b'"v":2'))
    with pytest.raises(ValueError, match="not a kvstage rank record"):
        decode_record(b"\x80\x04pickle")
    too_long = msgspec.json.encode(msgspec.structs.replace(r, rank=msgspec.structs.replace(r.rank, engine_id="e" * 200)))
    with pytest.raises(ValueError, match="malformed"):
        decode_record(too_long)


def test_register_verdicts():
    assert register_verdict(entry(0), {}, revision=41) == register_verdict(entry(0), {}, 41)
    assert register_verdict(entry(0), {}, 41).verdict is Verdict.NEW and register_verdict(entry(0), {}, 41).epoch == 42
    same = register_verdict(entry(0, inc=7), {0: rec(0, 7, epoch=9)}, 50)
    assert (same.verdict, same.epoch) == (Verdict.SAME, 9)                       # an incarnation keeps its epoch
    new = register_verdict(entry(0, inc=8), {0: rec(0, 7, epoch=9)}, 50)
    assert (new.verdict, new.epoch) == (Verdict.REPLACE, 51)                      # a new one gets a larger one
    changed = register_verdict(entry(0, inc=7, dp_rank=1), {0: rec(0, 7)}, 50)
    assert changed.verdict is Verdict.CONFLICT and "new incarnation" in changed.reason
    shape = register_verdict(entry(1, inc=9, tp=4), {0: rec(0, 7)}, 50)
    assert shape.verdict is Verdict.CONFLICT and "tp_size=2 with live ranks [0]" in shape.reason
    role = register_verdict(entry(1, inc=9, role="decode"), {0: rec(0, 7)}, 50)
    assert role.verdict is Verdict.CONFLICT
    assert register_verdict(entry(0, inc=9, tp=4), {0: rec(0, 7)}, 50).verdict is Verdict.REPLACE   # only itself


def test_a_lookup_is_complete_once_every_rank_of_the_newest_shape_is_there():
    assert not read_engine("pf", {}).known
    assert "unknown at etcd://x" in read_engine("pf", {}).describe("etcd://x")
    half = read_engine("pf", {0: encode_record(rec(0))})
    assert not half.complete and half.missing == (1,) and "missing ranks [1]" in half.describe("x")
    full = read_engine("pf", {1: encode_record(rec(1, 8)), 0: encode_record(rec(0))})
    assert full.complete and [r.rank.tp_rank for r in full.records] == [0, 1]
    # an older shape's rank left over while the engine restarts with another TP size
    mixed = read_engine("pf", {0: rec(0, 9, epoch=20, tp=1), 1: rec(1, 8, epoch=3)})
    assert mixed.complete and mixed.tp_size == 1 and len(mixed.records) == 1
    bad = read_engine("pf", {0: encode_record(rec(0)), 1: b"junk"})
    assert not bad.complete and "rank 1: not a kvstage rank record" in bad.describe("x")
    wrong = read_engine("pf", {0: rec(0), 1: rec(0, 8)})        # a record under another rank's key
    assert wrong.missing == (1,) and "names 'pf'/0" in wrong.describe("x")


def test_the_watch_takes_away_only_looked_up_ranks_newer_than_seen():
    w = WatchedRanks(NS)
    w.remember("pf", {0: Sighting(7, 10), 1: Sighting(8, 11)})
    assert w.on_delete(rank_key(NS, "other", 0), 20, "why") is None          # never looked up
    assert w.on_delete(rank_key(NS, "pf", 0), 9, "why") is None              # older than the lookup
    assert w.on_delete(rank_key(NS, "pf", 0), 12, "deleted") == RankGone("pf", 0, 7, "deleted")
    assert w.on_delete(rank_key(NS, "pf", 0), 13, "deleted") is None         # reported once
    assert w.on_put(rank_key(NS, "pf", 1), encode_record(rec(1, 8)), 14) is None   # its own keepalive rewrite
    g = w.on_put(rank_key(NS, "pf", 1), encode_record(rec(1, 99)), 15)
    assert (g.engine_id, g.tp_rank, g.incarnation) == ("pf", 1, 8) and "incarnation 99" in g.reason
    assert w.on_put(rank_key(NS, "pf", 1), b"junk", 16) is None
    w.remember("pf", {1: Sighting(98, 12)})                                  # a late lookup: older news
    assert w.on_delete(rank_key(NS, "pf", 1), 17, "x") == RankGone("pf", 1, 99, "x")


def test_resync_after_compaction_reports_what_is_no_longer_there():
    w = WatchedRanks(NS)
    w.remember("pf", {0: Sighting(7, 10), 1: Sighting(8, 11)})
    w.remember("pg", {0: Sighting(5, 10)})
    gone = w.resync("pf", {0: Sighting(7, 10), 1: Sighting(9, 30)}, "resync")
    assert gone == [RankGone("pf", 1, 8, "resync")]
    assert w.resync("pg", {}, "resync") == [RankGone("pg", 0, 5, "resync")]
    assert w.engines() == {"pf"} and len(w) == 2
