"""When does a NIXL write complete? The writer posts a write (one layer of a 1K-token request:
128 ranges of 32 KiB by default) to a target process that polls its agent (`get_new_notifs`)
every `--target-poll-ms`, and times the post and the time from the post's return to DONE.

    .venv/bin/python examples/probe_nixl_completion.py --target-poll-ms 0.1,5,50

On one host (UCX cma) the copy happens inside the post, but the write is DONE only once the
target has progressed its worker: the writer's own polling does not complete it. This is why
the engine announces a write to the decode rank before posting it (docs/backends.md).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

import numpy as np

KIB = 1 << 10


def target(poll_s: float, nbytes: int, to_writer, stop, expected) -> None:
    """The decode side: register a buffer, publish it, poll the agent until stopped, then until
    the `expected` tags are in (NIXL has nothing to block on: polling is its API), 10 s at most."""
    from kvstage.transfer.backends import MemRegion, create_backend

    backend = create_backend("nixl", name="probe-target")
    buf = np.zeros(nbytes, dtype=np.uint8)
    backend.register([MemRegion(addr=buf.ctypes.data, length=buf.nbytes)])
    to_writer.put((backend.identity(), buf.ctypes.data))
    tags = 0
    while not stop.wait(poll_s):
        tags += len(backend.drain_tags())
    deadline = time.monotonic() + 10
    while tags < expected.value and time.monotonic() < deadline:
        tags += len(backend.drain_tags())
        time.sleep(0.001)
    to_writer.put(tags)
    backend.close()


def probe(poll_s: float, ranges: int, range_bytes: int, writes: int) -> dict:
    from kvstage.transfer.backends import MemRegion, WriteState, create_backend

    ctx = mp.get_context("spawn")
    to_writer, stop, expected = ctx.Queue(), ctx.Event(), ctx.Value("i", writes + 3)
    nbytes = ranges * range_bytes
    proc = ctx.Process(target=target, args=(poll_s, nbytes, to_writer, stop, expected), daemon=True)
    proc.start()
    backend = create_backend("nixl", name="probe-writer")
    try:
        identity, dst_addr = to_writer.get(timeout=60)
        src = np.ones(nbytes, dtype=np.uint8)
        backend.register([MemRegion(addr=src.ctypes.data, length=src.nbytes)])
        peer = backend.connect(identity)
        offsets = np.arange(ranges, dtype=np.uint64) * np.uint64(range_bytes)

        def rows(base: int) -> np.ndarray:
            return np.stack([np.uint64(base) + offsets, np.full(ranges, range_bytes, np.uint64),
                             np.zeros(ranges, np.uint64)], axis=1)

        post_ms, done_ms, polls = [], [], []
        for i in range(expected.value):   # the first three warm the connection up
            t0 = time.perf_counter()
            handle = backend.post_write(peer, rows(src.ctypes.data), rows(dst_addr), b"probe-%d" % i)
            t1 = time.perf_counter()
            n, give_up = 0, t1 + 10
            while backend.poll_write(handle) is WriteState.PENDING:   # the writer's polling, as fast as it goes
                n += 1
                if time.perf_counter() > give_up:
                    raise SystemExit(f"write {i} still pending after 10 s")
            t2 = time.perf_counter()
            if handle.state is not WriteState.DONE:
                raise SystemExit(f"write {i} failed: {handle.reason}")
            backend.release_write(handle)
            if i >= 3:
                post_ms.append((t1 - t0) * 1e3)
                done_ms.append((t2 - t1) * 1e3)
                polls.append(n)
            time.sleep(0.005)
        stop.set()
        tags = to_writer.get(timeout=60)
    finally:
        stop.set()
        backend.close()
        proc.join(30)
    return {"post_ms": statistics.median(post_ms), "done_ms": statistics.median(done_ms),
            "polls": statistics.median(polls), "done_at_post": sum(p == 0 for p in polls), "writes": writes,
            "tags": tags}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target-poll-ms", default="0.1,5,50", help="the target's polling intervals, comma-separated")
    p.add_argument("--ranges", type=int, default=128)
    p.add_argument("--range-kib", type=int, default=32)
    p.add_argument("--writes", type=int, default=30)
    a = p.parse_args()
    print(f"NIXL write of {a.ranges} x {a.range_kib} KiB, {a.writes} writes per setting; medians")
    print(" target polls every | post ms | post return -> DONE ms | writer polls | DONE at the post | tags in")
    for ms in (float(x) for x in a.target_poll_ms.split(",")):
        r = probe(ms / 1e3, a.ranges, a.range_kib * KIB, a.writes)
        print(f" {ms:14.1f} ms | {r['post_ms']:7.3f} | {r['done_ms']:22.3f} | {r['polls']:12.0f} |"
              f" {r['done_at_post']:9d} of {r['writes']:<3d} | {r['tags']}")


if __name__ == "__main__":
    main()
