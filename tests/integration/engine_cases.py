"""Builds multi-geometry runs for the engine tests: every (topology, geometry) pair becomes one
prefill engine and one decode engine; rank r of every engine lives in the same process, so a
whole matrix costs one process per rank slot."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from records import exact

from kvstage.support.cluster import Cluster

TEST_TIMEOUTS = {"lease": 20.0, "heartbeat": 0.5, "connect": 20.0, "bootstrap": 45.0, "close": 5.0}


@dataclass(frozen=True, kw_only=True)
class Topo:
    P: int
    D: int
    H: int
    mla: bool = False
    pp: int = 1          # prefill PP stages (P ranks each)
    dpp: int = 1         # decode PP stages (D ranks each)

    @property
    def name(self) -> str:
        return (f"P{self.P}{f'x{self.pp}' if self.pp > 1 else ''}D{self.D}{f'x{self.dpp}' if self.dpp > 1 else ''}"
                f"H{self.H}{'mla' if self.mla else ''}")

    @property
    def prefill_ranks(self) -> int:
        return self.P * self.pp

    @property
    def decode_ranks(self) -> int:
        return self.D * self.dpp


@dataclass(kw_only=True)
class Case:
    topo: Topo
    page_size: int = 16
    dtype: str = "bfloat16"
    staging: bool = False
    backend: str = "nixl"
    rooms: list = field(default_factory=list)
    extra: dict = field(default_factory=dict)          # more pd_rank spec keys for both sides
    prefill_extra: dict = field(default_factory=dict)
    decode_extra: dict = field(default_factory=dict)
    rank_extra: dict = field(default_factory=dict)     # (role, rank) -> more keys for that rank only
    layers: int = 2
    head_dim: int = 16
    pages: int = 512
    pools: dict = field(default_factory=dict)           # state pools (support/pool_pattern.py spec)
    label: str = ""                                     # tells apart cases that differ in nothing above

    @property
    def name(self) -> str:
        return (f"{self.topo.name}-ps{self.page_size}-{self.dtype}-{'st' if self.staging else 'dr'}-"
                f"{self.backend}{'-' + self.label if self.label else ''}")

    def geometry(self) -> dict:
        return {"layers": self.layers, "heads": self.topo.H, "head_dim": self.head_dim, "dtype": self.dtype,
                "page_size": self.page_size, "pages": self.pages, "mla": self.topo.mla, "pools": self.pools}


def random_rooms(seed: int, count: int, page_size: int, max_tokens: int = 300, base: int = 1000) -> list[dict]:
    """Random request lengths (1 token and non page-aligned included), uneven chunks."""
    rng = random.Random(seed)
    rooms = []
    for i in range(count):
        tokens = 1 if i == 0 else rng.choice([rng.randint(1, max_tokens), rng.randint(1, 40)])
        pages = -(-tokens // page_size)
        k = rng.randint(1, min(pages, 4))
        cuts = sorted(rng.sample(range(1, pages), k - 1)) if k > 1 else []
        b = [0] + cuts + [pages]
        rooms.append({"room": base + i, "pages": pages, "tokens": tokens,
                      "chunks": [y - x for x, y in zip(b, b[1:])]})
    return rooms


LAYERED_AUX = {"sharding": "replicated", "items": 16, "tensors": [["float32", [5]], ["int32", [3]]]}


def layer_pool(layer: int) -> dict:
    """A hybrid model's state of one layer (a Mamba slot's share of 4 heads, and a replicated
    part), registered only where that layer is (`StatePool(layer=...)`)."""
    return {"sharding": "heads", "heads": 4, "items": 8, "layer": layer, "tensors": [["int16", [3]], ["uint8", [5]]]}


def layered_case(topo: Topo, staging: bool, backend: str, *, seed: int, base: int, label: str, layers: int,
                 layer_sends: list | None = None, group: int = 1, min_tokens: int = 0, pools: bool = False,
                 prefix: bool = False, layer_pools: bool = False) -> Case:
    """Six short rooms of pages of 4 tokens, each sent as `layer_sends` (None: every layer at
    once), every other one with a 1-page prefix hit (`prefix`), each with an aux row (`pools`)
    and a state slot in a pool of each layer (`layer_pools`); the prefill groups layers by
    `group` above `min_tokens` tokens."""
    rooms = random_rooms(seed, 6, 4, max_tokens=120, base=base)
    for i, r in enumerate(rooms):
        if layer_sends:
            r["layer_sends"] = layer_sends
        if prefix and i % 2 and r["pages"] > 1:
            r["prefix_pages"] = 1
        if pools or layer_pools:
            r["pool_items"] = {"aux": 1, **({f"layer{n}": 1 for n in range(layers)} if layer_pools else {})}
    spec = {"aux": LAYERED_AUX} if pools or layer_pools else {}
    if layer_pools:
        spec |= {f"layer{n}": layer_pool(n) for n in range(layers)}
    return Case(topo=topo, page_size=4, dtype="bfloat16", staging=staging, backend=backend, rooms=rooms,
                layers=layers, prefill_extra={"layer_group": group, "layerwise_min_tokens": min_tokens},
                label=label, pools=spec)


def manager_specs(case: Case, role: str, rank: int, barrier: dict) -> dict:
    t = case.topo
    spec = {"role": role, "rank": rank, "tp": t.P if role == "prefill" else t.D,
            "engine": f"{'p' if role == 'prefill' else 'd'}-{case.name}", "backend": case.backend,
            "staging": case.staging, "geometry": case.geometry(), "rooms": case.rooms, "ring_mb": 1,
            "buffer_mb": 1, "workers": 2, "timeouts": dict(TEST_TIMEOUTS), "barrier": barrier, "inflight": 16,
            # the fixed rule (staged iff TP sizes differ) unless a case asks for the measured
            # choice: the cases check the path they expect (test_path_choice.py checks the choice)
            "calibrate": False}
    if role == "prefill" and t.pp > 1:
        spec["pp"] = t.pp
    if role == "decode" and t.dpp > 1:
        spec["pp"] = t.dpp
    if role == "decode":
        spec["peer_engine"] = f"p-{case.name}"
    spec.update(case.extra)
    spec.update(case.prefill_extra if role == "prefill" else case.decode_extra)
    spec.update(case.rank_extra.get((role, rank), {}))
    return spec


def run_cases(cases: list[Case], timeout: float = 240, env: dict | None = None, server_args: list | None = None,
              rendezvous: str | None = None):
    """Run every case in one cluster; return {case name: {"prefill": [...], "decode": [...]}}
    with each rank's result dict, plus the processes for exit-code checks. `rendezvous`: an
    address the ranks use instead of a bootstrap server of their own (e.g. etcd://)."""
    nprefill = max(c.topo.prefill_ranks for c in cases)
    ndecode = max(c.topo.decode_ranks for c in cases)
    total = sum(c.topo.prefill_ranks + c.topo.decode_ranks for c in cases)
    out = {c.name: {"prefill": [], "decode": []} for c in cases}
    t0 = time.monotonic()
    with Cluster(env=env, server_args=server_args, rendezvous=rendezvous) as cl:
        barrier = cl.barrier(total, timeout_s=timeout)
        for r in range(nprefill):
            specs = [manager_specs(c, "prefill", r, barrier) for c in cases if r < c.topo.prefill_ranks]
            cl.launch(specs, f"prefill{r}")
        for r in range(ndecode):
            specs = [manager_specs(c, "decode", r, barrier) for c in cases if r < c.topo.decode_ranks]
            cl.launch(specs, f"decode{r}")
        procs = cl.wait(timeout + 30)
        for p in procs:
            for res in p.result():
                case = res["name"].split("/")[0][2:]
                out[case][res["role"]].append(res)
        logs = {Path(p.log_path).name: p.log(tail=1_000_000) for p in procs}
        codes = [p.proc.returncode for p in procs]
    return out, codes, logs, time.monotonic() - t0


def each_rank(cases: list[Case], results: dict):
    """(case, side, rank result) for every rank of every case, each checked to have run without
    an error in the driver."""
    for c in cases:
        for side in ("prefill", "decode"):
            for res in results[c.name][side]:
                assert not res.get("error"), res.get("traceback")
                yield c, side, res


def problems(results: dict, codes: list, logs: dict, expect_success: bool = True) -> list[str]:
    """Everything that is not a clean, verified success, as readable lines."""
    bad = []
    if any(codes):
        bad.append(f"rank process exit codes {codes}")
    for case, sides in results.items():
        for side, ranks in sides.items():
            for res in ranks:
                if res.get("error"):
                    bad.append(f"{case} {res['name']}: {res['error']}\n{res.get('traceback', '')}")
                for r in res.get("rooms", []):
                    if expect_success and not exact(res["role"], r):
                        bad.append(f"{case} {res['name']} room {r['room']}: {r['state']} {r['failure']} "
                                   f"verified={r['verified']} {r.get('error') or ''}")
    if bad:
        for name, text in logs.items():
            crash = next((m for m in ("Caught signal", "Fatal Python error") if m in text), None)
            if crash:  # a native crash, shown first: UCX's backtrace or faulthandler's, with the Python stack
                i, j = text.index(crash), text.find("Current thread")
                bad.insert(0, f"--- {name}\n{text[i:i + 3000]}\n{text[j:j + 4000] if j >= 0 else ''}")
            elif "Traceback" in text or "ERROR" in text:
                bad.append(f"--- {name}\n{text[-3000:]}")
    return bad


def corrupt_rooms(name: str, dec: dict) -> set[int]:
    """A decode rank's rooms under the corrupt_data fault with verify on: each Failed as
    `corrupt` with the digests named, or Success and bit-exact; the failed ones exactly those a
    byte was flipped in (no miss, no false alarm). Returns them."""
    assert not dec.get("error"), dec.get("traceback")
    failed = {r["room"] for r in dec["rooms"] if r["state"] == "Failed"}
    for r in dec["rooms"]:
        if r["state"] == "Failed":
            assert r["kind"] == "corrupt" and "digest" in r["failure"], (name, r)
        else:
            assert r["state"] == "Success" and r["verified"] is True, (name, r)
    assert set(dec["corrupted_rooms"]) == failed, (name, dec["corrupted_rooms"], failed)
    return failed
