"""Random and malformed frames for any TCP socket: zmq multipart garbage and raw bytes."""

from __future__ import annotations

import os
import random
import socket

import msgspec
import zmq

from kvstage.wire import WIRE_VERSION, sign


def listening_ports(pid: int) -> list[tuple[str, int]]:
    """(address to connect to, port) of every TCP socket a process listens on (from /proc): the
    address it is bound to, 127.0.0.1 for a wildcard or loopback one. A listener bound to one
    interface (UCX binds its TCP transport to the host's address) refuses 127.0.0.1."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table in ("tcp", "tcp6"):
        for line in open(f"/proc/{pid}/net/{table}").read().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:
                addr, port = f[1].rsplit(":", 1)
                host = "127.0.0.1"
                if table == "tcp" and int(addr, 16) != 0:
                    host = socket.inet_ntoa(bytes.fromhex(addr)[::-1])    # /proc writes it little-endian
                found.add((host, int(port, 16)))
    return sorted(found)


MESSAGE_NAMES = ["Hello", "HelloAck", "RoomMeta", "MetaAck", "AllocRequest", "AllocGrant", "WatermarkUpdate",
                 "WriterDone", "RoomDone", "RoomFailed", "Quiesced", "Heartbeat", "Goodbye", "Register", "Lookup",
                 "Deregister", "Status"]


def random_frame(rng: random.Random) -> list[bytes]:
    """One malformed-or-plausible multipart frame: garbage, msgpack of the wrong shape,
    plausible messages with random fields (checksummed with the public integrity key, so they
    reach the decoder; a rank with a token must still refuse them)."""
    kind = rng.randrange(6)
    if kind == 0:
        return [rng.randbytes(rng.randrange(0, 300)) for _ in range(rng.randrange(0, 5))]
    if kind == 1:
        body = msgspec.msgpack.encode({rng.choice(["t", "v", "room", "src"]): rng.randrange(-5, 2**40)
                                       for _ in range(rng.randrange(0, 6))})
        return [body, sign(None, body)]
    if kind == 2:
        msg = {"t": rng.choice(MESSAGE_NAMES), "v": WIRE_VERSION, "src": rng.randrange(1, 2**63), "dst": rng.choice(
            [0, rng.randrange(1, 2**63)]), "room": rng.randrange(2**63), "session": rng.randrange(2**32),
               "seq": rng.randrange(100), "kind": "x", "reason": "fuzz", "chunk": 0, "epoch": 1, "pieces": []}
        body = msgspec.msgpack.encode(msg)
        return [body, sign(None, body)]
    if kind == 3:
        body = msgspec.msgpack.encode({"t": rng.choice(MESSAGE_NAMES), "v": rng.randrange(0, 5)})
        return [body, rng.randbytes(16)]
    if kind == 4:
        body = rng.randbytes(rng.randrange(1, 64))
        return [body, sign(None, body)]
    return [b"\x00" * rng.choice([1, 1000, 70_000])]


def fuzz_zmq(port: int, count: int, seed: int, host: str = "127.0.0.1") -> None:
    """`count` frames through a DEALER, to a port known to speak zmq (other listeners never get past
    zmq's greeting, which fuzz_raw's random bytes cover). A linger sends what is still queued when
    the loop ends instead of throwing it away."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IMMEDIATE, 1)  # the first send waits for the handshake
    sock.setsockopt(zmq.LINGER, 60_000)
    sock.setsockopt(zmq.SNDHWM, count + 10)
    sock.setsockopt(zmq.SNDTIMEO, 30_000)
    sock.connect(f"tcp://{host}:{port}")
    rng = random.Random(seed)
    try:
        for _ in range(count):
            sock.send_multipart(random_frame(rng) or [b""])
    except zmq.Again:
        raise AssertionError(f"port {port} stopped taking zmq frames for 30 s") from None
    finally:
        sock.close()
        ctx.term()


def fuzz_raw(port: int, count: int, seed: int, host: str = "127.0.0.1", connections: int = 20) -> int:
    """`count` random byte chunks over a few connections; returns how many were written (0: every
    connection was refused or closed at once, the listener got nothing)."""
    rng = random.Random(seed)
    sent = 0
    per = max(1, count // connections)
    for _ in range(connections):
        try:
            with socket.create_connection((host, port), timeout=2) as s:
                for _ in range(per):
                    s.sendall(rng.randbytes(rng.randrange(1, 512)))
                    sent += 1
        except OSError:
            continue  # the peer closed on us: that is a fine reaction to garbage
    return sent
