"""The staging copies of one P4 -> D2 writer, in this process: the KV gather + scatter of its part
of a request against the gather + scatter of its pool block, per byte, quiet and while a thread
polls like the control thread does. Part of examples/bench_pools.py (printed first).

Why the poller: every torch op releases the GIL, and while the control thread polls the backend
getting it back can take up to the interpreter's switch interval. The pool copies were once ~9
ops per tensor (index_select, a dtype view, a contiguous copy, ...): "one op per tensor" below
is that way of copying, kept as the reference; kvstage's is one op per request
(staging/pool_copies.py). Run alone:

    .venv/bin/python examples/bench_pool_copies.py
"""

from __future__ import annotations

import select
import statistics
import threading
import time

import numpy as np
import torch

from kvstage import StatePool
from kvstage.staging.gather_scatter import Gatherer, Scatterer
from kvstage.staging.pool_copies import LandedBlock, PoolBytes, gather_pools, scatter_pools
from kvstage.transfer.protocol.pool_parts import PoolCopy, PoolSegment


class Poller:
    """A thread that waits 20 us in select() and runs a little Python, forever: the control
    thread's eager loop while writes are in flight."""

    def __init__(self):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            select.select([], [], [], 20e-6)
            sum(range(200))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def per_tensor_ops(pools: dict, copies, out: torch.Tensor, dst_pools: dict) -> None:
    """The reference: a handful of torch ops per tensor (how the pool copies were first written)."""
    pos = 0
    for c in copies:
        t = pools[c.segment.pool].tensors[c.segment.tensor]
        rows = t.index_select(0, torch.as_tensor(c.src_items, dtype=torch.int64))
        rows = rows[:, c.segment.src_heads[0]:c.segment.src_heads[1]]
        data = rows.contiguous().view(-1).view(torch.uint8)
        out[pos:pos + c.nbytes].copy_(data)
        d = dst_pools[c.segment.pool].tensors[c.segment.tensor]
        idx = torch.as_tensor(c.dst_items, dtype=torch.int64)
        h = c.segment.dst_heads
        d[idx, h[0] : h[1]] = (
            out[pos : pos + c.nbytes].clone().view(d.dtype).view((idx.numel(), h[1] - h[0]) + tuple(d.shape[2:]))
        )
        pos += c.nbytes


def measure(
    layers: int = 8,
    heads: int = 2,
    head_dim: int = 128,
    page_size: int = 16,
    tokens: int = 2048,
    state: tuple[int, int] = (64, 128),
    items: int = 8,
    repeats: int = 15,
) -> dict:
    """Median seconds per copy kind, alone and beside a Poller, for one writer's request."""
    pages = tokens // page_size
    shape = (pages * page_size, heads, head_dim)
    k = [torch.randn(shape).to(torch.bfloat16) for _ in range(layers)]
    v = [torch.randn(shape).to(torch.bfloat16) for _ in range(layers)]
    dk = [torch.zeros_like(t) for t in k]
    dv = [torch.zeros_like(t) for t in v]
    src = {"ssm": StatePool(tensors=[torch.randn(items, heads, *state) for _ in range(layers)], sharding="heads")}
    dst = {"ssm": StatePool(tensors=[torch.zeros(items, heads, *state) for _ in range(layers)], sharding="heads")}
    item_bytes = heads * state[0] * state[1] * 4
    copies = [
        PoolCopy(
            PoolSegment("ssm", i, (0, heads), (0, heads), item_bytes),
            np.array([3]),
            np.array([5]),
            i * item_bytes,
            item_bytes,
        )
        for i in range(layers)
    ]
    kv_bytes = 2 * layers * tokens * heads * head_dim * 2
    pool_bytes = layers * item_bytes
    buf = torch.empty(kv_bytes + pool_bytes, dtype=torch.uint8)
    order = torch.randperm(pages)
    g, s = Gatherer(), Scatterer()
    pb_src, pb_dst = PoolBytes(src), PoolBytes(dst)

    def kv():
        n = g.gather(k, v, order, page_size, (0, heads), buf)
        s.scatter(buf[:n], dk, dv, order, page_size, (0, heads))

    def pool():
        gather_pools(pb_src, copies, buf, kv_bytes)
        at = kv_bytes
        scatter_pools(pb_dst, [LandedBlock(buf[at + c.offset : at + c.offset + c.nbytes], c) for c in copies])

    def reference():
        per_tensor_ops(src, copies, buf[kv_bytes:], dst)

    kinds = {"kv": kv, "pool": pool, "pool, one op per tensor": reference}
    out = {"kv_bytes": kv_bytes, "pool_bytes": pool_bytes, "quiet": {}, "polling": {}}
    for mode in ("quiet", "polling"):
        times = {name: [] for name in kinds}
        ctx = Poller() if mode == "polling" else None
        if ctx:
            ctx.__enter__()
        try:
            for _ in range(repeats + 1):  # the first round warms up
                for name, fn in kinds.items():
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
        finally:
            if ctx:
                ctx.__exit__(None, None, None)
        out[mode] = {name: statistics.median(t[1:]) for name, t in times.items()}
    for c in copies:  # the copies must have moved the right bytes
        if not torch.equal(dst["ssm"].tensors[c.segment.tensor][5], src["ssm"].tensors[c.segment.tensor][3]):
            raise AssertionError("pool copy moved the wrong bytes")
    return out


def report(r: dict) -> list[str]:
    kvb, pb = r["kv_bytes"], r["pool_bytes"]
    lines = [
        f"staging copies of one writer's request, in one process: KV {kvb / 2**20:.1f} MiB gathered + scattered, "
        f"pool {pb / 2**10:.0f} KiB gathered + scattered (bytes ratio {pb / kvb:.3f})"
    ]
    for mode in ("quiet", "polling"):
        m = r[mode]
        per_kv = m["kv"] / kvb
        cells = "  ".join(
            f"{name} {sec * 1e3:7.3f} ms ({sec / pb / per_kv:5.2f}x KV per byte)"
            for name, sec in m.items()
            if name != "kv"
        )
        lines.append(f"  {mode:8s} kv {m['kv'] * 1e3:7.3f} ms  {cells}")
    return lines


if __name__ == "__main__":
    print("\n".join(report(measure())))
