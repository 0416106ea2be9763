"""Gather/scatter formulations side by side, in one run, on this machine (torch, CPU).

    .venv/bin/python examples/bench_gather.py             # default geometry, all cases
    .venv/bin/python examples/bench_gather.py --quick     # fewer cases and rounds

Each case is one chunk of one rank's KV: `--layers` x K/V x `--tokens` tokens, `--heads` local
heads of `--head-dim`, gathered from (scattered into) a cache 4x larger than the chunk, into a
pre-faulted staging buffer. Each formulation runs once to warm up, then all formulations of a
case run interleaved for `--rounds` rounds (the machine may be shared: interleaving spreads the
noise evenly); the table shows the median GB/s (region bytes / time) and the best round.

Formulations (u8: byte-wide views, as docs/staging_kernels.md measured them; i64: head rows reinterpreted as
8-byte units, what staging.gather_scatter does):
  gather  idxsel       index_select on the (head-sliced) page view straight into the region
          tmp+slice    index_select whole pages into a temp, then copy the head slice out
          advidx       cache[pages][:, :, h0:h1] (allocates), then copy into the region
          runs         one slice copy per run of consecutive pages (consecutive patterns only)
          CHOSEN       staging.gather_scatter.Gatherer.gather (validation included)
  scatter idxcopy      index_copy_ into the (head-sliced) page view
          idxput       cache[pages, :, h0:h1] = region (index_put_)
          rmw-tmp      whole pages into a temp, head slice in, index_copy_ back: NOT safe with
                       concurrent writers of other heads of the same pages; reference only
          runs         one slice copy per run of consecutive pages (consecutive patterns only)
          CHOSEN       staging.gather_scatter.Scatterer.scatter
  memcpy               the same number of bytes, one contiguous copy_ (the ceiling)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvstage.staging.buffers import StagingBuffer  # noqa: E402
from kvstage.staging.gather_scatter import Gatherer, Scatterer, region_nbytes  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn,
          "int8": torch.int8}


_FLUSH = torch.empty(96 << 20, dtype=torch.uint8)


def flush_caches() -> None:
    """Write 96 MiB (3x the L3 here) so that no formulation starts with its data in cache."""
    _FLUSH.fill_(1)


def make_pages(pattern: str, n: int, num_pages: int, gen: torch.Generator) -> torch.Tensor:
    if pattern == "random":
        return torch.randperm(num_pages, generator=gen)[:n]
    if pattern == "consecutive":
        return torch.arange(n) + num_pages // 3
    if pattern.startswith("runs"):  # runsK: runs of K consecutive pages at random places
        k = int(pattern[4:])
        starts = torch.randperm(num_pages // k, generator=gen)[: (n + k - 1) // k] * k
        return (starts[:, None] + torch.arange(k)).reshape(-1)[:n]
    raise ValueError(pattern)


def run_case(args, page_size: int, heads: tuple[int, int], pattern: str, caches, out_buf, gen) -> list[tuple]:
    L, H, hd = args.layers, args.heads, args.head_dim
    dtype = DTYPES[args.dtype]
    es = torch.empty(0, dtype=dtype).element_size()
    row = hd * es
    n = args.tokens // page_size
    P = 4 * n
    k, v, k2, v2 = caches(page_size)
    h0, h1 = heads
    hh = h1 - h0
    pages = make_pages(pattern, n, P, gen)
    nbytes = region_nbytes(L, True, n * page_size, hh, hd, es)
    out = out_buf.region(0, nbytes)
    block = nbytes // (2 * L)
    src_layers, dst_layers = k + v, k2 + v2
    whole = hh == H

    def views(unit, w):
        r = row // w
        s = [t.view(torch.uint8).view(unit).view(P, page_size, H, r) for t in src_layers]
        d = [t.view(torch.uint8).view(unit).view(P, page_size, H, r) for t in dst_layers]
        o = [out[i * block:(i + 1) * block].view(unit).view(n, page_size, hh, r) for i in range(2 * L)]
        return s, d, o

    u8 = views(torch.uint8, 1)
    i64 = views(torch.int64, 8)
    tmp = torch.empty(n * page_size * H * row, dtype=torch.uint8)
    runs = []
    pl = pages.tolist()
    pos = 0
    while pos < n:
        end = pos + 1
        while end < n and pl[end] == pl[end - 1] + 1:
            end += 1
        runs.append((pos, pl[pos], end - pos))
        pos = end

    def g_idxsel(vw):
        s, _, o = vw
        def f():
            for i in range(2 * L):
                if whole:
                    torch.index_select(s[i].view(P, -1), 0, pages, out=o[i].view(n, -1))
                else:
                    torch.index_select(s[i][:, :, h0:h1], 0, pages, out=o[i])
        return f

    def g_tmp(vw, unit):
        s, _, o = vw
        tv = tmp.view(unit).view(n, page_size, H, -1)
        def f():
            for i in range(2 * L):
                torch.index_select(s[i], 0, pages, out=tv)
                o[i].copy_(tv[:, :, h0:h1])
        return f

    def g_adv(vw):
        s, _, o = vw
        def f():
            for i in range(2 * L):
                o[i].copy_(s[i][pages, :, h0:h1])
        return f

    def g_runs(vw):
        s, _, o = vw
        def f():
            for i in range(2 * L):
                for p, st, ln in runs:
                    o[i][p:p + ln].copy_(s[i][st:st + ln, :, h0:h1])
        return f

    def s_idxcopy(vw):
        _, d, o = vw
        def f():
            for i in range(2 * L):
                if whole:
                    d[i].view(P, -1).index_copy_(0, pages, o[i].view(n, -1))
                else:
                    d[i][:, :, h0:h1].index_copy_(0, pages, o[i])
        return f

    def s_idxput(vw):
        _, d, o = vw
        def f():
            for i in range(2 * L):
                d[i][pages, :, h0:h1] = o[i]
        return f

    def s_rmw(vw, unit):
        _, d, o = vw
        tv = tmp.view(unit).view(n, page_size, H, -1)
        def f():
            for i in range(2 * L):
                torch.index_select(d[i], 0, pages, out=tv)
                tv[:, :, h0:h1].copy_(o[i])
                d[i].index_copy_(0, pages, tv)
        return f

    def s_runs(vw):
        _, d, o = vw
        def f():
            for i in range(2 * L):
                for p, st, ln in runs:
                    d[i][st:st + ln, :, h0:h1].copy_(o[i][p:p + ln])
        return f

    gatherer, scatterer = Gatherer(), Scatterer()
    flat_src = torch.empty(nbytes, dtype=torch.uint8)
    flat_src.view(-1)[::4096] = 1
    formulations = [
        ("memcpy", "", lambda: out.copy_(flat_src)),
        ("gather", "u8 idxsel", g_idxsel(u8)),
        ("gather", "u8 tmp+slice", g_tmp(u8, torch.uint8)),
        ("gather", "i64 idxsel", g_idxsel(i64)),
        ("gather", "i64 tmp+slice", g_tmp(i64, torch.int64)),
        ("gather", "i64 advidx", g_adv(i64)),
    ]
    if pattern != "random":
        formulations.append(("gather", "i64 runs", g_runs(i64)))
    formulations.append(("gather", "CHOSEN", lambda: gatherer.gather(k, v, pages, page_size, heads, out)))
    formulations += [
        ("scatter", "u8 idxcopy", s_idxcopy(u8)),
        ("scatter", "i64 idxcopy", s_idxcopy(i64)),
        ("scatter", "i64 idxput", s_idxput(i64)),
        ("scatter", "i64 rmw-tmp (unsafe)", s_rmw(i64, torch.int64)),
    ]
    if pattern != "random":
        formulations.append(("scatter", "i64 runs", s_runs(i64)))
    formulations.append(("scatter", "CHOSEN", lambda: scatterer.scatter(out, k2, v2, pages, page_size, heads)))
    if args.skip_u8:
        formulations = [f for f in formulations if not f[1].startswith("u8")]

    times = {i: [] for i in range(len(formulations))}
    for _, _, f in formulations:
        f()
    for _ in range(args.rounds):
        for i, (_, _, f) in enumerate(formulations):
            flush_caches()
            t0 = time.perf_counter()
            f()
            times[i].append(time.perf_counter() - t0)
    rows = []
    for i, (op, name, _) in enumerate(formulations):
        gbs = [nbytes / t / 1e9 for t in times[i]]
        rows.append((op, name, statistics.median(gbs), max(gbs)))
    return rows, nbytes, len(runs)


def run_threads(args, caches, out_buf, gen) -> None:
    """Two workers (own Gatherer/Scatterer each) at once vs one after the other, with torch's
    default intra-op threads and with one (torch.set_num_threads: this script may set it; the
    library never does).

    gather: one prefill rank serving two decode ranks (P < D): the two halves of the heads of the
    same pages into two regions. scatter: two prefill writers into one decode rank (P > D): two
    regions into the two head halves of the SAME pages, concurrently (safe: disjoint bytes).
    """
    ps, H = 16, args.heads
    if H < 2:
        return
    dtype = DTYPES[args.dtype]
    es = torch.empty(0, dtype=dtype).element_size()
    n = args.tokens // ps
    k, v, k2, v2 = caches(ps)
    pages = make_pages("random", n, 4 * n, gen)
    halves = [(0, H // 2), (H // 2, H)]
    nb = [region_nbytes(args.layers, True, n * ps, h1 - h0, args.head_dim, es) for h0, h1 in halves]
    outs = [out_buf.region(0, nb[0]), out_buf.region(nb[0], nb[1])]
    gs, ss = [Gatherer(), Gatherer()], [Scatterer(), Scatterer()]
    jobs = {
        "gather": [lambda i=i: gs[i].gather(k, v, pages, ps, halves[i], outs[i]) for i in range(2)],
        "scatter": [lambda i=i: ss[i].scatter(outs[i], k2, v2, pages, ps, halves[i]) for i in range(2)],
    }
    total = sum(nb)
    default_threads = torch.get_num_threads()
    print(f"\ntwo workers, page_size={ps}, pages random, two head halves of the same {n} pages, "
          f"{total / 2**20:.0f} MiB in all; median (best) GB/s")

    def sequential(fns):
        for f in fns:
            f()

    def concurrent(fns):
        threads = [threading.Thread(target=f) for f in fns]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    for op, fns in jobs.items():
        variants = [(f"{mode}, {nt} intra-op thread{'s' if nt > 1 else ''}", nt, run)
                    for nt in sorted({default_threads, 1}, reverse=True)
                    for mode, run in (("one thread, one after the other", sequential),
                                      ("two threads at once", concurrent))]
        res: dict[str, list[float]] = {name: [] for name, _, _ in variants}
        sequential(fns)
        for _ in range(args.rounds):
            for name, nt, run in variants:
                torch.set_num_threads(nt)
                flush_caches()
                t0 = time.perf_counter()
                run(fns)
                res[name].append(total / (time.perf_counter() - t0) / 1e9)
        torch.set_num_threads(default_threads)
        for name, gbs in res.items():
            print(f"  {op:8s} {name:52s} {statistics.median(gbs):6.2f} ({max(gbs):5.2f})")


def run_one_page(args, out_buf) -> None:
    """A one-page request's piece (TP 1 -> 2: half the heads of one page of 16 tokens, every layer,
    K and V): the call as the workers make it (CHOSEN) against one `copy_` per (K/V, layer) block,
    alone and beside a thread that runs Python without blocking (a busy control thread, at its
    worst). Every torch call lets go of Python's lock; taking it back from a thread running Python
    can wait up to sys.getswitchinterval(), so what counts here is the calls per copy, not the bytes.
    Median microseconds per call over interleaved rounds."""
    ps, H, L = 16, args.heads, args.layers
    dtype = DTYPES[args.dtype]
    es = torch.empty(0, dtype=dtype).element_size()
    h0, h1 = 0, max(1, H // 2)
    P = 64
    src = [torch.randint(0, 256, (P * ps, H, args.head_dim * es), dtype=torch.uint8).view(dtype) for _ in range(2 * L)]
    dst = [torch.zeros_like(t) for t in src]
    k, v, dk, dv = tuple(src[:L]), tuple(src[L:]), tuple(dst[:L]), tuple(dst[L:])
    nbytes = region_nbytes(L, True, ps, h1 - h0, args.head_dim, es)
    out = out_buf.region(0, nbytes)
    r = args.head_dim * es // 8
    sv = [t.view(torch.uint8).view(torch.int64).view(P, ps, H, r)[:, :, h0:h1] for t in src]
    dv8 = [t.view(torch.uint8).view(torch.int64).view(P, ps, H, r)[:, :, h0:h1] for t in dst]
    g, sc = Gatherer(caches_fixed=True), Scatterer(caches_fixed=True)
    page = [0]

    def gather_blocks():
        p = page[0] = (page[0] + 1) % P
        o = out[:nbytes].view(torch.int64).view(2 * L, 1, ps, h1 - h0, r)
        for i in range(2 * L):
            o[i].copy_(sv[i][p:p + 1])

    def scatter_blocks():
        o = out[:nbytes].view(torch.int64).view(2 * L, 1, ps, h1 - h0, r)
        for i in range(2 * L):
            dv8[i][page[0]:page[0] + 1].copy_(o[i])

    def gather_chosen():
        p = page[0] = (page[0] + 1) % P
        g.gather(k, v, np.array([p]), ps, (h0, h1), out, room=p)

    def scatter_chosen():
        sc.scatter(out, dk, dv, np.array([page[0]]), ps, (h0, h1), room=page[0])

    cases = [("gather", "copy_ per block", gather_blocks), ("gather", "CHOSEN", gather_chosen),
             ("scatter", "copy_ per block", scatter_blocks), ("scatter", "CHOSEN", scatter_chosen)]
    print(f"\none page: {L} layers x K,V x {ps} tokens x heads [{h0},{h1}) of {H}, region {nbytes >> 10} KiB; "
          f"median (p90) us per call over {args.rounds} interleaved rounds of 20 calls")
    for contended in (False, True):
        stop = threading.Event()

        def spin() -> None:
            n = 0
            while not stop.is_set():
                n += 1

        th = threading.Thread(target=spin, daemon=True)
        if contended:
            th.start()
        times: dict[str, list[float]] = {f"{op} {name}": [] for op, name, _ in cases}
        for _ in range(args.rounds):
            for op, name, f in cases:
                f()
                for _ in range(20):
                    t0 = time.perf_counter()
                    f()
                    times[f"{op} {name}"].append((time.perf_counter() - t0) * 1e6)
        stop.set()
        if contended:
            th.join()
        label = "beside a thread running Python" if contended else "alone"
        for key, ts in times.items():
            ts.sort()
            print(f"  {label:31s} {key:24s} {statistics.median(ts):9.0f} ({ts[int(len(ts) * 0.9)]:7.0f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--page-sizes", default="16,1,64")
    ap.add_argument("--patterns", default="random,consecutive,runs4,runs16",
                    help="page lists: random, consecutive, runsK (runs of K consecutive pages)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="page size 16 only, 3 rounds")
    ap.add_argument("--skip-u8", action="store_true", help="leave out the byte-wide formulations")
    ap.add_argument("--one-page", action="store_true",
                    help="only the one-page piece: calls per copy, alone and beside a thread running Python")
    args = ap.parse_args()
    page_sizes = [int(x) for x in args.page_sizes.split(",")]
    if args.quick:
        page_sizes, args.rounds = page_sizes[:1], 3
    H = args.heads
    head_cases = [(0, H), (0, H // 2), (H // 2 + H // 4, H // 2 + H // 4 + 1)] if H > 1 else [(0, 1)]
    patterns = args.patterns.split(",") if not args.quick else ["random", "consecutive"]
    dtype = DTYPES[args.dtype]
    es = torch.empty(0, dtype=dtype).element_size()
    gen = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads, {os.cpu_count()} cpus; "
          f"{args.layers} layers x K,V x {args.tokens} tokens x {H} heads x {args.head_dim} x {args.dtype}, "
          f"cache 4x the chunk; median (best) GB/s of region bytes over {args.rounds} interleaved rounds")

    cache_memo: dict[int, tuple] = {}

    def caches(ps):
        if ps not in cache_memo:
            cache_memo.clear()
            P = 4 * (args.tokens // ps)
            def layer():
                t = torch.empty((P * ps, H, args.head_dim * es), dtype=torch.uint8)
                t.view(-1)[::4096] = 1  # fault in
                return t.view(dtype)
            cache_memo[ps] = tuple([layer() for _ in range(args.layers)] for _ in range(4))
        return cache_memo[ps]

    full = region_nbytes(args.layers, True, args.tokens, H, args.head_dim, es)
    if args.one_page:
        with StagingBuffer.host(full) as buf:
            run_one_page(args, buf)
        return
    with StagingBuffer.host(full) as buf:
        for ps in page_sizes:
            for heads in head_cases:
                for pattern in patterns:
                    rows, nbytes, nruns = run_case(args, ps, heads, pattern, caches, buf, gen)
                    print(f"\npage_size={ps} heads=[{heads[0]},{heads[1]}) of {H}, pages {pattern} "
                          f"({args.tokens // ps} pages, {nruns} runs), region {nbytes / 2**20:.0f} MiB")
                    for op, name, med, best in rows:
                        print(f"  {op:8s} {name:22s} {med:6.2f} ({best:5.2f})")
            cache_memo.clear()
        run_threads(args, caches, buf, gen)
        cache_memo.clear()


if __name__ == "__main__":
    main()
