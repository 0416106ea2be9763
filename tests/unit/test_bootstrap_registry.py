"""The bootstrap registry (pure state, injected time) and the protocol messages."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvstage.bootstrap import messages as m
from kvstage.bootstrap.registry import Limits, Refused, Registry
from kvstage.wire import WireError, sign

T0 = 1000.0


def entry(engine="e", rank=0, tp=2, role="prefill", inc=1, **kw) -> m.RankEntry:
    fields = dict(engine_id=engine, role=role, tp_size=tp, tp_rank=rank,
                  ctrl_endpoint=f"tcp://10.0.0.1:{5000 + rank}", backend="nixl",
                  backend_identity=f"agent-{engine}-{rank}-{inc}", layout={"heads": 8},
                  pools={"kv": 1 << 20}, incarnation=inc)
    fields.update(kw)
    return m.RankEntry(**fields)


def reg(**kw) -> Registry:
    kw.setdefault("lease_s", 10.0)
    return Registry(**kw)


# ---- registration and epochs --------------------------------------------------------------

def test_register_assigns_increasing_epochs_from_base():
    r = reg(epoch_base=100)
    a, fa = r.register(entry(rank=0), T0, wall=5.0)
    b, fb = r.register(entry(rank=1), T0)
    assert (a.epoch, b.epoch) == (101, 102) and fa and fb
    assert a.registered_at == 5.0 and b.registered_at == T0
    assert a.tp_rank == 0 and a.incarnation == 1 and a.layout == {"heads": 8}
    assert (r.num_engines, r.num_ranks, r.last_epoch) == (1, 2, 102)


def test_same_incarnation_is_idempotent():
    r = reg()
    a, _ = r.register(entry(), T0, wall=1.0)
    b, fresh = r.register(entry(), T0 + 5, wall=2.0)
    assert not fresh and b == a  # same epoch, same registered_at
    assert r.num_ranks == 1 and r.last_epoch == a.epoch


def test_same_incarnation_with_other_details_is_a_conflict():
    r = reg()
    r.register(entry(), T0)
    with pytest.raises(Refused) as exc:
        r.register(entry(ctrl_endpoint="tcp://elsewhere:1"), T0)
    assert exc.value.kind == "conflict" and "incarnation" in exc.value.text


def test_new_incarnation_gets_larger_epoch_and_replaces():
    r = reg()
    a, _ = r.register(entry(rank=0, inc=1), T0)
    r.register(entry(rank=1, inc=7), T0)
    b, fresh = r.register(entry(rank=0, inc=2), T0 + 1)
    assert fresh and b.epoch > a.epoch and r.num_ranks == 2
    res = r.lookup("e", T0 + 1)
    assert res.complete and [x.incarnation for x in res.records] == [2, 7]
    assert res.records[0].epoch == b.epoch


def test_bad_rank_and_oversized_tp():
    r = reg(limits=Limits(max_ranks_per_engine=4))
    with pytest.raises(Refused) as exc:
        r.register(entry(rank=2, tp=2), T0)
    assert exc.value.kind == "bad_request" and "tp_rank 2" in exc.value.text
    with pytest.raises(Refused) as exc:
        r.register(entry(rank=0, tp=8), T0)
    assert exc.value.kind == "full" and "tp_size 8" in exc.value.text
    assert r.num_ranks == 0


# ---- lookups --------------------------------------------------------------------------

def test_lookup_unknown_incomplete_complete_sorted():
    r = reg()
    assert r.lookup("e", T0) == r.lookup("e", T0) and not r.lookup("e", T0).known
    assert not r.lookup("e", T0).complete
    for rank in (3, 1):
        r.register(entry(rank=rank, tp=4), T0)
    res = r.lookup("e", T0)
    assert res.known and not res.complete and res.missing == (0, 2) and res.stale == ()
    assert (res.role, res.tp_size) == ("prefill", 4)
    for rank in (2, 0):
        r.register(entry(rank=rank, tp=4), T0)
    res = r.lookup("e", T0)
    assert res.complete and [x.tp_rank for x in res.records] == [0, 1, 2, 3]


# ---- engine consistency -----------------------------------------------------------------

@pytest.mark.parametrize("change", [{"tp": 4}, {"role": "decode"}])
def test_conflicting_shape_refused_while_others_live(change):
    r = reg()
    r.register(entry(rank=0, inc=1), T0)
    r.register(entry(rank=1, inc=2), T0)
    with pytest.raises(Refused) as exc:
        r.register(entry(rank=0, inc=3, **change), T0 + 1)
    assert exc.value.kind == "conflict" and "live ranks [1]" in exc.value.text
    assert r.lookup("e", T0 + 1).complete  # untouched


def test_conflicting_shape_replaces_engine_once_others_are_stale():
    r = reg(lease_s=10.0)
    r.register(entry(rank=0, inc=1), T0)
    r.register(entry(rank=1, inc=2), T0)
    r.heartbeat("e", 0, 1, T0 + 8)  # rank 0 stays live, but this newcomer replaces it
    rec, fresh = r.register(entry(rank=0, tp=1, inc=3), T0 + 15)
    assert fresh
    res = r.lookup("e", T0 + 15)
    assert res.complete and res.tp_size == 1 and [x.incarnation for x in res.records] == [3]
    assert r.num_ranks == 1


def test_shape_change_after_deregistration():
    r = reg()
    r.register(entry(rank=0, inc=1), T0)
    r.register(entry(rank=1, inc=2), T0)
    assert r.deregister("e", 0, 1) and r.deregister("e", 1, 2)
    assert r.num_engines == 0
    r.register(entry(rank=0, tp=1, role="decode", inc=3), T0)
    assert r.lookup("e", T0).role == "decode"


# ---- heartbeats, staleness, sweep ---------------------------------------------------------

def test_heartbeat_states_and_staleness():
    r = reg(lease_s=10.0)
    a, _ = r.register(entry(rank=0, tp=1, inc=1), T0)
    assert r.heartbeat("e", 0, 1, T0 + 9) == "ok"
    assert r.heartbeat("e", 0, 1, T0 + 18) == "ok"   # the lease counts from the last heartbeat
    assert r.lookup("e", T0 + 28).complete
    assert r.heartbeat("e", 0, 2, T0 + 18) == "superseded"
    assert r.heartbeat("x", 0, 1, T0) == "unknown"
    assert r.heartbeat("e", 5, 1, T0) == "unknown"
    res = r.lookup("e", T0 + 28.5)
    assert not res.complete and res.missing == (0,) and res.stale == (0,)
    assert r.heartbeat("e", 0, 1, T0 + 28.5) == "stale"  # does not revive it
    assert not r.lookup("e", T0 + 28.6).complete
    b, fresh = r.register(entry(rank=0, tp=1, inc=1), T0 + 29)  # comes back: same epoch
    assert not fresh and b.epoch == a.epoch and r.lookup("e", T0 + 29).complete


def test_sweep_reports_stale_once_then_forgets():
    r = reg(lease_s=1.0, forget_s=5.0)
    r.register(entry(rank=0, inc=1), T0)
    r.register(entry(rank=1, inc=2), T0 + 3)
    assert r.sweep(T0 + 0.5).went_stale == ()
    assert r.sweep(T0 + 2).went_stale == (("e", 0),)
    assert r.sweep(T0 + 2.5).went_stale == ()
    res = r.sweep(T0 + 5.5)
    assert res.forgotten == (("e", 0),) and res.went_stale == (("e", 1),)
    assert [row.tp_rank for row in r.rows(T0 + 5.5)] == [1]
    assert r.sweep(T0 + 9).forgotten == (("e", 1),)
    assert r.num_engines == 0 and r.num_ranks == 0 and not r.lookup("e", T0 + 9).known


def test_rows():
    r = reg(lease_s=1.0)
    r.register(entry(engine="b", rank=0, tp=1, inc=5), T0)
    r.register(entry(engine="a", rank=1, inc=6, role="decode"), T0 + 1)
    rows = r.rows(T0 + 1.5)
    assert [(x.engine_id, x.tp_rank, x.role, x.stale) for x in rows] == [
        ("a", 1, "decode", False), ("b", 0, "prefill", True)]
    assert rows[1].age_s == pytest.approx(1.5) and rows[1].incarnation == 5


# ---- deregistration -----------------------------------------------------------------------

def test_deregister_only_the_holding_incarnation():
    r = reg()
    r.register(entry(rank=0, inc=1), T0)
    assert not r.deregister("e", 0, 2) and not r.deregister("e", 1, 1)
    assert not r.deregister("x", 0, 1)
    assert r.deregister("e", 0, 1) and not r.deregister("e", 0, 1)
    assert r.num_ranks == 0 and not r.lookup("e", T0).known


# ---- epoch hints (server restarts) ----------------------------------------------------------

def test_epoch_hint_kept_by_a_fresh_registry_and_counter_jumps():
    old = reg(epoch_base=0)
    a, _ = old.register(entry(rank=0, inc=1), T0)
    new = reg(epoch_base=0)  # a restarted server that knows nothing
    b, fresh = new.register(entry(rank=0, inc=1), T0, epoch_hint=a.epoch + 500)
    assert fresh and b.epoch == a.epoch + 500
    c, _ = new.register(entry(rank=1, inc=2), T0)
    assert c.epoch == b.epoch + 1  # later epochs are larger than any hint seen


def test_epoch_hint_ignored_when_a_record_exists_or_a_newer_one_was_removed():
    r = reg()
    a, _ = r.register(entry(rank=0, inc=1), T0)
    b, _ = r.register(entry(rank=0, inc=2), T0, epoch_hint=a.epoch)  # other incarnation holds it
    assert b.epoch > a.epoch
    assert r.deregister("e", 0, 2)
    c, _ = r.register(entry(rank=0, inc=1), T0, epoch_hint=a.epoch)  # zombie of inc 1: no
    assert c.epoch > b.epoch
    assert r.deregister("e", 0, 1)
    d, _ = r.register(entry(rank=0, inc=1), T0, epoch_hint=c.epoch)  # its own last epoch: yes
    assert d.epoch == c.epoch


# ---- bounds ---------------------------------------------------------------------------------

def test_engine_table_full_then_stale_engine_evicted():
    r = reg(lease_s=1.0, limits=Limits(max_engines=2))
    r.register(entry(engine="a", tp=1), T0)
    r.register(entry(engine="b", tp=1), T0 + 0.5)
    with pytest.raises(Refused) as exc:
        r.register(entry(engine="c", tp=1), T0 + 0.9)
    assert exc.value.kind == "full" and "engine table full" in exc.value.text
    r.register(entry(engine="c", tp=1), T0 + 1.2)  # "a" is stale now: evicted
    assert not r.lookup("a", T0 + 1.2).known and r.lookup("b", T0 + 1.2).known
    assert r.num_engines == 2


def test_rank_table_full_then_stale_rank_evicted():
    r = reg(lease_s=1.0, limits=Limits(max_ranks=3))
    for rank in range(3):
        r.register(entry(rank=rank, tp=4, inc=rank + 1), T0 + rank * 0.1)
    with pytest.raises(Refused) as exc:
        r.register(entry(rank=3, tp=4, inc=9), T0 + 0.5)
    assert exc.value.kind == "full" and "rank table full" in exc.value.text
    # replacing an existing rank needs no room
    r.register(entry(rank=2, tp=4, inc=10), T0 + 0.5)
    r.heartbeat("e", 1, 2, T0 + 0.9)
    r.register(entry(rank=3, tp=4, inc=9), T0 + 1.05)  # rank 0 (oldest, stale) goes
    assert r.lookup("e", T0 + 1.05).missing == (0,)
    assert r.num_ranks == 3


def test_parameter_validation():
    with pytest.raises(ValueError, match="max_engines must be >= 1"):
        Limits(max_engines=0)
    with pytest.raises(ValueError, match="lease_s must be > 0"):
        Registry(lease_s=0)
    with pytest.raises(ValueError, match="forget_s must be >= lease_s"):
        Registry(lease_s=5, forget_s=1)
    with pytest.raises(ValueError, match="epoch_base out of range"):
        Registry(epoch_base=-1)


# ---- messages -------------------------------------------------------------------------------

def test_messages_round_trip_and_bounds():
    c = m.request_codec(b"secret")
    msg = m.Register(rid=7, rank=entry(), epoch_hint=3)
    assert c.decode(c.encode(msg)) == msg
    for bad in (entry(engine="x" * (m.MAX_ENGINE_ID + 1)),
                entry(backend_identity="i" * (m.MAX_IDENTITY + 1)),
                entry(layout={f"k{i}": i for i in range(m.MAX_MAP_ENTRIES + 1)}),
                entry(layout={"k": "v" * (m.MAX_VALUE + 1)}),
                entry(pools={"kv": -1}), entry(tp=0), entry(role="both")):
        payload = msgspec.msgpack.encode(m.Register(rid=1, rank=bad))
        with pytest.raises(WireError) as exc:
            c.decode([payload, sign(c.token, payload)])
        assert exc.value.kind == "malformed"
    r = m.reply_codec(None)
    err = m.Error(rid=3, kind="full", text="x")
    assert r.decode(r.encode(err)) == err


def test_peek_rid():
    assert m.peek_rid(msgspec.msgpack.encode(m.Lookup(rid=42, engine_id="e"))) == 42
    assert m.peek_rid(msgspec.msgpack.encode({"t": "Nope", "rid": 9})) == 9
    for junk in (b"", b"\xc1", msgspec.msgpack.encode([1, 2]), msgspec.msgpack.encode({"rid": "x"}),
                 msgspec.msgpack.encode({"rid": -5})):
        assert m.peek_rid(junk) == 0


# ---- random operation sequences against a model ---------------------------------------------

ENGINES = ("a", "b")
SHAPES = (("prefill", 2), ("decode", 2), ("prefill", 4), ("prefill", 1))


class RegistryModel(RuleBasedStateMachine):
    """Random register/heartbeat/deregister/sweep/tick sequences; a plain model says what every
    lookup and heartbeat must answer (newest registration, complete only when all live)."""

    LEASE, FORGET = 1.0, 3.0

    def __init__(self):
        super().__init__()
        self.r = Registry(lease_s=self.LEASE, forget_s=self.FORGET)
        self.now = T0
        self.model: dict[tuple[str, int], dict] = {}  # key -> entry, epoch, seen
        self.shape: dict[str, tuple[str, int]] = {}
        self.max_epoch = 0

    def live(self, rec) -> bool:
        return not self.now - rec["seen"] > self.LEASE

    def drop_engine(self, eid):
        for k in [k for k in self.model if k[0] == eid]:
            del self.model[k]
        self.shape.pop(eid, None)

    @rule(eid=st.sampled_from(ENGINES), shape=st.sampled_from(SHAPES),
          rank=st.integers(0, 3), inc=st.integers(1, 3))
    def register(self, eid, shape, rank, inc):
        role, tp = shape
        rank %= tp
        e = entry(engine=eid, rank=rank, tp=tp, role=role, inc=inc)
        old = self.model.get((eid, rank))
        try:
            rec, fresh = self.r.register(e, self.now)
        except Refused as exc:
            assert exc.kind == "conflict"
            if old is not None and old["entry"].incarnation == inc:
                assert old["entry"] != e
            else:
                assert self.shape[eid] != shape
                assert any(self.live(v) for k, v in self.model.items()
                           if k[0] == eid and k[1] != rank)
            return
        if old is not None and old["entry"].incarnation == inc:
            assert not fresh and rec.epoch == old["epoch"] and old["entry"] == e
            old["seen"] = self.now
            return
        assert fresh and rec.epoch > self.max_epoch
        self.max_epoch = rec.epoch
        if self.shape.get(eid, shape) != shape:
            self.drop_engine(eid)
        self.shape[eid] = shape
        self.model[(eid, rank)] = {"entry": e, "epoch": rec.epoch, "seen": self.now}

    @rule(eid=st.sampled_from(ENGINES), rank=st.integers(0, 3), inc=st.integers(1, 3))
    def heartbeat(self, eid, rank, inc):
        rec = self.model.get((eid, rank))
        want = ("unknown" if rec is None else "superseded" if rec["entry"].incarnation != inc
                else "ok" if self.live(rec) else "stale")
        assert self.r.heartbeat(eid, rank, inc, self.now) == want
        if want == "ok":
            rec["seen"] = self.now

    @rule(eid=st.sampled_from(ENGINES), rank=st.integers(0, 3), inc=st.integers(1, 3))
    def deregister(self, eid, rank, inc):
        rec = self.model.get((eid, rank))
        want = rec is not None and rec["entry"].incarnation == inc
        assert self.r.deregister(eid, rank, inc) == want
        if want:
            del self.model[(eid, rank)]
            if not any(k[0] == eid for k in self.model):
                self.shape.pop(eid)

    @rule(dt=st.sampled_from([0.0, 0.25, 0.6, 1.1, 2.5]))
    def tick(self, dt):
        self.now += dt

    @rule()
    def sweep(self):
        res = self.r.sweep(self.now)
        gone = {k for k, v in self.model.items() if self.now - v["seen"] > self.FORGET}
        assert set(res.forgotten) == gone
        for k in gone:
            del self.model[k]
        for eid in list(self.shape):
            if not any(k[0] == eid for k in self.model):
                del self.shape[eid]

    @invariant()
    def lookups_match_model(self):
        assert self.r.num_ranks == len(self.model)
        for eid in ENGINES:
            res = self.r.lookup(eid, self.now)
            if eid not in self.shape:
                assert not res.known and not res.complete
                continue
            role, tp = self.shape[eid]
            assert (res.role, res.tp_size) == (role, tp)
            live = {k[1]: v for k, v in self.model.items() if k[0] == eid and self.live(v)}
            assert [x.tp_rank for x in res.records] == sorted(live)
            for x in res.records:  # the newest registration of each rank
                assert (x.incarnation, x.epoch) == (live[x.tp_rank]["entry"].incarnation,
                                                    live[x.tp_rank]["epoch"])
            assert res.missing == tuple(r for r in range(tp) if r not in live)
            assert res.complete == (len(live) == tp)


TestRegistryModel = RegistryModel.TestCase
TestRegistryModel.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                      suppress_health_check=[HealthCheck.too_slow])


# ---- the server's request step (no socket) and client-side validation ------------------------

TOKEN = b"unit-token"


def test_server_handle_replies_and_refusals():
    from kvstage.bootstrap.server import BootstrapServer

    now = [T0]
    srv = BootstrapServer(token=TOKEN, clock=lambda: now[0], wall_clock=lambda: 5000.0)
    signed, plain = m.reply_codec(TOKEN), m.reply_codec(None)
    req = m.request_codec(TOKEN)

    rep = signed.decode(srv.handle(req.encode(m.Register(rid=9, rank=entry(tp=1)))))
    assert isinstance(rep, m.RegisterReply) and rep.rid == 9 and rep.record.epoch == 5_000_001
    rep = signed.decode(srv.handle(req.encode(m.Lookup(rid=10, engine_id="e"))))
    assert rep.known and not rep.missing and rep.records[0].registered_at == 5000.0

    def refused(frames, kind, rid, is_signed=True):
        out = srv.handle(frames)
        err = (signed if is_signed else plain).decode(out)
        assert isinstance(err, m.Error) and (err.kind, err.rid) == (kind, rid), err
        if not is_signed:  # not signed with the token: only the public integrity checksum
            assert out[1] == sign(None, out[0]) != sign(TOKEN, out[0])

    payload = msgspec.msgpack.encode(m.Status(rid=11))
    refused([payload, b""], "auth", 11, is_signed=False)
    refused([payload, sign(b"other", payload)], "auth", 11, is_signed=False)
    refused([payload, sign(TOKEN, payload), b"x"], "auth", 11, is_signed=False)
    refused([b"\xff\x00junk", b""], "auth", 0, is_signed=False)
    old = msgspec.msgpack.encode(m.Status(rid=12, v=99))
    refused([old, sign(TOKEN, old)], "version", 12)
    junk = msgspec.msgpack.encode({"t": "Register", "rid": 13, "rank": 5})
    refused([junk, sign(TOKEN, junk)], "malformed", 13)
    big = payload + b"\x00" * m.MAX_REQUEST
    refused([big, sign(TOKEN, big)], "oversized", 0)
    bad = req.encode(m.Register(rid=14, rank=entry(rank=3, tp=2)))
    refused(bad, "bad_request", 14)
    assert srv.counters["refused_auth"] == 4 and srv.counters["bad_version"] == 1

    open_srv = BootstrapServer()  # auth off: the MAC is an integrity checksum
    out = open_srv.handle([b"\xc1", b"whatever"])
    assert plain.decode(out).kind == "integrity" and out[1] == sign(None, out[0])
    out = open_srv.handle([b"\xc1", sign(None, b"\xc1")])
    assert plain.decode(out).kind == "malformed"


def test_rate_limited_log(caplog):
    import logging

    from kvstage.bootstrap.server import RateLimitedLog

    now = [0.0]
    logger = logging.getLogger("test.ratelimit")
    rl = RateLimitedLog(logger, burst=3, period_s=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="test.ratelimit"):
        for i in range(50):
            rl("auth", logging.WARNING, "refused %d", i)
        rl("other", logging.WARNING, "other kind")
        now[0] = 11.0
        rl("auth", logging.WARNING, "refused again")
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs == ["refused 0", "refused 1", "refused 2", "other kind",
                    "47 more 'auth' messages suppressed in the last 11s", "refused again"]


def test_rank_info_validation_and_addresses():
    from kvstage.bootstrap.client import RankInfo, RankRecord, parse_addr

    good = dict(engine_id="e", role="decode", tp_size=2, tp_rank=1, ctrl_endpoint="tcp://h:1",
                backend="mooncake", backend_identity="h:1", layout={"mla": True}, pools={},
                incarnation=3)
    info = RankInfo(**good)
    assert info._entry().tp_rank == 1 and info._entry().layout == {"mla": True}
    rec = RankRecord(**good, epoch=4, registered_at=1.0)
    assert rec.info == info and isinstance(rec, RankInfo)
    for field, value, err in [("role", "both", ValueError), ("tp_rank", 2, ValueError),
                              ("tp_size", 0, ValueError), ("tp_size", True, TypeError),
                              ("incarnation", -1, ValueError), ("engine_id", "", ValueError),
                              ("layout", [], TypeError)]:
        with pytest.raises(err, match=field):
            RankInfo(**{**good, field: value})
    with pytest.raises(ValueError, match="backend_identity"):
        RankInfo(**{**good, "backend_identity": "x" * (m.MAX_IDENTITY + 1)})._entry()
    with pytest.raises(ValueError, match="layout"):
        RankInfo(**{**good, "layout": {"k": [1]}})._entry()
    assert parse_addr("10.0.0.1:8998") == "tcp://10.0.0.1:8998"
    assert parse_addr("tcp://h:1") == "tcp://h:1" and parse_addr("[::1]:5") == "tcp://[::1]:5"
    for bad in ("h", "h:", ":5", "h:x", "h:70000"):
        with pytest.raises(ValueError, match="host:port"):
            parse_addr(bad)
