"""Both real backends (NIXL/UCX and Mooncake tcp) between real processes.

Each endpoint is tests/integration/backend_peer.py in its own process, driven over stdin/stdout
with JSON lines (bytes as base64; no pickling). Every child must exit with code 0.
"""

from __future__ import annotations

import base64
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

pytestmark = pytest.mark.integration

HERE = os.path.dirname(os.path.abspath(__file__))
PEER_SCRIPT = os.path.join(HERE, "backend_peer.py")
KINDS = ["nixl", "mooncake"]
SIZE = 16 << 20


# Both backends are pinned requirements: a missing one is an error here, never a skip.
KIND_PARAMS = KINDS


class Child:
    """One backend_peer.py process; replies are read by a thread so every wait has a deadline."""

    def __init__(self, label: str):
        self.label = label
        env = dict(os.environ)
        env.setdefault("MC_LOG_LEVEL", "ERROR")  # keep the test log short; errors still show
        self.proc = subprocess.Popen(
            [sys.executable, PEER_SCRIPT],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None,  # inherited: library logs land in pytest's captured stderr
            text=True,
            env=env,
        )
        self._replies: queue.Queue[dict | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("@@ "):
                self._replies.put(json.loads(line[3:]))
        self._replies.put(None)

    def send(self, **cmd) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def recv(self, timeout: float = 30.0) -> dict:
        try:
            msg = self._replies.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"{self.label}: no reply within {timeout}s") from None
        if msg is None:
            raise AssertionError(f"{self.label}: exited early with code {self.proc.wait(5)}")
        assert "exception" not in msg, f"{self.label}: {msg['exception']}\n{msg.get('traceback', '')}"
        return msg

    def call(self, _wait: float = 30.0, **cmd) -> dict:
        """Send a command and return its reply (waiting at most `_wait` seconds)."""
        self.send(**cmd)
        return self.recv(_wait)

    def finish(self, op: str = "close", timeout: float = 30.0) -> int:
        """Ask the child to end (close(), or plain exit relying on interpreter exit) and reap it."""
        self.call(op=op, _wait=timeout)
        self.proc.stdin.close()
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def start_pair(kind: str, created: list, writer_options: dict | None = None) -> tuple[Child, dict, Child, dict]:
    """A writer and a target, started side by side (imports overlap); both land in `created`."""
    writer, target = Child(f"{kind}-writer"), Child(f"{kind}-target")
    created += [writer, target]
    writer.send(op="init", kind=kind, size=SIZE, options=writer_options or {})
    target.send(op="init", kind=kind, size=SIZE, options={})
    return writer, writer.recv(120), target, target.recv(120)


def kill_all(children: list) -> None:
    for c in children:
        c.kill()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def make_plan(rng: np.random.Generator, n: int, dst_base: int, dst_room: int) -> tuple[list, list]:
    """n ranges of varying sizes, non-contiguous on both sides, in a shuffled order on the target."""
    lengths = rng.integers(1, 1500, n)
    gaps = rng.integers(1, 64, n)
    src_off = np.cumsum(gaps + lengths) - lengths
    order = rng.permutation(n)
    dst_gaps = rng.integers(1, 48, n)
    dst_slot = np.cumsum(dst_gaps[order] + lengths[order]) - lengths[order]
    dst_off = np.empty(n, dtype=np.int64)
    dst_off[order] = dst_slot + dst_base
    assert src_off[-1] + lengths[-1] < SIZE and dst_slot[-1] + lengths[order[-1]] < dst_room
    src = [[int(o), int(n_)] for o, n_ in zip(src_off, lengths)]
    dst = [[int(o), int(n_)] for o, n_ in zip(dst_off, lengths)]
    return src, dst


def run_round(writer: Child, target: Child, peer: str, peer_addr: int, seed: int, writes: list[dict],
              sender: str, timeout: float = 20.0) -> tuple[dict, dict]:
    """Arm the target for `writes`, post them all from the writer, return both sides' reports."""
    for w in writes:
        w["sender"] = sender
    target.send(op="expect", seed=seed, writes=writes, timeout=timeout)
    assert target.recv(10)["armed"]
    wres = writer.call(op="write", peer=peer, peer_addr=peer_addr, seed=seed, writes=writes, timeout=timeout)
    tres = target.recv(timeout + 10)
    return wres, tres


@pytest.fixture(scope="module", params=KIND_PARAMS)
def pair(request):
    """A connected writer and target of one backend kind, shared by the tests of that kind.

    Mooncake's writer runs two submit threads per peer here (writes to one peer overlap inside
    the engine); the killed-target test uses the default of one.
    """
    kind = request.param
    created: list = []
    try:
        options = {"submit_threads_per_peer": 2} if kind == "mooncake" else {}
        writer, winfo, target, tinfo = start_pair(kind, created, options)
        peer = writer.call(op="connect", identity=tinfo["identity"])["peer"]
        assert peer == tinfo["name"]
        yield kind, writer, target, winfo, tinfo
        assert writer.finish() == 0, "writer exit code"
        assert target.finish() == 0, "target exit code"
    finally:
        kill_all(created)


def test_many_ranges_tag_after_bytes(pair):
    """3000 ranges per write, several writes; bytes checked exactly the moment each tag arrives."""
    kind, writer, target, winfo, tinfo = pair
    rng = np.random.default_rng(1234)
    room = SIZE // 4
    rounds = [1, 3, 1, 2]  # writes per round; a round's writes are in flight together
    for r, count in enumerate(rounds):
        writes = []
        for i in range(count):
            src, dst = make_plan(rng, 3000, dst_base=i * room, dst_room=room)
            writes.append({"tag": b64(f"round{r}-write{i}".encode() + bytes([r, i, 0, 255])), "src": src, "dst": dst})
        wres, tres = run_round(writer, target, tinfo["name"], tinfo["addr"], seed=100 + r, writes=writes,
                               sender=winfo["name"])
        for res in wres["results"]:
            assert res["state"] == "done", res
        assert tres["ok"], tres["errors"]
        assert tres["seen"] == count


def test_binary_tags_round_trip(pair):
    """Arbitrary tags (all 256 byte values, NUL, invalid UTF-8, up to 200 bytes) arrive exactly."""
    kind, writer, target, winfo, tinfo = pair
    tags = [
        bytes(range(0, 200)),
        bytes(range(200, 256)) + bytes(range(0, 100)),
        b"\x00",
        b"\xff\xfe\x00\x80kvstage1:not-base64\xc3\x28",
        bytes(range(255, 55, -1)),
    ]
    writes = [{"tag": b64(t), "src": [[i * 64, 64]], "dst": [[i * 4096, 64]]} for i, t in enumerate(tags)]
    wres, tres = run_round(writer, target, tinfo["name"], tinfo["addr"], seed=7, writes=writes,
                           sender=winfo["name"])
    assert all(r["state"] == "done" for r in wres["results"]), wres
    assert tres["ok"], tres["errors"]
    assert tres["seen"] == len(tags)


def test_bad_requests_raise_clear_errors(pair):
    """Outside the peer's registered memory, src/dst length mismatch, unregistered source,
    empty tag, unknown peer: BackendError at post, with a message saying which."""
    kind, writer, target, winfo, tinfo = pair
    peer, addr = tinfo["name"], tinfo["addr"]
    cases = {
        "outside": ({"tag": b64(b"bad-range"), "src": [[0, 4096]], "dst": [[SIZE - 100, 4096]]},
                    "not inside memory the peer registered"),
        "far_outside": ({"tag": b64(b"bad-range2"), "src": [[0, 64]], "dst": [[SIZE + (1 << 30), 64]]},
                        "not inside memory the peer registered"),
        "length_mismatch": ({"tag": b64(b"mm"), "src": [[0, 4096], [8192, 10]], "dst": [[0, 4096], [8192, 11]]},
                            "length mismatch at row 1"),
        "source_unregistered": ({"tag": b64(b"src"), "src": [[SIZE + 4096, 64]], "dst": [[0, 64]]},
                                "source row 0"),
        "source_partly_unregistered": ({"tag": b64(b"src2"), "src": [[0, 64], [SIZE + 4096, 64]],
                                        "dst": [[0, 64], [64, 64]]}, "source row 1"),
        "empty_tag": ({"tag": "", "src": [[0, 64]], "dst": [[0, 64]]}, "tag must not be empty"),
    }
    for name, (w, words) in cases.items():
        res = writer.call(op="write", peer=peer, peer_addr=addr, seed=None, writes=[w], timeout=5)["results"][0]
        assert res["state"] == "post_error", (name, res)
        assert words in res["reason"], (name, res["reason"])
    res = writer.call(op="write", peer="nobody:1", peer_addr=addr, seed=None,
                      writes=[{"tag": b64(b"x"), "src": [[0, 8]], "dst": [[0, 8]]}], timeout=5)["results"][0]
    assert res["state"] == "post_error" and "unknown peer" in res["reason"], res

    if kind == "mooncake":
        # A bare "host:port" identity has no ranges to check locally: Mooncake's target refuses
        # the write itself (FAILED, -1) and delivers no tag. (NIXL metadata always has them.)
        assert writer.call(op="connect", identity=b64(peer.encode()))["peer"] == peer
        try:
            w = cases["outside"][0]
            res = writer.call(op="write", peer=peer, peer_addr=addr, seed=None, writes=[w], timeout=10)["results"][0]
            assert res["state"] == "failed" and "returned -1" in res["reason"], res
            assert target.call(op="serve", seconds=0.3)["tags"] == [], "a refused write delivered its tag"
        finally:
            writer.call(op="connect", identity=tinfo["identity"])

    # The pair still works after the refused requests.
    wres, tres = run_round(writer, target, peer, addr, seed=9,
                           writes=[{"tag": b64(b"after-errors"), "src": [[0, 1000]], "dst": [[5000, 1000]]}],
                           sender=winfo["name"])
    assert wres["results"][0]["state"] == "done" and tres["ok"], (wres, tres)


def test_scoped_registration_leaves_nothing(pair):
    """An exception inside `with backend.registered(...)` deregisters: the Registration, the
    backend's bookkeeping and the library itself (its own loopback check) all agree."""
    kind, writer, target, winfo, tinfo = pair
    for child in (writer, target):
        checks = child.call(op="scoped", _wait=30)
        assert checks["raised"] == "boom"
        assert checks["library_knew_before"] is False, checks
        assert checks["active_inside"] is True and checks["library_knows_inside"] is True, checks
        assert checks["active_after"] is False, checks
        assert checks["bookkeeping_after"] is False, checks
        assert checks["library_knows_after"] is False, checks
        assert checks["second_deregister_ok"] is True


def test_reconnect_forgets_deregistered_peer_memory(pair):
    """The target deregisters a region and republishes its identity: after connect() with the
    new identity, writes into that region are refused before posting (NIXL alone would keep it:
    loading metadata again only adds registrations)."""
    kind, writer, target, winfo, tinfo = pair
    extra = target.call(op="register_extra", size=1 << 16)
    peer = writer.call(op="connect", identity=extra["identity"])["peer"]
    w = {"tag": b64(b"into-extra"), "src": [[0, 4096]], "dst": [[0, 4096]]}
    target.send(op="serve", seconds=1.0)
    res = writer.call(op="write", peer=peer, peer_addr=extra["addr"], seed=5, writes=[w], timeout=5)["results"][0]
    assert res["state"] == "done", res
    assert target.recv(10)["tags"] == [b64(b"into-extra")]

    ident = target.call(op="deregister_extra")["identity"]
    assert writer.call(op="connect", identity=ident)["peer"] == peer
    res = writer.call(op="write", peer=peer, peer_addr=extra["addr"], seed=None, writes=[w], timeout=5)["results"][0]
    assert res["state"] == "post_error" and "not inside memory the peer registered" in res["reason"], res


def test_two_targets_concurrent_writes_with_owner_churn(pair):
    """One writer, two targets, 8 writes in flight across both, while the writer's owning thread
    keeps registering/deregistering and draining (Mooncake: concurrently with 2 submit threads
    per peer inside the same engine): every byte exact, every tag once."""
    kind, writer, t1, winfo, t1info = pair
    created: list = []
    try:
        t2 = Child(f"{kind}-target2")
        created.append(t2)
        t2info = t2.call(op="init", kind=kind, size=SIZE, options={}, _wait=120)
        p1 = t1info["name"]
        p2 = writer.call(op="connect", identity=t2info["identity"])["peer"]
        rng = np.random.default_rng(99)
        room = SIZE // 4
        per_target: dict = {p1: [], p2: []}
        writes = []
        for i in range(8):
            to, info = (p1, t1info) if i % 2 == 0 else (p2, t2info)
            src, dst = make_plan(rng, 1000, dst_base=(i // 2) * room, dst_room=room)
            w = {"tag": b64(f"multi-{i}".encode()), "src": src, "dst": dst, "peer": to, "peer_addr": info["addr"],
                 "sender": winfo["name"]}
            writes.append(w)
            per_target[to].append(w)
        for t, p in ((t1, p1), (t2, p2)):
            t.send(op="expect", seed=42, writes=per_target[p], timeout=20)
            assert t.recv(10)["armed"]
        wres = writer.call(op="write", peer=p1, peer_addr=t1info["addr"], seed=42, writes=writes, timeout=20,
                           churn=True)
        assert all(r["state"] == "done" for r in wres["results"]), wres
        # one churn round after every post and on every poll round, and some of them while a write
        # posted before was still in flight (else the test would not exercise the concurrency)
        assert wres["churned"] >= len(writes) and wres["churn_overlapped"] > 0, wres
        for t in (t1, t2):
            tres = t.recv(30)
            assert tres["ok"] and tres["seen"] == 4, tres
        assert t2.finish() == 0
    finally:
        kill_all(created)


@pytest.mark.parametrize("kind", KIND_PARAMS)
def test_killed_target_fails_next_write_fast(kind):
    """SIGKILL the target: the writer's next write fails (FAILED or BackendError) within 2 s, and
    the writer still exits with code 0 (through interpreter exit, without an explicit close)."""
    created: list = []
    try:
        writer, winfo, target, tinfo = start_pair(kind, created)
        peer = writer.call(op="connect", identity=tinfo["identity"])["peer"]
        w = {"tag": b64(b"warm-up"), "src": [[0, 1 << 20]], "dst": [[0, 1 << 20]]}
        wres, tres = run_round(writer, target, peer, tinfo["addr"], seed=3, writes=[w], sender=winfo["name"])
        assert wres["results"][0]["state"] == "done" and tres["ok"], (wres, tres)

        target.proc.send_signal(signal.SIGKILL)
        target.proc.wait(10)
        t0 = time.monotonic()
        w = {"tag": b64(b"after-kill"), "src": [[0, 1 << 20]], "dst": [[0, 1 << 20]]}
        res = writer.call(op="write", peer=peer, peer_addr=tinfo["addr"], seed=None, writes=[w], timeout=2.0,
                          )["results"][0]
        elapsed = time.monotonic() - t0
        assert res["state"] in ("failed", "post_error"), res
        assert res["reason"], res
        assert res["elapsed"] < 2.0 and elapsed < 10.0, (res, elapsed)
        assert writer.finish(op="exit") == 0, "writer exit code after its peer died"
    finally:
        kill_all(created)
