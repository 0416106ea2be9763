"""The bootstrap server as a real process (``python -m kvstage.bootstrap --port 0``) and its client."""

from __future__ import annotations

import os
import random
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from kvstage.bootstrap import (
    BootstrapAuthError,
    BootstrapClient,
    BootstrapError,
    BootstrapTimeout,
    RankInfo,
    RankRecord,
)
from kvstage.bootstrap import messages as m
from kvstage.bootstrap.client import new_incarnation
from kvstage.support.cluster import free_port
from kvstage.wire import TOKEN_ENV, sign

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
TOKEN = b"s3cret-token"


class Server:
    """One ``python -m kvstage.bootstrap`` process; the port comes from its first stdout line."""

    def __init__(self, tmp: Path, *args: str, port: int = 0, token: bytes | None = None,
                 start_timeout: float = 15.0):
        env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        if token is not None:
            env[TOKEN_ENV] = token.decode()
        self.log_path = tmp / f"bootstrap-{time.monotonic_ns()}.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvstage.bootstrap", *args, "--port", str(port)], cwd=REPO, env=env,
            stdout=subprocess.PIPE, stderr=self._log, text=True)
        try:
            self.port = self._read_port(start_timeout)
        except BaseException:
            self.kill()
            raise
        self.addr = f"127.0.0.1:{self.port}"

    def _read_port(self, timeout: float) -> int:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        prefix = "kvstage-bootstrap listening on tcp://"
        if not line.startswith(prefix):
            raise RuntimeError(f"server did not start (first line {line!r}); log:\n{self.log()}")
        return int(line.strip().rsplit(":", 1)[1])

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        if self.alive():
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()


@pytest.fixture
def start(tmp_path):
    """start(*args, **kw) -> Server; every server is stopped at teardown and must exit 0."""
    servers: list[Server] = []

    def _start(*args, **kw) -> Server:
        s = Server(tmp_path, *args, **kw)
        servers.append(s)
        return s

    yield _start
    codes = {}
    for s in servers:
        was_running = s.alive()
        rc = s.stop()
        if was_running:
            codes[s.port] = rc
    assert all(rc == 0 for rc in codes.values()), codes


@pytest.fixture
def server(start):
    return start()


def info(engine="e", rank=0, tp=1, role="prefill", inc=None, **kw) -> RankInfo:
    fields = dict(engine_id=engine, role=role, tp_size=tp, tp_rank=rank,
                  ctrl_endpoint=f"tcp://10.0.0.{rank + 1}:5555", backend="nixl",
                  backend_identity=f"agent-{engine}-{rank}",
                  layout={"num_layers": 32, "head_dim": 128, "dtype": "bfloat16", "mla": False,
                          "scale": 0.5},
                  pools={"kv": 1 << 30, "ring": 64 << 20},
                  incarnation=new_incarnation() if inc is None else inc)
    fields.update(kw)
    return RankInfo(**fields)


def run_cli(*args, timeout=30, token: bytes | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    env["PYTHONPATH"] = str(REPO)
    if token is not None:
        env[TOKEN_ENV] = token.decode()
    return subprocess.run([sys.executable, "-m", "kvstage.bootstrap", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


# ---- basic behaviour ------------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_register_lookup_deregister_roundtrip(server):
    with BootstrapClient(server.addr) as c:
        i0, i1 = info(rank=0, tp=2), info(rank=1, tp=2)
        r0 = c.register(i0)
        assert isinstance(r0, RankRecord) and r0.info == i0 and r0.epoch > 0
        assert abs(r0.registered_at - time.time()) < 60
        assert c.register(i0) == r0  # idempotent
        r1 = c.register(i1)
        recs = c.lookup("e", timeout_s=5)
        assert recs == [r0, r1]
        assert recs[0].layout["mla"] is False and recs[0].pools["kv"] == 1 << 30
        assert c.heartbeat("e", 0, i0.incarnation)
        assert not c.heartbeat("e", 0, i0.incarnation + 1)
        assert not c.heartbeat("nope", 0, 1)
        # a new incarnation of rank 1: newer, larger epoch, and lookups return it
        i1b = info(rank=1, tp=2)
        r1b = c.register(i1b)
        assert r1b.epoch > r1.epoch
        assert [r.incarnation for r in c.lookup("e", 5)] == [i0.incarnation, i1b.incarnation]
        c.deregister("e", 1, i1.incarnation)  # the old incarnation cannot remove the new one
        assert len(c.lookup("e", 5)) == 2
        c.deregister("e", 1, i1b.incarnation)
        with pytest.raises(BootstrapTimeout, match=r"missing ranks \[1\]"):
            c.lookup("e", timeout_s=0.3)
        st = c.status()
        assert [(r["engine_id"], r["tp_rank"]) for r in st["ranks"]] == [("e", 0)]
        assert st["lease_s"] == 10.0 and st["auth"] is False


@pytest.mark.timeout(60)
def test_server_refusals_are_bootstrap_errors(start):
    srv = start("--max-engines", "1", "--max-ranks-per-engine", "4")
    with BootstrapClient(srv.addr) as c:
        c.register(info(engine="a", rank=0, tp=2))
        with pytest.raises(BootstrapError, match="engine table full") as exc:
            c.register(info(engine="b"))
        assert exc.value.kind == "full" and not isinstance(exc.value, BootstrapTimeout)
        with pytest.raises(BootstrapError, match="tp_size 8 exceeds") as exc:
            c.register(info(engine="a", rank=0, tp=8))
        assert exc.value.kind == "full"
        with pytest.raises(BootstrapError, match="live ranks") as exc:
            c.register(info(engine="a", rank=1, tp=4))
        assert exc.value.kind == "conflict"
        with pytest.raises(ValueError, match="backend_identity"):
            c.register(info(engine="a", rank=1, tp=2, backend_identity="x" * 10000))


@pytest.mark.timeout(120)
def test_64_clients_register_and_look_up_at_once(server):
    engines, tp = 8, 8
    barrier = threading.Barrier(engines * tp)
    results: dict[tuple[int, int], list] = {}
    errors: list[BaseException] = []
    infos = {(e, r): info(engine=f"eng{e}", rank=r, tp=tp, role="prefill" if e % 2 else "decode")
             for e in range(engines) for r in range(tp)}

    def rank(e: int, r: int) -> None:
        try:
            with BootstrapClient(server.addr, request_timeout_s=5.0) as c:
                barrier.wait(timeout=30)
                c.register(infos[(e, r)])
                mine = c.lookup(f"eng{e}", timeout_s=30)
                peer = c.lookup(f"eng{(e + 1) % engines}", timeout_s=30)
                results[(e, r)] = [mine, peer]
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=k) for k in infos]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not any(t.is_alive() for t in threads), "a client hung"
    assert not errors, errors[:3]
    for (e, r), (mine, peer) in results.items():
        for eng, recs in ((e, mine), ((e + 1) % engines, peer)):
            assert [x.tp_rank for x in recs] == list(range(tp))
            assert [x.info for x in recs] == [infos[(eng, k)] for k in range(tp)]
    with BootstrapClient(server.addr) as c:
        st = c.status()
    assert len(st["ranks"]) == engines * tp and not any(x["stale"] for x in st["ranks"])
    assert len({x["epoch"] for x in st["ranks"]}) == engines * tp


@pytest.mark.timeout(60)
def test_one_client_shared_by_threads(server):
    with BootstrapClient(server.addr) as c:
        infos = [info(engine="shared", rank=r, tp=8) for r in range(8)]
        errors = []

        def work(i: RankInfo):
            try:
                c.register(i)
                for _ in range(20):
                    assert c.heartbeat(i.engine_id, i.tp_rank, i.incarnation)
                assert len(c.lookup("shared", timeout_s=20)) == 8
                c.status()
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i,)) for i in infos]
        for t in threads:
            t.start()
        for t in threads:
            t.join(40)
        assert not any(t.is_alive() for t in threads) and not errors, errors[:3]


# ---- lookups: waiting and deadlines --------------------------------------------------------

@pytest.mark.timeout(60)
def test_lookup_waits_for_a_late_rank(server):
    with BootstrapClient(server.addr) as c, BootstrapClient(server.addr) as late:
        infos = [info(rank=r, tp=4) for r in range(4)]
        for i in infos[:3]:
            c.register(i)
        timer = threading.Timer(1.0, late.register, args=(infos[3],))
        t0 = time.monotonic()
        timer.start()
        try:
            recs = c.lookup("e", timeout_s=10)
        finally:
            timer.join()
        assert 0.9 <= time.monotonic() - t0 < 5
        assert [r.info for r in recs] == infos


@pytest.mark.timeout(60)
def test_lookup_times_out_with_a_clear_error(server):
    with BootstrapClient(server.addr) as c:
        c.register(info(rank=0, tp=4))
        c.register(info(rank=2, tp=4))
        t0 = time.monotonic()
        with pytest.raises(BootstrapTimeout) as exc:
            c.lookup("e", timeout_s=1.0)
        assert 1.0 <= time.monotonic() - t0 < 6
        assert "has ranks [0, 2], missing ranks [1, 3]" in str(exc.value)
        assert isinstance(exc.value, TimeoutError) and isinstance(exc.value, BootstrapError)
        with pytest.raises(BootstrapTimeout, match="'ghost' is unknown"):
            c.lookup("ghost", timeout_s=0.5)


@pytest.mark.timeout(60)
def test_requests_to_a_dead_address_time_out():
    with BootstrapClient(f"127.0.0.1:{free_port()}", request_timeout_s=0.3) as c:
        t0 = time.monotonic()
        with pytest.raises(BootstrapTimeout, match="did not answer Register"):
            c.register(info())
        with pytest.raises(BootstrapTimeout, match="did not answer"):
            c.lookup("e", timeout_s=0.8)
        c.start_keepalive(info(), interval_s=0.1)
        time.sleep(0.5)
    assert time.monotonic() - t0 < 8  # close() did not hang on the keepalive thread


# ---- staleness and keepalive ----------------------------------------------------------------

@pytest.mark.timeout(60)
def test_stale_ranks_leave_lookups_and_come_back(start):
    srv = start("--lease-s", "1")
    with BootstrapClient(srv.addr) as c:
        quiet, kept = info(rank=0, tp=2), info(rank=1, tp=2)
        first = c.register(quiet)
        c.register(kept)
        c.start_keepalive(kept, interval_s=0.1)
        deadline = time.monotonic() + 10   # the lease is 1 s; the server sweeps on its own clock
        while not (rows := {r["tp_rank"]: r for r in c.status()["ranks"]})[0]["stale"]:
            assert time.monotonic() < deadline, rows
            time.sleep(0.05)
        with pytest.raises(BootstrapTimeout, match=r"missing ranks \[0\] \(stale"):
            c.lookup("e", timeout_s=0.3)
        assert not c.heartbeat("e", 0, quiet.incarnation)
        rows = {r["tp_rank"]: r for r in c.status()["ranks"]}
        assert rows[0]["stale"] and not rows[1]["stale"]
        again = c.register(quiet)  # comes back: same incarnation keeps its epoch
        assert again.epoch == first.epoch
        assert [r.tp_rank for r in c.lookup("e", timeout_s=2)] == [0, 1]
        c.start_keepalive(quiet, interval_s=0.1)
        time.sleep(1.0)
        assert len(c.lookup("e", timeout_s=2)) == 2
    assert "stale" in srv.log()


@pytest.mark.timeout(120)
def test_server_restart_on_same_port(start):
    srv = start("--lease-s", "2")
    infos = [info(engine="pre", rank=r, tp=4) for r in range(4)]
    clients = [BootstrapClient(srv.addr, request_timeout_s=0.5) for _ in infos]
    try:
        before = [c.register(i) for c, i in zip(clients, infos)]
        for c, i in zip(clients, infos):
            c.start_keepalive(i, interval_s=0.2)
        assert clients[0].lookup("pre", timeout_s=5) == before
        srv.proc.kill()
        assert srv.proc.wait(10) == -signal.SIGKILL
        time.sleep(0.5)  # keepalives fail meanwhile; nothing may hang
        for attempt in range(20):
            try:
                srv2 = start("--lease-s", "2", port=srv.port)
                break
            except RuntimeError:
                if attempt == 19:
                    raise
                time.sleep(0.25)
        def same(recs):
            return [(r.info, r.epoch) for r in recs]

        with BootstrapClient(srv2.addr) as fresh:
            after = fresh.lookup("pre", timeout_s=15)
            # the same incarnations came back with their epochs (epoch hints)
            assert same(after) == same(before)
            newer = fresh.register(info(engine="other"))
            assert newer.epoch > max(r.epoch for r in before)  # epochs grow across restarts
        assert all(same(c.lookup("pre", timeout_s=5)) == same(before) for c in clients)
    finally:
        t0 = time.monotonic()
        for c in clients:
            c.close()
        assert time.monotonic() - t0 < 10


# ---- auth -----------------------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_auth_token_required(start, tmp_path):
    srv = start(token=TOKEN)
    with BootstrapClient(srv.addr, token=TOKEN) as good:
        good.register(info())
        assert len(good.lookup("e", timeout_s=2)) == 1
        assert good.status()["auth"] is True
    for token in (None, b"wrong-token"):
        with BootstrapClient(srv.addr, token=token, request_timeout_s=5) as bad:
            for call in (lambda: bad.register(info(engine="evil")),
                         lambda: bad.lookup("e", timeout_s=5), bad.status,
                         lambda: bad.heartbeat("e", 0, 1)):
                t0 = time.monotonic()
                with pytest.raises(BootstrapAuthError, match="refused"):
                    call()
                assert time.monotonic() - t0 < 4  # a clear refusal, not the 5 s timeout
    with BootstrapClient(srv.addr, token=TOKEN) as good:
        assert [r["engine_id"] for r in good.status()["ranks"]] == ["e"]
    assert "refused a request without a valid token" in srv.log()
    assert TOKEN.decode() not in srv.log()

    token_file = tmp_path / "token"
    token_file.write_text(TOKEN.decode() + "\n")
    ok = run_cli("status", "--addr", srv.addr, "--token-file", str(token_file))
    assert ok.returncode == 0, ok.stderr
    refused = run_cli("status", "--addr", srv.addr, token=b"nope")
    assert refused.returncode == 4 and "refused" in refused.stderr


@pytest.mark.timeout(60)
def test_token_file_server_and_client_expecting_auth(start, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("file-token\n")
    srv = start("--token-file", str(token_file))
    with BootstrapClient(srv.addr, token=b"file-token") as c:
        c.register(info())
    with BootstrapClient(srv.addr, request_timeout_s=2) as c, pytest.raises(BootstrapAuthError):
        c.register(info())
    open_srv = start()  # no token: a client that expects auth fails closed
    with BootstrapClient(open_srv.addr, token=TOKEN) as c:
        with pytest.raises(BootstrapAuthError, match="without our auth token"):
            c.status()


# ---- hostile input --------------------------------------------------------------------------

def _fuzz_frames(rng: random.Random, n: int):
    """(frames, expect_reply_to_rid or None) for n hostile or valid requests."""
    enc = msgspec.msgpack.Encoder()
    valid = [m.Lookup(rid=1, engine_id="e"), m.Status(rid=1),
             m.Heartbeat(rid=1, engine_id="e", tp_rank=0, incarnation=5),
             m.Register(rid=1, rank=info(engine="fz", rank=0, tp=2, inc=11)._entry()),
             m.Deregister(rid=1, engine_id="zz", tp_rank=0, incarnation=1)]

    def junk(depth=0):
        kind = rng.randrange(8 if depth < 3 else 5)
        return [lambda: rng.randrange(-2**63, 2**64), lambda: rng.random(),
                lambda: rng.randbytes(rng.randrange(20)).hex(), lambda: None,
                lambda: rng.randbytes(rng.randrange(10)),
                lambda: [junk(depth + 1) for _ in range(rng.randrange(4))],
                lambda: {rng.choice(["t", "v", "rid", "rank", "engine_id", "x"]): junk(depth + 1)
                         for _ in range(rng.randrange(5))},
                lambda: {"t": rng.choice(["Register", "Lookup", "Status", "Error", "Heartbeat",
                                          "RegisterReply", "Nope"]), "v": 1,
                         "rid": rng.randrange(1, 1000), "engine_id": junk(depth + 1),
                         "rank": junk(depth + 1)}][kind]()

    for i in range(n):
        rid = 1_000_000 + i
        msg = msgspec.structs.replace(rng.choice(valid), rid=rid)
        payload = enc.encode(msg)
        kind = rng.randrange(10)
        if kind == 0:
            parts = [rng.randbytes(rng.randrange(300))]
        elif kind == 1:
            parts = [rng.randbytes(rng.randrange(50)) for _ in range(rng.randrange(1, 7))]
        elif kind == 2:
            p = enc.encode(junk())
            parts = [p, sign(TOKEN, p) if rng.random() < 0.7 else b""]
        elif kind == 3:
            p = payload[:rng.randrange(len(payload))]
            parts = [p, sign(TOKEN, p) if rng.random() < 0.7 else rng.randbytes(16)]
        elif kind == 4:
            p = enc.encode(msgspec.structs.replace(msg, v=rng.choice([0, 2, 99, -1])))
            parts = [p, sign(TOKEN, p)]
        elif kind == 5:
            p = payload + b"\x00" * rng.randrange(m.MAX_REQUEST, 3 * m.MAX_REQUEST)
            parts = [p, sign(TOKEN, p) if rng.random() < 0.5 else b""]
        elif kind == 6:
            parts = [payload, rng.choice([b"", rng.randbytes(16), sign(b"other", payload)])]
        elif kind == 7:
            parts = [payload, sign(TOKEN, payload), rng.randbytes(5)]
        else:
            yield [payload, sign(TOKEN, payload)], rid  # a valid request: must be answered
            continue
        yield parts, None


@pytest.mark.timeout(180)
def test_hostile_frames_do_not_hurt_the_server(start):
    srv = start(token=TOKEN)
    with BootstrapClient(srv.addr, token=TOKEN) as c:
        c.register(info(engine="e", rank=0, tp=1, inc=5))
    ctx = zmq.Context()
    plain = m.reply_codec(None)
    signed = m.reply_codec(TOKEN)
    socks = [ctx.socket(zmq.DEALER) for _ in range(4)]
    expected: set[int] = set()
    answered: set[int] = set()
    kinds: dict[str, int] = {}

    def drain(wait_s: float) -> None:
        end = time.monotonic() + wait_s
        poller = zmq.Poller()
        for s in socks:
            poller.register(s, zmq.POLLIN)
        while True:
            events = poller.poll(max(0, int((end - time.monotonic()) * 1000)))
            if not events:
                return
            for s, _ in events:
                while True:
                    try:
                        frames = s.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        r = signed.decode(frames)
                    except Exception:  # unsigned: must be the auth refusal
                        r = plain.decode(frames)
                        assert isinstance(r, m.Error) and r.kind == "auth", r
                    if isinstance(r, m.Error):
                        assert r.kind in m.ERROR_KINDS
                        kinds[r.kind] = kinds.get(r.kind, 0) + 1
                    if r.rid in expected:
                        assert not isinstance(r, m.Error) or r.kind not in ("auth", "malformed")
                        answered.add(r.rid)

    try:
        for s in socks:
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.RCVHWM, 100000)
            s.connect(f"tcp://{srv.addr}")
        rng = random.Random(1234)
        sent = 0
        for i, (parts, rid) in enumerate(_fuzz_frames(rng, 10_000)):
            if rid is not None:
                expected.add(rid)
            socks[i % len(socks)].send_multipart(parts)
            sent += 1
            if i % 250 == 249:
                drain(0.0)
        for k, s in enumerate(socks):   # last on each socket: once answered, the server took every frame
            expected.add(rid := 2**40 + k)
            p = msgspec.msgpack.encode(m.Status(rid=rid))
            s.send_multipart([p, sign(TOKEN, p)])
        drain(2.0)
        deadline = time.monotonic() + 20
        while expected - answered and time.monotonic() < deadline:
            drain(0.5)
        assert sent == 10_000
        assert expected and expected <= answered, f"{len(expected - answered)} valid requests lost"
        assert {"auth", "malformed", "version", "oversized"} <= set(kinds), kinds

        # frames above the transport limit: zmq drops the connection, the server carries on
        big = ctx.socket(zmq.DEALER)
        big.setsockopt(zmq.LINGER, 0)
        big.connect(f"tcp://{srv.addr}")
        for _ in range(3):
            big.send_multipart([b"\x80" * (2 << 20), b""])
        big.close(0)
        # raw TCP garbage, and a REQ socket (an extra empty delimiter part: refused)
        for _ in range(5):
            with socket.create_connection(("127.0.0.1", srv.port), timeout=2) as raw:
                raw.sendall(random.Random(7).randbytes(4096))
        with BootstrapClient(srv.addr, token=TOKEN) as c:
            refused = c.status()["counters"].get("refused_auth", 0)
            req = ctx.socket(zmq.REQ)
            req.setsockopt(zmq.LINGER, 0)
            req.connect(f"tcp://{srv.addr}")
            p = msgspec.msgpack.encode(m.Status(rid=3))
            req.send_multipart([p, sign(TOKEN, p)])
            deadline = time.monotonic() + 10
            while c.status()["counters"].get("refused_auth", 0) == refused:
                assert time.monotonic() < deadline, "the REQ socket's request never reached the server"
                time.sleep(0.05)
            # refused (three parts cannot carry a valid token), once
            assert c.status()["counters"].get("refused_auth", 0) == refused + 1
            req.close(0)
    finally:
        for s in socks:
            s.close(0)
        ctx.term()

    assert srv.alive()
    with BootstrapClient(srv.addr, token=TOKEN) as c:
        c.register(info(engine="after", rank=0, tp=1))
        assert len(c.lookup("after", timeout_s=5)) == 1
        assert len(c.lookup("e", timeout_s=5)) == 1
        st = c.status()
    assert st["counters"]["requests"] >= 10_000
    assert st["counters"].get("internal", 0) == 0
    log = srv.log()
    assert "Traceback" not in log
    assert len(log.splitlines()) < 500, "bad-request logging is not rate-limited"
    print(f"fuzz: {len(answered)} valid requests answered, error replies by kind {kinds}")


# ---- process lifecycle and CLI --------------------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_cleanly(start, sig):
    srv = start()
    with BootstrapClient(srv.addr) as c:
        c.register(info())
    t0 = time.monotonic()
    assert srv.stop(sig) == 0
    assert time.monotonic() - t0 < 5
    assert "stopped" in srv.log() and "Traceback" not in srv.log()
    again = start(port=srv.port)  # the port was released
    assert again.port == srv.port


@pytest.mark.timeout(60)
def test_status_command(server):
    with BootstrapClient(server.addr) as c:
        c.register(info(engine="prefill-0", rank=0, tp=2))
        c.register(info(engine="prefill-0", rank=1, tp=2))
        c.register(info(engine="decode-0", rank=0, tp=1, role="decode", backend="mooncake"))
    out = run_cli("status", "--addr", server.addr)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "3 ranks" in lines[0] and "2 engines" in lines[0]
    assert lines[1].split() == ["ENGINE", "ROLE", "TP", "RANK", "EPOCH", "ENDPOINT", "BACKEND",
                                "AGE", "STATE"]
    rows = [ln.split() for ln in lines[2:]]
    assert [(r[0], r[1], r[2], r[3], r[5], r[6], r[8]) for r in rows] == [
        ("decode-0", "decode", "1", "0", "tcp://10.0.0.1:5555", "mooncake", "live"),
        ("prefill-0", "prefill", "2", "0", "tcp://10.0.0.1:5555", "nixl", "live"),
        ("prefill-0", "prefill", "2", "1", "tcp://10.0.0.2:5555", "nixl", "live")]
    js = run_cli("status", "--addr", server.addr, "--json")
    assert js.returncode == 0 and len(msgspec.json.decode(js.stdout)["ranks"]) == 3

    dead = run_cli("status", "--addr", f"127.0.0.1:{free_port()}", "--timeout", "0.5")
    assert dead.returncode == 3 and "unreachable" in dead.stderr
    bad = run_cli("status", "--addr", "no-port-here")
    assert bad.returncode == 2 and "host:port" in bad.stderr


@pytest.mark.timeout(60)
def test_serve_subcommand_and_bind_failure(start):
    srv = start("serve", "--host", "127.0.0.1", "--lease-s", "3")
    with BootstrapClient(srv.addr) as c:
        assert c.status()["lease_s"] == 3.0
    clash = run_cli("--port", str(srv.port))
    assert clash.returncode == 1 and "cannot bind" in clash.stderr
