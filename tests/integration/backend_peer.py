"""A backend endpoint in its own process, driven by tests/integration/test_backends.py.

Protocol: one JSON command per line on stdin; one JSON reply per command on stdout, on a line
starting with "@@ " (the libraries may print their own lines). Bytes travel as base64. The
process exits with code 0 after the "close" or "exit" command or at end of input.

Memory: one numpy buffer of `size` bytes, registered at "init". Offsets in commands are relative
to the start of a buffer: the writer's own for sources, the peer's (`peer_addr`) for destinations.
The writer's source bytes for a write batch are pattern(seed); the target checks that the
destination ranges hold exactly those bytes, and nothing else changed, right when the tag shows up.
"""

from __future__ import annotations

import base64
import json
import os
import sys
import time
import traceback

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from kvstage.transfer.backends import BackendError, MemRegion, WriteState, create_backend  # noqa: E402

FILL = 0xA5


def pattern(seed: int, size: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def unb64(text: str) -> bytes:
    return base64.b64decode(text)


def reply(**fields) -> None:
    sys.stdout.write("@@ " + json.dumps(fields) + "\n")
    sys.stdout.flush()


class Peer:
    def __init__(self) -> None:
        self.backend = None
        self.buf: np.ndarray | None = None
        self.reg = None

    # -- set-up
    def init(self, kind: str, size: int, options: dict | None = None) -> dict:
        self.backend = create_backend(kind, f"test-{kind}", "127.0.0.1", **(options or {}))
        self.buf = np.full(size, FILL, dtype=np.uint8)  # touched: pre-faulted
        self.reg = self.backend.register([MemRegion(addr=self.buf.ctypes.data, length=size)])
        return {
            "name": self.backend.name,
            "identity": b64(self.backend.identity()),
            "addr": int(self.buf.ctypes.data),
            "size": size,
        }

    def connect(self, identity: str) -> dict:
        return {"peer": self.backend.connect(unb64(identity))}

    def register_extra(self, size: int) -> dict:
        """Register a second buffer; return its address and the identity that includes it."""
        self.extra = np.zeros(size, dtype=np.uint8)
        self.extra_reg = self.backend.register([MemRegion(addr=self.extra.ctypes.data, length=size)])
        return {"addr": int(self.extra.ctypes.data), "identity": b64(self.backend.identity())}

    def deregister_extra(self) -> dict:
        self.backend.deregister(self.extra_reg)
        return {"identity": b64(self.backend.identity())}

    # -- target side
    def expect(self, seed: int, writes: list[dict], timeout: float) -> dict:
        """Arm for `writes`, then check each one's bytes the moment its tag arrives."""
        assert self.buf is not None
        self.buf[:] = FILL
        src_bytes = pattern(seed, self.buf.size)
        wanted = {unb64(w["tag"]): w for w in writes}
        written = np.zeros(self.buf.size, dtype=bool)
        reply(armed=True)
        errors: list[str] = []
        seen: list[str] = []
        deadline = time.monotonic() + timeout
        while len(seen) < len(wanted) and time.monotonic() < deadline:
            for arrived in self.backend.drain_tags():
                w = wanted.get(arrived.tag)
                if w is None:
                    errors.append(f"unexpected tag {arrived.tag!r} from {arrived.peer}")
                    continue
                if b64(arrived.tag) in seen:
                    errors.append(f"tag {arrived.tag!r} arrived twice")
                    continue
                seen.append(b64(arrived.tag))
                if w.get("sender") and arrived.peer != w["sender"]:
                    errors.append(f"tag from {arrived.peer!r}, expected {w['sender']!r}")
                # The check runs right now, before anything else: the tag must follow the bytes.
                bad = 0
                for (so, n), (do, n2) in zip(w["src"], w["dst"]):
                    if not np.array_equal(self.buf[do : do + n], src_bytes[so : so + n]):
                        bad += 1
                    written[do : do + n] = True
                if bad:
                    errors.append(f"tag {arrived.tag!r}: {bad} of {len(w['src'])} ranges not in place")
            time.sleep(0.0002)
        untouched = self.buf[~written]
        if len(seen) == len(wanted) and (untouched != FILL).any():
            errors.append(f"{int((untouched != FILL).sum())} bytes outside the written ranges changed")
        if len(seen) < len(wanted):
            errors.append(f"only {len(seen)} of {len(wanted)} tags arrived within {timeout}s")
        return {"ok": not errors, "seen": len(seen), "errors": errors}

    def serve(self, seconds: float) -> dict:
        """Keep driving progress (and collect tags) for a while."""
        tags = []
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            tags += [b64(t.tag) for t in self.backend.drain_tags()]
            time.sleep(0.001)
        return {"tags": tags}

    # -- writer side
    def write(self, peer: str, peer_addr: int, seed: int, writes: list[dict], timeout: float, **kw) -> dict:
        """Post every write of the batch at once, then poll them all to an end (or the timeout).

        A write may name its own "peer"/"peer_addr". With churn=True the owning thread keeps
        calling into the library while the writes are in flight (drain_tags, and registering and
        deregistering a scratch buffer) right after each post and on every poll round: for
        Mooncake that runs concurrently with the submit threads inside the same engine.
        "churned" counts those rounds; "churn_overlapped" those after which a write posted
        before the round was still pending (the churn provably ran while it was in flight).
        """
        assert self.buf is not None
        if seed is not None:
            self.buf[:] = pattern(seed, self.buf.size)
        base = int(self.buf.ctypes.data)
        handles = []
        results: list[dict] = []
        churn = np.zeros(1 << 16, dtype=np.uint8) if kw.get("churn") else None
        churned = overlapped = 0
        t0 = time.monotonic()

        def poll_all() -> bool:
            """Poll every posted write not yet ended; True while any is pending."""
            pending = False
            for h, r in zip(handles, results):
                if h is None or "state" in r:
                    continue
                state = self.backend.poll_write(h)
                if state is WriteState.PENDING:
                    pending = True
                else:
                    r.update(state=state.value, reason=h.reason, elapsed=time.monotonic() - t0)
            return pending

        def churn_round() -> None:
            nonlocal churned, overlapped
            self.backend.drain_tags()
            with self.backend.registered([MemRegion(addr=churn.ctypes.data, length=churn.nbytes)]):
                pass
            churned += 1
            overlapped += poll_all()

        for w in writes:
            to, to_addr = w.get("peer", peer), w.get("peer_addr", peer_addr)
            src = np.array([(base + o, n, 0) for o, n in w["src"]], dtype=np.uint64)
            dst = np.array([(to_addr + o, n, 0) for o, n in w["dst"]], dtype=np.uint64)
            try:
                handles.append(self.backend.post_write(to, src, dst, unb64(w["tag"])))
                results.append({})
            except BackendError as exc:
                handles.append(None)
                results.append({"state": "post_error", "reason": str(exc), "elapsed": time.monotonic() - t0})
            if churn is not None:
                churn_round()
        deadline = t0 + timeout
        while time.monotonic() < deadline:
            if not poll_all():
                break
            self.backend.progress()
            if churn is not None:
                churn_round()
            time.sleep(0.0002)
        for h, r in zip(handles, results):
            if h is None:
                continue
            if "state" not in r:
                r.update(state="pending", reason=None, elapsed=time.monotonic() - t0)
            if kw.get("release", True):
                self.backend.release_write(h)
                r["after_release"] = h.state.value
        return {"results": results, "churned": churned, "churn_overlapped": overlapped}

    # -- scoped registration, checked with the backend's own view
    def scoped(self) -> dict:
        """Register a scratch region in `registered(...)`, raise inside, then check it is gone.

        Checks: the Registration is inactive, the backend's bookkeeping forgot it, a write from
        it is refused, and the library itself no longer knows it: NIXL refuses a loopback
        transfer from it (nixlNotFoundError); Mooncake rejects a loopback write into it (-1).
        """
        be = self.backend
        scratch = np.zeros(1 << 16, dtype=np.uint8)
        region = MemRegion(addr=scratch.ctypes.data, length=scratch.nbytes)
        checks: dict[str, object] = {}
        before = self._library_knows(scratch)
        checks["library_knows_inside"] = before
        held = None
        try:
            with be.registered([region]) as reg:
                held = reg
                checks["active_inside"] = reg.active
                checks["library_knows_inside"] = self._library_knows(scratch)
                raise RuntimeError("boom")
        except RuntimeError as exc:
            checks["raised"] = str(exc)
        checks["library_knew_before"] = before
        checks["active_after"] = held.active
        checks["bookkeeping_after"] = any(r is held for r in be._regs.values())
        checks["library_knows_after"] = self._library_knows(scratch)
        be.deregister(held)  # idempotent: a second call does nothing
        checks["second_deregister_ok"] = True
        return checks

    def _library_knows(self, scratch: np.ndarray) -> bool:
        be = self.backend
        if be.kind == "nixl":
            agent = be._agent
            rows = np.array([[scratch.ctypes.data, 4096, 0]], dtype=np.uint64)
            dst = np.array([[self.buf.ctypes.data, 4096, 0]], dtype=np.uint64)
            try:
                xfer = agent.initialize_xfer(
                    "WRITE", agent.get_xfer_descs(rows, "DRAM"), agent.get_xfer_descs(dst, "DRAM"), be.name, b""
                )
            except Exception:
                return False
            agent.release_xfer_handle(xfer)
            return True
        # Mooncake: loopback write from our registered buffer into the scratch region.
        from mooncake.engine import TransferOpcode

        ret = be._engine.batch_transfer_sync(
            be.name, [int(self.buf.ctypes.data)], [int(scratch.ctypes.data)], [4096], TransferOpcode.Write
        )
        return ret == 0

    def close(self) -> dict:
        if self.backend is not None:
            self.backend.close()
            self.backend.close()  # idempotent
        return {"closed": True}


def main() -> int:
    peer = Peer()
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        cmd = json.loads(line)
        op = cmd.pop("op")
        if op == "exit":  # leave without close(): the interpreter-exit path must be clean too
            reply(exiting=True)
            return 0
        try:
            out = getattr(peer, op)(**cmd)
        except Exception as exc:  # reported to the test, which fails on it
            out = {"exception": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        reply(**out)
        if op == "close":
            return 0
    peer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
