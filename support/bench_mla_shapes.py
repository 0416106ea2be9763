"""What decode context parallel and KV page sharding cost: one MLA request of the same tokens
moved as a plain prefill TP 2 -> decode TP 2 (each decode rank written by one prefill rank), as
prefill TP 2 -> decode TP 2 with DCP 2 (each decode rank takes every other token, docs/protocol.md
"Decode context parallel"): gathered into the prefill's staging buffers and written as runs of
decode slots (`dcp`, the relayout) or, staging off, one range per token and layer from the cache
(`dcp-runs`), and from a prefill TP 2 that shards
its pages (each decode rank written by both prefill ranks, each the pages it owns, "KV page
sharding"). The shapes run in alternated rounds (plain, DCP, sharded, then the reverse), each
round a fresh cluster of real rank processes over the real backend, one request in flight; the
figure of a shape is the median over its rounds of each round's median request time (the
prefill rank 0's send() to its Success, which comes once every decode rank confirmed), and the
ratios are to the plain shape of the same rounds. Issue 55's goal: the DCP relayout at 4K tokens
no more than 1.2x the same request without DCP.

    python examples/bench_mla_shapes.py --tokens 4096 --rounds 3 --requests 4 --json F

The first request of each round is verified bit-exact on every decode rank and not timed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
from dataclasses import dataclass
from typing import Any

from kvstage.support.bench import MiB, run_ranks
from kvstage.transfer.protocol.token_mapping import DCPLayout, local_pages


@dataclass(frozen=True, kw_only=True)
class Shape:
    """One way of moving the request: the pd_rank spec keys of each side."""

    name: str
    prefill: dict
    decode: dict
    staging: bool = True   # the prefill ranks' staging buffers: what a DCP split is gathered into

    @property
    def dcp(self) -> int:
        return int(self.decode.get("dcp", 1))


SHAPES = (Shape(name="plain", prefill={}, decode={}),
          Shape(name="dcp", prefill={}, decode={"dcp": 2}),
          Shape(name="dcp-runs", prefill={}, decode={"dcp": 2}, staging=False),
          Shape(name="sharded", prefill={"shards": 2}, decode={}))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096, help="tokens per request")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=576, help="bf16 elements of one token's latent per layer")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--requests", type=int, default=4, help="timed requests per round and shape")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--transport", choices=("nixl", "mooncake"), default="nixl")
    p.add_argument("--shapes", default=",".join(s.name for s in SHAPES))
    p.add_argument("--json", default=None, help="write the rounds and the summary here")
    a = p.parse_args(argv)
    known, asked = {s.name: s for s in SHAPES}, a.shapes.split(",")
    if not asked or any(n not in known for n in asked):
        p.error(f"--shapes takes some of {sorted(known)}, got {a.shapes!r}")
    a.shapes = [known[n] for n in asked]
    for name in ("tokens", "layers", "head_dim", "page_size", "requests", "rounds"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return a


def rooms_for(a: argparse.Namespace, shape: Shape, base: int) -> tuple[list[dict], list[dict]]:
    """The prefill's and the decode's room specs of one round: one untimed verified request, then
    the timed ones, every one `a.tokens` tokens sent in one chunk."""
    pages = -(-a.tokens // a.page_size)
    pre, dec = [], []
    for i in range(a.requests + 1):
        room = base + i
        tokens = {"dcp_tokens": a.tokens} if shape.dcp > 1 else {}
        pre.append({"room": room, "pages": pages, "chunks": [pages], **tokens})
        dpages = local_pages(DCPLayout(dcp_size=shape.dcp, page_size=a.page_size, mla=True), a.tokens) \
            if shape.dcp > 1 else pages
        dec.append({"room": room, "pages": dpages, "chunks": [dpages], **tokens})
    return pre, dec


def one_round(a: argparse.Namespace, shape: Shape, base: int) -> dict[str, Any]:
    """One fresh cluster of the shape: the timed requests' seconds (prefill rank 0's send() to Success)."""
    pre_rooms, dec_rooms = rooms_for(a, shape, base)
    pages = -(-a.tokens // a.page_size) * 2 + 8
    geom = {"layers": a.layers, "heads": 1, "head_dim": a.head_dim, "dtype": "bfloat16", "page_size": a.page_size,
            "pages": pages, "mla": True}
    ns = argparse.Namespace(ring_mb=64, buffer_mb=64, device="cpu")   # MiB; an MLA request moves direct
    pre, _dec = run_ranks(ns, a.transport, 2, 2, shape.staging, pre_rooms, geom, verify=[base],
                          extra={"path": "auto"},   # MLA moves direct; staging on gives the prefill its buffers
                          prefill_extra={**shape.prefill, "rooms": pre_rooms},
                          decode_extra={**shape.decode, "rooms": dec_rooms})
    recs = sorted(pre[0]["rooms"], key=lambda r: r["room"])
    seconds = [r["end"] - r["t_send"] for r in recs if r["room"] != base]
    relayouts = sum(int(p["stats"].get("relayout_writes", 0)) for p in pre)
    return {"shape": shape.name, "seconds": seconds, "median_s": statistics.median(seconds),
            "relayout_writes": relayouts}


def run(a: argparse.Namespace) -> dict[str, Any]:
    rounds: list[dict] = []
    for r in range(a.rounds):
        order = a.shapes if r % 2 == 0 else list(reversed(a.shapes))
        for k, shape in enumerate(order):
            rounds.append({"round": r, **one_round(a, shape, 10_000 * (r + 1) + 1000 * k)})
            print(f"round {r} {shape.name:8s} median {rounds[-1]['median_s'] * 1e3:8.2f} ms", flush=True)
    return summarize(a, rounds)


def summarize(a: argparse.Namespace, rounds: list[dict]) -> dict[str, Any]:
    """Each shape's median over rounds of the round medians, its range, and the ratio to the plain
    shape's figure (and each round's ratio to the plain shape of the same round)."""
    by_shape: dict[str, list[float]] = {}
    for row in rounds:
        by_shape.setdefault(row["shape"], []).append(row["median_s"])
    plain = by_shape.get("plain")
    summary = {}
    for name, meds in by_shape.items():
        fig = statistics.median(meds)
        entry = {"median_ms": fig * 1e3, "range_ms": [min(meds) * 1e3, max(meds) * 1e3],
                 "gb_per_s": a.tokens * a.layers * a.head_dim * 2 / fig / 1e9}
        if plain:
            entry["ratio_to_plain"] = fig / statistics.median(plain)
            entry["round_ratios"] = [m / p for m, p in zip(meds, plain)]
        summary[name] = entry
    return {"rounds": rounds, "summary": summary}


def header(a: argparse.Namespace) -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "unknown"
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    mb = a.tokens * a.layers * a.head_dim * 2 / MiB
    return (f"kvstage MLA shapes, {now}, commit {commit}, {platform.node()} ({os.cpu_count()} CPUs)\n"
            f"{a.tokens} tokens x {a.layers} layers x {a.head_dim} bf16 ({mb:.1f} MiB a request), page {a.page_size}, "
            f"{a.transport}, prefill TP 2 -> decode TP 2, {a.rounds} rounds alternated, {a.requests} timed requests "
            f"a round")


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    print(header(a), flush=True)
    out = run(a)
    for name, s in out["summary"].items():
        ratio = f"   {s['ratio_to_plain']:.2f}x plain (rounds {', '.join(f'{x:.2f}' for x in s['round_ratios'])})" \
            if "ratio_to_plain" in s else ""
        print(f"{name:8s} {s['median_ms']:8.2f} ms [{s['range_ms'][0]:.2f}-{s['range_ms'][1]:.2f}] "
              f"{s['gb_per_s']:6.2f} GB/s{ratio}")
    if "dcp" in out["summary"] and "ratio_to_plain" in out["summary"]["dcp"]:
        r = out["summary"]["dcp"]["ratio_to_plain"]
        print(f"issue 55 goal, DCP relayout at {a.tokens} tokens <= 1.2x without DCP: {'MET' if r <= 1.2 else 'MISS'} "
              f"({r:.2f}x)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"header": header(a), **out}, f, indent=1)
    return 0
