"""The fused Triton gather/scatter kernels against a plain device-to-device copy, on a CUDA GPU.

    .venv/bin/python examples/bench_gpu_kernels.py --json docs/bench/gpu_kernels.json
    .venv/bin/python examples/bench_gpu_kernels.py --smoke     # CPU, Triton interpreter (CI)
    .venv/bin/python examples/bench_gpu_kernels.py --host-only # CPU: host work per call, no kernel run

Why: on a GPU the staged path's gather and scatter should cost little next to the network write;
the goal is that each moves a chunk at >= 0.7x the speed of `dst.copy_(src)` of the same number
of bytes between two contiguous device buffers (the ceiling for a copy of that size).

Each case is one chunk (`--tokens`, 2048 by default, rounded up to whole pages) of one prefill
rank's bf16 KV: its pages, drawn at random from a cache twice the chunk, are gathered for the
head range a decode rank needs, and the region is scattered into random pages of a decode
cache. Before timing, every case is checked bit-exact against the torch reference (`Gatherer` /
`Scatterer`); a mismatch exits 1.

Timed (torch.cuda.Event around `--iters` calls after `--warmup`; GB/s = region bytes / time):
  gather, scatter      TritonGatherer.gather / TritonScatterer.scatter as a transfer worker calls
                       them: host page lists, the layers as tuples, the same list on every call
                       (a piece's list is validated and uploaded on its first call and kept,
                       staging/plan_cache.py; the first call is not timed), made as the workers make
                       them (`caches_fixed=True`: the engine's caches never move)
  bare gather/scatter  the same kernels launched directly with prepared arguments: the kernels alone
  copy                 dst.copy_(src), region-sized contiguous uint8 buffers
`--smoke` runs tiny cases on the CPU under Triton's interpreter with time.perf_counter: it
exercises the script, its figures are NOT GPU figures.

`--host-only` measures, on the CPU, what each gather/scatter call costs the host: the call exactly
as above with the kernel launch itself replaced by a no-op (`KernelLaunch.__call__`), on the real
case geometries (caches allocated, never filled or copied: nothing is verified). It reports the
median and mean time per call over `--iters` calls after `--warmup`, and the first call (which
builds the plan); and the same for calls that each take a piece never seen before (the PIECES
slices of a fresh copy of the chunk's page array in turn, as the protocol cuts pieces). It measures whichever kvstage is imported, so the same script times two
checkouts (PYTHONPATH). On a GPU the host work per call adds to the launch (16-28 us on the H100
run of 2026-11-27) and must stay below the kernel's own time for the GPU not to wait.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from types import SimpleNamespace

import torch

from kvstage.staging.gather_scatter import Gatherer, Scatterer, region_nbytes

GOAL = 0.7
POOL = 2  # cache pages per chunk page: the chunk's pages are a random subset of the cache


@dataclass(frozen=True, kw_only=True)
class Case:
    """One chunk geometry: the prefill cache (src) and the decode cache (dst), per rank."""
    name: str
    layers: int
    has_v: bool
    head_dim: int
    page_size: int
    src_heads: int
    gather: tuple[int, int]   # head range taken from the prefill rank's cache
    dst_heads: int
    scatter: tuple[int, int]  # head range written in the decode rank's cache
    dtype: str = "bfloat16"


def _gqa(ps: int, tp: str, layers=32, heads=8, hd=128) -> Case:
    """Llama-3-8B-shaped cache; tp "1to1", "1to2" (gather half the heads), "2to1" (scatter half)."""
    half = heads // 2
    geo = {"1to1": (heads, (0, heads), heads, (0, heads)), "1to2": (heads, (0, half), half, (0, half)),
           "2to1": (half, (0, half), heads, (half, heads))}[tp]
    src_heads, gather, dst_heads, scatter = geo
    return Case(name=f"gqa{heads}-ps{ps}-tp{tp}", layers=layers, has_v=True, head_dim=hd, page_size=ps,
                src_heads=src_heads, gather=gather, dst_heads=dst_heads, scatter=scatter)


#: GQA at page sizes 16 and 64 in three TP pairings; MLA shaped as DeepSeek-V3: 61 layers, K only,
#: one latent "head" of 512 + 64 (the same on every rank, so gathered and scattered whole)
CASES = [
    _gqa(16, "1to1"),
    _gqa(64, "1to1"),
    _gqa(16, "1to2"),
    _gqa(64, "1to2"),
    _gqa(16, "2to1"),
    Case(
        name="mla-ps64",
        layers=61,
        has_v=False,
        head_dim=576,
        page_size=64,
        src_heads=1,
        gather=(0, 1),
        dst_heads=1,
        scatter=(0, 1),
    ),
]
SMOKE_CASES = [
    _gqa(4, "1to2", layers=2, heads=4, hd=8),
    _gqa(4, "2to1", layers=2, heads=4, hd=12),
    Case(
        name="mla-ps4",
        layers=2,
        has_v=False,
        head_dim=36,
        page_size=4,
        src_heads=1,
        gather=(0, 1),
        dst_heads=1,
        scatter=(0, 1),
    ),
]


def make_buffers(case: Case, tokens: int, device: torch.device, seed: int = 0, fill: bool = True) -> SimpleNamespace:
    """Random-byte caches (any bit pattern, NaNs included; `fill` False: left as allocated), random
    page lists, one region. K and V are tuples of layers, as the transfer workers hold them."""
    n = -(-tokens // case.page_size)
    rows, dt = POOL * n * case.page_size, getattr(torch, case.dtype)
    es = torch.empty(0, dtype=dt).element_size()
    gen = torch.Generator(device=device).manual_seed(seed)
    host = torch.Generator().manual_seed(seed)

    def cache(heads):
        def one():
            if not fill:
                return torch.empty((rows, heads, case.head_dim * es), dtype=torch.uint8, device=device).view(dt)
            return torch.randint(
                0, 256, (rows, heads, case.head_dim * es), dtype=torch.uint8, device=device, generator=gen
            ).view(dt)

        return tuple(one() for _ in range(case.layers)), tuple(one() for _ in range(case.layers)) if case.has_v else None

    hh = case.gather[1] - case.gather[0]
    nbytes = region_nbytes(case.layers, case.has_v, n * case.page_size, hh, case.head_dim, es)
    (sk, sv), (dk, dv) = cache(case.src_heads), cache(case.dst_heads)
    return SimpleNamespace(
        n=n,
        tokens=n * case.page_size,
        nbytes=nbytes,
        es=es,
        src_k=sk,
        src_v=sv,
        dst_k=dk,
        dst_v=dv,
        src_pages=torch.randperm(POOL * n, generator=host)[:n],
        dst_pages=torch.randperm(POOL * n, generator=host)[:n],
        region=torch.empty(nbytes, dtype=torch.uint8, device=device),
    )


def _tensors(k, v) -> list[torch.Tensor]:
    return list(k) + (list(v) if v is not None else [])


def verify(case: Case, b: SimpleNamespace, gatherer, scatterer) -> list[str]:
    """Problems found (empty: bit-exact). Gather: the region equals the reference's. Scatter:
    the whole decode cache equals the reference's (so no byte outside the head range moved), and
    gathering the written pages back gives the region. Leaves the gathered region in b.region."""
    problems = []
    ref = torch.full((b.nbytes,), 0xA5, dtype=torch.uint8, device=b.region.device)
    Gatherer().gather(b.src_k, b.src_v, b.src_pages, case.page_size, case.gather, ref)
    b.region.fill_(0x5A)
    n = gatherer.gather(b.src_k, b.src_v, b.src_pages, case.page_size, case.gather, b.region)
    if n != b.nbytes:
        problems.append(f"gather returned {n}, the region has {b.nbytes} bytes")
    if not torch.equal(b.region, ref):
        bad = int((b.region != ref).sum())
        problems.append(f"gather: {bad} of {b.nbytes} bytes differ from the torch reference")
    want_k, want_v = tuple(t.clone() for t in b.dst_k), tuple(t.clone() for t in b.dst_v) if case.has_v else None
    Scatterer().scatter(ref, want_k, want_v, b.dst_pages, case.page_size, case.scatter)
    scatterer.scatter(ref, b.dst_k, b.dst_v, b.dst_pages, case.page_size, case.scatter)
    for i, (got, want) in enumerate(zip(_tensors(b.dst_k, b.dst_v), _tensors(want_k, want_v))):
        if not torch.equal(got.view(torch.uint8), want.view(torch.uint8)):
            problems.append(f"scatter: decode cache tensor {i} (K layers, then V) differs from the torch reference")
    back = torch.empty_like(ref)
    Gatherer().gather(b.dst_k, b.dst_v, b.dst_pages, case.page_size, case.scatter, back)
    if not torch.equal(back, ref):
        problems.append("scatter: the written pages gathered back do not give the region")
    return problems


def bare_launch(tk, direction: str, k, v, pages, page_size: int, heads: tuple[int, int], region: torch.Tensor):
    """A closure launching the kernel for `direction` ("gather" or "scatter") as TritonGatherer /
    TritonScatterer do, minus the per-call validation and page upload: what the kernel itself
    costs. The plan and its launch arguments are worked out once, here."""
    from kvstage.staging.copy_plan import Direction
    planner = tk.TritonGatherer() if direction == "gather" else tk.TritonScatterer()
    return tk.kernel_launch(planner.plan(Direction(direction), k, v, pages, page_size, heads, region))


def time_op(fn, warmup: int, iters: int, cuda: bool) -> tuple[float, float]:
    """(device seconds per call, host seconds per call to issue it). With CUDA events, a host
    time close to the device time means the figure is bound by the host, not the kernel."""
    for _ in range(warmup):
        fn()
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if not cuda:
        return ((time.perf_counter() - t0) / iters,) * 2
    end.record()
    host = (time.perf_counter() - t0) / iters
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters, host


def run_case(tk, case: Case, tokens: int, device: torch.device, args) -> dict:
    b = make_buffers(case, tokens, device)
    problems = verify(case, b, tk.TritonGatherer(), tk.TritonScatterer())
    bare_g = bare_launch(tk, "gather", b.src_k, b.src_v, b.src_pages, case.page_size, case.gather, b.region)
    bare_s = bare_launch(tk, "scatter", b.dst_k, b.dst_v, b.dst_pages, case.page_size, case.scatter, b.region)
    good, back = b.region.clone(), torch.empty_like(b.region)
    b.region.zero_()
    bare_g()  # then: overwrite the destination heads with zeros, bare scatter, gather them back
    Scatterer().scatter(torch.zeros_like(good), b.dst_k, b.dst_v, b.dst_pages, case.page_size, case.scatter)
    bare_s()
    Gatherer().gather(b.dst_k, b.dst_v, b.dst_pages, case.page_size, case.scatter, back)
    if not (torch.equal(b.region, good) and torch.equal(back, good)):
        problems.append("a bare kernel launch differs from TritonGatherer.gather / TritonScatterer.scatter")
    if problems:
        sys.exit(f"{case.name} ({tokens} tokens): NOT bit-exact, not timed:\n  " + "\n  ".join(problems))
    g, s = tk.TritonGatherer(caches_fixed=True), tk.TritonScatterer(caches_fixed=True)   # as the workers make them
    copy_dst = torch.empty_like(b.region)
    ops = {
        "gather": lambda: g.gather(b.src_k, b.src_v, b.src_pages, case.page_size, case.gather, b.region),
        "scatter": lambda: s.scatter(b.region, b.dst_k, b.dst_v, b.dst_pages, case.page_size, case.scatter),
        "bare_gather": bare_g,
        "bare_scatter": bare_s,
        "copy": lambda: copy_dst.copy_(b.region),
    }
    rec = {
        **asdict(case),
        "kv": 2 if case.has_v else 1,
        "elem_size": b.es,
        "pages": b.n,
        "tokens_asked": tokens,
        "tokens": b.tokens,
        "bytes": b.nbytes,
        "verified": True,
    }
    for name, fn in ops.items():
        dev_s, host_s = time_op(fn, args.warmup, args.iters, device.type == "cuda")
        rec[f"{name}_gbps"] = b.nbytes / dev_s / 1e9
        rec[f"{name}_us"], rec[f"{name}_host_us"] = dev_s * 1e6, host_s * 1e6
    for name in ("gather", "scatter", "bare_gather", "bare_scatter"):
        rec[f"{name}_over_copy"] = rec[f"{name}_gbps"] / rec["copy_gbps"]
    return rec


@contextlib.contextmanager
def launches_off(tk):
    """Every Triton launch a no-op: what is left of a gather/scatter call is its host work."""
    launch = tk.KernelLaunch.__call__
    tk.KernelLaunch.__call__ = lambda self: None
    try:
        yield
    finally:
        tk.KernelLaunch.__call__ = launch


#: --host-only "piece" ops: a chunk's page array cut into this many pieces, each gathered once
PIECES = 4


def host_case(tk, case: Case, tokens: int, args) -> dict:
    """Host microseconds per gather/scatter call with the kernel launch off (`--host-only`).

    gather, scatter: the same page list on every call (a piece gathered for several decode ranks,
    or for several layer groups). gather_piece, scatter_piece: every call a piece never seen before,
    as the protocol cuts them: the PIECES slices of a fresh copy of the chunk's page array in turn."""
    import numpy as np

    b = make_buffers(case, tokens, torch.device("cpu"), fill=False)
    g, s = tk.TritonGatherer(caches_fixed=True), tk.TritonScatterer(caches_fixed=True)   # as the workers make them
    calls = 1 + args.warmup + args.iters
    m = max(1, b.n // PIECES)

    def pieces(pages: torch.Tensor):
        out = []
        while len(out) < calls:
            chunk = np.array(pages.numpy(), dtype=np.int64)   # a new array: the pages of a new chunk
            out += [chunk[i * m:(i + 1) * m] for i in range(PIECES)]
        return iter(out)

    src_pieces, dst_pieces = pieces(b.src_pages), pieces(b.dst_pages)
    piece_region = b.region[: b.nbytes // b.n * m]
    ops = {
        "gather": lambda: g.gather(b.src_k, b.src_v, b.src_pages, case.page_size, case.gather, b.region),
        "scatter": lambda: s.scatter(b.region, b.dst_k, b.dst_v, b.dst_pages, case.page_size, case.scatter),
        "gather_piece": lambda: g.gather(
            b.src_k, b.src_v, next(src_pieces), case.page_size, case.gather, piece_region
        ),
        "scatter_piece": lambda: s.scatter(
            piece_region, b.dst_k, b.dst_v, next(dst_pieces), case.page_size, case.scatter
        ),
    }
    rec = {**asdict(case), "pages": b.n, "piece_pages": m, "tokens_asked": tokens, "tokens": b.tokens,
           "bytes": b.nbytes}
    with launches_off(tk):
        for name, fn in ops.items():
            t0 = time.perf_counter()
            fn()
            rec[f"{name}_first_us"] = (time.perf_counter() - t0) * 1e6
            for _ in range(args.warmup):
                fn()
            times = []
            for _ in range(args.iters):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            rec[f"{name}_host_us"] = statistics.median(times) * 1e6
            rec[f"{name}_host_mean_us"] = statistics.fmean(times) * 1e6
    return rec


def _positive(text: str) -> int:
    try:
        val = int(text)
    except ValueError:
        val = 0
    if val < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return val


def _tokens(text: str) -> list[int]:
    return [_positive(x) for x in text.split(",")]


def _device(text: str) -> torch.device:
    try:
        return torch.device(text)
    except RuntimeError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=_tokens, default=None, help="chunk sizes, e.g. 2048,8192 (default 2048; smoke 16)")
    ap.add_argument("--iters", type=_positive, default=None, help="timed calls per operation (default 50; smoke 3)")
    ap.add_argument(
        "--warmup",
        type=_positive,
        default=None,
        help="untimed calls first, Triton compiles in the first (default 5; smoke 1)",
    )
    ap.add_argument("--json", type=str, default=None, metavar="PATH", help="write every figure and the setup here")
    ap.add_argument("--device", type=_device, default=None, help="CUDA device (default cuda; smoke: cpu)")
    ap.add_argument("--cases", type=str, default=None, help="comma-separated case names (default: all)")
    ap.add_argument(
        "--smoke", action="store_true", help="tiny cases on the CPU under TRITON_INTERPRET=1 (CI): not GPU figures"
    )
    ap.add_argument(
        "--host-only",
        action="store_true",
        help="CPU: host microseconds per gather/scatter call, kernel launch off (with --smoke: the tiny cases)",
    )
    args = ap.parse_args(argv)
    cpu = args.smoke or args.host_only
    args.device = args.device or torch.device("cpu" if cpu else "cuda")
    args.tokens = args.tokens or [16 if args.smoke else 2048]
    args.iters = args.iters or (3 if args.smoke else 500 if args.host_only else 50)
    args.warmup = args.warmup or (1 if args.smoke else 20 if args.host_only else 5)
    if cpu and args.device.type != "cpu":
        ap.error("--smoke and --host-only run on the CPU under Triton's interpreter: leave out --device or pass cpu")
    known = {c.name: c for c in (SMOKE_CASES if args.smoke else CASES)}
    names = args.cases.split(",") if args.cases else list(known)
    if any(n not in known for n in names):
        ap.error(f"--cases: unknown {sorted(set(names) - set(known))}; known: {', '.join(known)}")
    args.case_list = [known[n] for n in names]
    return args


def host_only(args) -> list[dict]:
    """`--host-only`: the table of host microseconds per call."""
    tk = _kernels(True)
    print(f"host work per call, kernel launch off (CPU, {os.cpu_count()} cores); torch {torch.__version__}; "
          f"{args.warmup} warm-up + {args.iters} calls per op; median (mean) us per call, first call")
    print(
        f"{'case':18s} {'tokens':>6s} {'pages':>5s} {'gather us':>18s} {'first':>8s} {'scatter us':>18s} "
        f"{'first':>8s} | {'new piece: gather':>18s} {'scatter':>18s}"
    )
    results = []
    for tokens in args.tokens:
        for case in args.case_list:
            r = host_case(tk, case, tokens, args)
            results.append(r)
            print(
                f"{r['name']:18s} {r['tokens']:6d} {r['pages']:5d} {r['gather_host_us']:8.1f} "
                f"({r['gather_host_mean_us']:7.1f}) {r['gather_first_us']:8.1f} {r['scatter_host_us']:8.1f} "
                f"({r['scatter_host_mean_us']:7.1f}) {r['scatter_first_us']:8.1f} | "
                f"{r['gather_piece_host_us']:8.1f} ({r['gather_piece_host_mean_us']:7.1f}) "
                f"{r['scatter_piece_host_us']:8.1f} ({r['scatter_piece_host_mean_us']:7.1f})"
            )
    return results


def _kernels(smoke: bool):
    """Import the kernels, interpreted (smoke) or compiled (GPU); exit 2 when that is not what
    triton gave (it reads TRITON_INTERPRET once, when it is first imported)."""
    if smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    from kvstage.staging import triton_kernels as tk

    if tk.interpreted() != smoke:
        sys.stderr.write(
            "the Triton kernels came out "
            + ("compiled" if smoke else "interpreted")
            + ": "
            + (
                "set TRITON_INTERPRET=1 before triton is imported\n"
                if smoke
                else "unset TRITON_INTERPRET (it is 1) to time the compiled kernels\n"
            )
        )
        sys.exit(2)
    return tk


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.host_only:
        results = host_only(args)
        if args.json:
            meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
                    "argv": sys.argv[1:] if argv is None else list(argv), "host_only": True,
                    "timer": "time.perf_counter", "torch": torch.__version__, "iters": args.iters,
                    "warmup": args.warmup, "cores": os.cpu_count()}
            with open(args.json, "w") as f:
                json.dump({"meta": meta, "cases": results}, f, indent=1)
            print(f"wrote {args.json}")
        return results
    if not args.smoke and (args.device.type != "cuda" or (args.device.index or 0) >= torch.cuda.device_count()):
        sys.stderr.write(
            f"bench_gpu_kernels.py needs a CUDA GPU: device {args.device}, {torch.cuda.device_count()} "
            f"CUDA device(s) here; --smoke runs tiny cases on the CPU instead\n"
        )
        sys.exit(2)
    tk = _kernels(args.smoke)
    import triton

    cuda = args.device.type == "cuda"
    name = torch.cuda.get_device_name(args.device) if cuda else "cpu (Triton interpreter)"
    print(
        f"{name}; torch {torch.__version__}, triton {triton.__version__}; {args.warmup} warm-up + {args.iters} "
        f"calls per op; GB/s = region bytes / time; goal: gather and scatter >= {GOAL}x copy"
    )
    if args.smoke:
        print("SMOKE: Triton interpreter on the CPU, time.perf_counter: these are NOT GPU figures")
    print(
        f"{'case':18s} {'tokens':>6s} {'bytes':>11s} {'copy':>8s} {'gather':>8s} {'scatter':>8s} "
        f"{'g/copy':>6s} {'s/copy':>6s} {'bare g':>8s} {'bare s':>8s} {'bg/cp':>5s} {'bs/cp':>5s}"
    )
    results = []
    with torch.cuda.device(args.device) if cuda else contextlib.nullcontext():
        for tokens in args.tokens:
            for case in args.case_list:
                r = run_case(tk, case, tokens, args.device, args)
                results.append(r)
                mark = {
                    k: "n/a" if args.smoke else "ok" if r[f"{k}_over_copy"] >= GOAL else "MISS"
                    for k in ("gather", "scatter")
                }
                print(
                    f"{r['name']:18s} {r['tokens']:6d} {r['bytes']:11d} {r['copy_gbps']:8.1f} "
                    f"{r['gather_gbps']:8.1f} {r['scatter_gbps']:8.1f} {r['gather_over_copy']:5.2f}x "
                    f"{r['scatter_over_copy']:5.2f}x {r['bare_gather_gbps']:8.1f} {r['bare_scatter_gbps']:8.1f} "
                    f"{r['bare_gather_over_copy']:4.2f}x {r['bare_scatter_over_copy']:4.2f}x  "
                    f"gather {mark['gather']}, scatter {mark['scatter']}"
                )
    if args.json:
        meta = {
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "argv": sys.argv[1:] if argv is None else list(argv),
            "device": str(args.device),
            "device_name": name,
            "smoke": args.smoke,
            "timer": "torch.cuda.Event" if cuda else "time.perf_counter",
            "torch": torch.__version__,
            "triton": triton.__version__,
            "iters": args.iters,
            "warmup": args.warmup,
            "goal": GOAL,
        }
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "cases": results}, f, indent=1)
        print(f"wrote {args.json}")
    return results


if __name__ == "__main__":
    main()
