"""A rank killed (SIGKILL) and restarted on the same host and ports, for real.

The survivor still holds the old incarnation's control socket, its backend connection (NIXL
remote agent, Mooncake segment and submit thread) and its rooms when the new process binds the
same control port (`EngineConfig.ctrl_port`) and, with Mooncake, the same RPC port (the segment
name `host:port` the survivor dials). What users are promised: the surviving process does not
crash and exits 0, the old incarnation's requests fail there with a reason, the new
incarnation's requests arrive bit-exact, and nothing hangs.
"""

import json
import os
import socket
import time

import numpy as np
import pytest
from live_stats import wait_for_stat
from test_failures import (
    LEASE,
    assert_clean_exit,
    assert_failed_fast,
    assert_verified,
    rooms,
    rooms_of,
    spec,
    stats_of,
    wait_file,
)

from kvstage.bootstrap import open_rendezvous
from kvstage.bootstrap.client import BootstrapTimeout
from kvstage.support.cluster import Cluster, free_port

pytestmark = pytest.mark.integration

# Mooncake draws its RPC port (the segment name) and then its TCP data port at random in
# [MC_MIN_RPC_PORT, MC_MAX_RPC_PORT]: with two ports both incarnations hold the same pair, and a
# restart draws the old RPC port one time in two (a prefill rank's ports are free again as soon
# as it dies: no peer holds connections to them)
MOONCAKE_RANGE = 2
RESTARTS = 16


def mooncake_env(backend: str) -> dict:
    if backend != "mooncake":
        return {}
    for _ in range(200):
        low = 15000 + int.from_bytes(os.urandom(2), "little") % 1990
        if all(_free(p) for p in range(low, low + MOONCAKE_RANGE)):
            return {"MC_MIN_RPC_PORT": str(low), "MC_MAX_RPC_PORT": str(low + MOONCAKE_RANGE - 1)}
    raise RuntimeError("no two free ports in Mooncake's RPC range")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def registered(addr: str, engine: str, proc, skip: set[int], timeout: float = 30) -> tuple[str, int]:
    """The backend name (a Mooncake identity's "name"; NIXL's agent name) and incarnation the
    rendezvous holds for rank 0 of `engine`, once it is none of `skip`; `proc` must stay alive."""
    client = open_rendezvous(addr)
    try:
        deadline = time.monotonic() + timeout
        while True:
            assert proc.proc.poll() is None, f"{proc.log_path} exited {proc.proc.returncode}:\n{proc.log()}"
            assert time.monotonic() < deadline, f"{engine} never registered a new incarnation"
            try:
                (rec,) = client.lookup(engine, timeout_s=0.5)
            except BootstrapTimeout:
                continue
            if rec.incarnation not in skip:
                ident = rec.backend_identity
                return (json.loads(ident)["name"] if ident.startswith("{") else ident), rec.incarnation
            time.sleep(0.05)
    finally:
        client.close()


def restart_on(cl: Cluster, managers: list, name: str, env: dict, engine: str, old: tuple[str, int], backend: str):
    """Start the rank again (same control port: the spec says it) until it also has the old
    backend name where that can be the same (Mooncake: `host:rpc_port`, the port drawn from
    MOONCAKE_RANGE; NIXL's agent names are unique per process by design). A start that drew
    another name is killed before it served anything. Returns the process."""
    skip = {old[1]}
    for _ in range(RESTARTS):
        proc = cl.launch(managers, name, env=env)
        got, inc = registered(cl.addr, engine, proc, skip)
        if backend != "mooncake" or got == old[0]:
            return proc
        proc.kill()
        skip.add(inc)
    raise AssertionError(f"{engine}: no restart drew the backend name {old[0]} in {RESTARTS} starts")


def gated(room_list: list, go: str) -> list:
    return [{**r, "start_after_file": go} for r in room_list]


# One backend and path per role keeps the file inside its CI time. A Mooncake decode rank on its
# old RPC port takes a minute to arrange (the survivor's connections hold the port): the writer's
# side of it is the two-engine test at the end of this file; with whole processes, run by hand
# (docs/operations.md, "A peer restarted on the same address").
@pytest.mark.timeout(150)
@pytest.mark.parametrize(("backend", "staging"), [("nixl", True)], ids=["nixl-staged"])
def test_decode_rank_restarted_on_the_same_address(backend, staging, tmp_path):
    started, release, go = (str(tmp_path / n) for n in ("started", "release", "go"))
    ctrl = free_port()
    env = mooncake_env(backend)
    with Cluster() as cl:
        early, late = rooms(100, 4, True), gated(rooms(200, 4, False), go)
        for r in early:
            r["hold_last_until"] = [release]
        prefill = cl.launch([spec("prefill", 0, 1, early + late, backend, staging)], "p0")
        live = tmp_path / "victim-live.json"
        victim = cl.launch([spec("decode", 0, 1, early, backend, staging, ctrl_port=ctrl, started_file=started,
                                 live_stats=str(live))], "d-victim", env=env)
        wait_file(started)
        wait_for_stat(live, "bytes_received")
        old = registered(cl.addr, "dc", victim, set())
        killed_at = time.time()
        victim.kill()
        restarted = restart_on(cl, [spec("decode", 0, 1, late, backend, staging, ctrl_port=ctrl)], "d-restarted",
                               env, "dc", old, backend)
        open(release, "w").close()
        open(go, "w").close()
        for p in (prefill, restarted):
            p.proc.wait(120)
        assert_clean_exit([prefill, restarted])
        assert_failed_fast(rooms_of(prefill), [r["room"] for r in early], killed_at, LEASE + 5)
        assert_verified(restarted, [r["room"] for r in late])
        (st,) = stats_of(prefill)
        assert st["staged_pieces_waiting"] == 0 and st["rooms_active"] == 0


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("backend", "staging"), [("mooncake", False)], ids=["mooncake-direct"])
def test_prefill_rank_restarted_on_the_same_address(backend, staging, tmp_path):
    started, release, go = (str(tmp_path / n) for n in ("started", "release", "go"))
    ctrl = free_port()
    with Cluster() as cl:
        early, late = rooms(100, 4, True), gated(rooms(200, 4, False), go)
        for r in early:
            r["hold_last_until"] = [release]
        live = tmp_path / "decode-live.json"
        decode = cl.launch([spec("decode", 0, 1, early + late, backend, staging, live_stats=str(live))], "d0")
        registered(cl.addr, "dc", decode, set())   # its backend is up: it drew its own Mooncake ports
        env = mooncake_env(backend)                  # the victim's two are drawn among the others
        victim = cl.launch([spec("prefill", 0, 1, early, backend, staging, ctrl_port=ctrl, started_file=started)],
                           "p-victim", env=env)
        wait_file(started)
        wait_for_stat(live, "bytes_received")
        old = registered(cl.addr, "pf", victim, set())
        killed_at = time.time()
        victim.kill()
        restarted = restart_on(cl, [spec("prefill", 0, 1, late, backend, staging, ctrl_port=ctrl)], "p-restarted",
                               env, "pf", old, backend)
        open(release, "w").close()
        # a restarted prefill rank dials no one: the decode rank finds the old one dead by its
        # lease, and only then looks the engine up again (docs/operations.md). A request made
        # before that goes to the old incarnation and fails with "silent for N s" (a CI failure
        # when the restart took less than the lease)
        wait_for_stat(live, "peers_lost")
        open(go, "w").close()
        for p in (decode, restarted):
            p.proc.wait(120)
        assert_clean_exit([decode, restarted])
        recs = assert_verified(decode, [r["room"] for r in late])
        assert_failed_fast(recs, [r["room"] for r in early], killed_at, LEASE + 5)
        (st,) = stats_of(decode)
        assert st["rooms_active"] == 0
        if staging:
            assert st["ring_live_regions"] == 0 and st["ring_live_bytes"] == 0


def test_a_new_mooncake_engine_on_an_address_written_to_is_reached_under_another_spelling():
    """Mooncake caches the segment descriptor of every segment name it wrote to, for the engine's
    life: a rank restarted on the same host and RPC port would get writes aimed at its
    predecessor's data port, all failing (seen with whole engines: docs/operations.md). The
    writer reaches a new engine at such a name under another spelling of its IPv4 address, and
    the old engine coming back under the old one; a host with no other spelling is refused.
    (Restarting a rank on a port the survivor's connections still hold takes Mooncake about a
    minute: the later engine's identity is made here from the real one, another instance.)"""
    from kvstage.transfer.backends.base import BackendError, MemRegion, WriteState
    from kvstage.transfer.backends.mooncake_backend import MooncakeBackend, respell

    def write(writer, name, src, dst) -> None:
        dst[:] = 0
        rows = np.array([[src.ctypes.data, src.nbytes, 0]], np.uint64)
        handle = writer.post_write(name, rows, np.array([[dst.ctypes.data, dst.nbytes, 0]], np.uint64), b"t")
        deadline = time.monotonic() + 30
        while writer.poll_write(handle) is WriteState.PENDING:
            assert time.monotonic() < deadline, "the write never ended"
            time.sleep(0.01)
        assert handle.state is WriteState.DONE and (dst == src).all(), handle.reason
        writer.release_write(handle)

    def as_engine(identity: bytes, **changes) -> bytes:
        return json.dumps({**json.loads(identity), **changes}).encode()

    writer, target = MooncakeBackend("writer"), MooncakeBackend("target")
    try:
        src, dst = np.arange(4096, dtype=np.uint32).view(np.uint8)[:4096].copy(), np.zeros(4096, np.uint8)
        writer.register([MemRegion(addr=src.ctypes.data, length=src.nbytes)])
        target.register([MemRegion(addr=dst.ctypes.data, length=dst.nbytes)])
        identity = target.identity()
        name = writer.connect(identity)
        write(writer, name, src, dst)
        writer.disconnect(name)                                      # the peer was lost

        assert writer.connect(as_engine(identity, instance="1" * 16)) == name   # a new engine there
        assert writer._route[name] == respell(name, 1) != name
        write(writer, name, src, dst)                                # lands, under the other spelling
        writer.disconnect(name)
        assert writer.connect(as_engine(identity, instance="2" * 16)) == name   # and the one after it
        assert writer._route[name] == respell(name, 2)
        writer.disconnect(name)
        assert writer.connect(identity) == name and writer._route[name] == name  # the first one came back
        write(writer, name, src, dst)
        writer.disconnect(name)

        by_host = "localhost:" + name.rpartition(":")[2]             # a host name: no other spelling
        write(writer, writer.connect(as_engine(identity, name=by_host)), src, dst)
        writer.disconnect(by_host)
        with pytest.raises(BackendError, match="new engine .* restarted on the same host and RPC port"):
            writer.connect(as_engine(identity, name=by_host, instance="1" * 16))
    finally:
        writer.close()
        target.close()


@pytest.mark.parametrize(("name", "generation", "spelled"), [
    ("127.0.0.1:5", 0, "127.0.0.1:5"), ("127.0.0.1:5", 1, "0177.00.00.01:5"),
    ("10.0.0.255:16001", 2, "0012.000.000.00377:16001"), ("host:5", 1, None), ("::1:5", 1, None),
    ("1.2.3:5", 1, None)])
def test_respell(name, generation, spelled):
    from kvstage.transfer.backends.mooncake_backend import respell
    assert respell(name, generation) == spelled
