"""One rank process of examples/bench_layerwise.py: a prefill rank that simulates its forward
pass and sends while it "runs", or a decode rank that times each request's Success.

    python examples/layerwise_rank.py SPEC.json

The prefill rank plays a GPU engine whose CPU runs ahead of the GPU: at the forward start it
issues every send() of the request at once (whole request, per chunk, or per layer), each with
a readiness object standing for the CUDA event recorded after its layer. The simulated GPU is a
clock: layer l of chunk c is done at a deadline from the forward start, and the object's
synchronize(), called by a kvstage thread, blocks until then. Nothing on the caller's side
waits for a layer. All times are time.monotonic(), one clock for every process of the machine.

Spec: {"bootstrap", "result", "manager": a pd_rank.build() spec (role, rank, tp, backend,
staging, geometry, layer_group, layerwise_min_tokens, ...), "barrier", "sync_dir", "prefill_ranks",
"requests": [{"room", "chunks": [pages per chunk], "mode": "whole"|"chunk"|"layer"|"group-G"|"group-a.b.c",
"layer_s": [compute seconds per layer, per chunk], "verify": bool}]}.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

import numpy as np

from kvstage.support import pd_rank
from kvstage.transfer import KVPoll

DONE = (KVPoll.Success, KVPoll.Failed)


class SimulatedGPU:
    """The GPU's clock: wait_until(t) returns once the work due at t is done. stop() ends every
    wait (the rank shuts down), so no kvstage thread is left blocked on it."""

    def __init__(self) -> None:
        self._stop = threading.Event()

    def wait_until(self, deadline: float) -> None:
        while (left := deadline - time.monotonic()) > 0:
            if self._stop.wait(left):
                raise RuntimeError("the rank is shutting down")

    def stop(self) -> None:
        self._stop.set()


@dataclass(kw_only=True)
class LayerDone:
    """What a CUDA event recorded after one layer of a chunk is to send(ready=...):
    synchronize() returns when the simulated GPU finished that layer. Records when it was
    called and returned (how late kvstage's thread got to it)."""

    deadline: float
    gpu: SimulatedGPU
    called: float | None = None
    returned: float | None = None
    threads: list[str] = field(default_factory=list)   # every thread that called synchronize()

    def synchronize(self) -> None:
        self.called = time.monotonic()
        self.threads.append(threading.current_thread().name)
        self.gpu.wait_until(self.deadline)
        self.returned = time.monotonic()


def layer_deadlines(t0: float, layer_s: list[float], layers: int) -> list[list[float]]:
    """When each layer of each chunk is done: chunks run one after the other, each layer of
    chunk c taking layer_s[c] seconds."""
    out, t = [], t0
    for s in layer_s:
        out.append([t + (i + 1) * s for i in range(layers)])
        t += layers * s
    return out


def schedule_ranges(schedule: str, layers: int) -> list[range]:
    """The layer ranges of a caller's sends: "G", G layers each; "a.b.c", a layers, then b,
    then c and c again until the layers end (the last send takes what is left)."""
    sizes = [int(x) for x in schedule.split(".")]
    if not sizes or min(sizes) < 1:
        raise ValueError(f"a group schedule is positive layer counts separated by '.', got {schedule!r}")
    out, first = [], 0
    while first < layers:
        size = sizes[min(len(out), len(sizes) - 1)]
        out.append(range(first, min(first + size, layers)))
        first = out[-1].stop
    return out


def issue_sends(h, mode: str, pages: np.ndarray, chunks: list[int], done: list[list[LayerDone]]) -> None:
    """Every send of the request at once, each gated by its layer's readiness object: whole,
    per chunk, per layer (the room groups them by layer_group), or G layers per send."""
    if mode == "whole":
        h.send(pages, last=True, ready=done[-1][-1])
        return
    start = 0
    for c, n in enumerate(chunks):
        part = pages[start:start + n]
        if mode == "chunk":
            h.send(part, last=c == len(chunks) - 1, ready=done[c][-1])
        elif mode == "layer":
            for layer, ready in enumerate(done[c]):
                h.send(part, layers=range(layer, layer + 1), ready=ready)
        else:   # "group-G": G layers per send, as a caller grouping layers itself
            for layers in schedule_ranges(mode.split("-", 1)[1], len(done[c])):
                h.send(part, layers=layers, ready=done[c][layers.stop - 1])
        start += n


def wait_state(h, want: tuple, timeout: float) -> KVPoll:
    """Poll until the handle is in one of `want` (or ended, or the timeout)."""
    deadline = time.monotonic() + timeout
    while (state := h.poll()) not in want and state not in DONE and time.monotonic() < deadline:
        time.sleep(0.0002)
    return state


def wait_released(h, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not h.released and time.monotonic() < deadline:
        time.sleep(0.0005)


def forward_start(sync_dir: str, room: int, rank: int, ranks: int, timeout: float) -> float:
    """A forward start every prefill rank of the request agrees on (TP ranks run in lockstep):
    each writes when it is ready, all start just after the last one."""
    if ranks == 1:
        return time.monotonic() + 0.001
    path = os.path.join(sync_dir, f"room-{room}-rank-{rank}")
    with open(path + ".tmp", "w") as f:
        f.write(repr(time.monotonic()))
    os.replace(path + ".tmp", path)
    names = [os.path.join(sync_dir, f"room-{room}-rank-{r}") for r in range(ranks)]
    deadline = time.monotonic() + timeout
    while not all(map(os.path.exists, names)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"room {room}: the other prefill ranks never got ready")
        time.sleep(0.0002)
    return max(float(open(n).read()) for n in names) + 0.002


def run_prefill(spec: dict, mgr, layout, pattern, tensors, gpu: SimulatedGPU, out: list) -> None:
    m = spec["manager"]
    timeout = m.get("run_timeout_s", 300)
    perm = np.random.default_rng(1000 + m["rank"]).permutation(m["geometry"]["pages"])
    for req in spec["requests"]:
        chunks = req["chunks"]
        pages = perm[:sum(chunks)].astype(np.int64)
        if req.get("verify"):
            pattern.fill(tensors, req["room"], pages)
        h = mgr.sender(req["room"], len(pages))
        state = wait_state(h, (KVPoll.WaitingForInput,), timeout)
        if state is not KVPoll.WaitingForInput:
            raise RuntimeError(f"room {req['room']}: the decode side never arrived ({state.name}: {h.failure})")
        t0 = forward_start(spec["sync_dir"], req["room"], m["rank"], spec["prefill_ranks"], timeout)
        plan = layer_deadlines(t0, req["layer_s"], layout.num_layers)
        done = [[LayerDone(deadline=t, gpu=gpu) for t in chunk] for chunk in plan]
        gpu.wait_until(t0)
        issue_sends(h, req["mode"], pages, chunks, done)
        t_issued = time.monotonic()
        state = h.wait(timeout)
        last = done[-1][-1]
        out.append({"room": req["room"], "mode": req["mode"], "state": state.name, "failure": h.failure,
                    "t0": t0, "t_last": plan[-1][-1], "issue_s": t_issued - t0, "t_end": time.monotonic(),
                    "last_sync_late_s": None if last.returned is None else last.returned - last.deadline,
                    "ready_threads": sorted({n for c in done for d in c for n in d.threads}),
                    "syncs": [(d.deadline - t0, d.called - d.deadline, d.returned - d.deadline)
                              for c in done for d in c if d.called is not None and d.returned is not None]})
        wait_released(h, timeout)
        h.clear()


def run_decode(spec: dict, mgr, layout, pattern, tensors, out: list) -> None:
    m = spec["manager"]
    timeout = m.get("run_timeout_s", 300)
    perm = np.random.default_rng(2000 + m["rank"]).permutation(m["geometry"]["pages"])
    for req in spec["requests"]:
        pages = perm[:sum(req["chunks"])].astype(np.int64)
        h = mgr.receiver(req["room"], m["peer_engine"])
        h.init(pages)
        state = h.wait(timeout)
        t_success = time.monotonic()
        rec = {"room": req["room"], "state": state.name, "failure": h.failure, "t_success": t_success,
               "verified": None}
        wait_released(h, timeout)
        if state is KVPoll.Success and req.get("verify"):
            err = pattern.check(tensors, req["room"], pages)
            rec["verified"], rec["error"] = err is None, err
        out.append(rec)
        h.clear()


def drive(spec: dict, result: dict) -> None:
    m = spec["manager"]
    mgr, layout, buffers, pattern = pd_rank.build(m, spec["bootstrap"])
    gpu = SimulatedGPU()
    out = result["requests"] = []
    try:
        if m["role"] == "prefill":
            run_prefill(spec, mgr, layout, pattern, buffers.tensors(), gpu, out)
        else:
            run_decode(spec, mgr, layout, pattern, buffers.tensors(), out)
        result["stats"] = mgr.stats()
        pd_rank.barrier(spec.get("barrier"), f"{m['role']}-{m['rank']}")
    finally:
        gpu.stop()
        mgr.close()


def main() -> int:
    faulthandler.enable()
    spec = json.load(open(sys.argv[1]))
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s %(process)d %(threadName)s %(name)s %(levelname)s %(message)s")
    result: dict = {"role": spec["manager"]["role"], "rank": spec["manager"]["rank"]}
    try:
        drive(spec, result)
    except Exception as exc:  # noqa: BLE001 - reported to the benchmark, not swallowed
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()
    pd_rank._write_json(spec["result"], result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
