"""What a fleet run measured (fleet.py), as plain numbers: per request, per rank, per ring.

`room_memory` measures the bytes rooms hold while in flight (deep_size.py: their own objects,
not the layout, timeouts and peer keys they share with every room of their rank);
`summarize` turns a finished Fleet into one JSON-able dict."""

from __future__ import annotations

import re
import statistics
from collections import Counter
from typing import Any

from ..transfer.poll import KVPoll
from ..transfer.protocol.decode.tracker import SHARED_EMPTY
from ..transfer.protocol.leases import heartbeat_interval, pair_interval
from ..transfer.protocol.prefill.flows import NO_ENTRIES
from ..transfer.protocol.room_uses import NO_EARLIER_USES
from .deep_size import deep_size, shared_ids
from .fleet import Fleet

ROOM_MESSAGES = ("RoomMeta", "MetaAck", "AllocRequest", "AllocGrant", "WriterDone", "RoomDone", "RoomFailed",
                 "Quiesced", "TagsAgain", "WatermarkUpdate")


def jain(xs: list[float]) -> float:
    """Jain's fairness index: 1 when all equal, 1/n when one gets everything."""
    if not xs or not any(xs):
        return 1.0
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs))


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def room_memory(fleet: Fleet, sample: int = 200) -> dict[str, Any]:
    """Bytes each of up to `sample` rooms in flight holds, per side, and how many were in flight."""
    # a rank's plans (decode/plan.py SharedPlans) are shared by its rooms of one shape, like its layout;
    # the shared empty maps (tracker's, flows') and the no-earlier-uses record, by every room of the process
    shared = shared_ids([fleet.cfg.timeouts, fleet.op_ids, NO_EARLIER_USES, SHARED_EMPTY, NO_ENTRIES,
                         list(fleet._layouts.values()),
                         list(fleet._mappings.values()), [r.key for r in fleet.ranks], list(KVPoll),
                         [r.plans for r in fleet.ranks]])
    out: dict[str, Any] = {}
    for side in ("prefill", "decode"):
        rooms = [r for rank in fleet.ranks if rank.side == side and rank.alive for r in rank.rooms.values()
                 if r.state not in (KVPoll.Success, KVPoll.Failed)]
        step = max(1, len(rooms) // sample)
        sizes = [deep_size(r, shared) for r in rooms[::step][:sample]]
        out[side] = {"rooms_in_flight": len(rooms), "sampled": len(sizes),
                     "mean_bytes": round(statistics.fmean(sizes)) if sizes else 0,
                     "p99_bytes": pct(sizes, 0.99), "max_bytes": max(sizes, default=0)}
    return out


def heartbeat_rates(fleet: Fleet) -> tuple[list[float], list[float]]:
    """Heartbeats each live rank sends and receives per second, once two peers settled on their
    pace (leases.py: each rank's `heartbeat_interval`, longer with many peers; a pair at the
    longer of its two, `pair_interval`)."""
    t = fleet.cfg.timeouts
    every = {r.gid: heartbeat_interval(len(r.peers), base=t.heartbeat, lease=t.lease) for r in fleet.ranks if r.alive}
    sent, received = [], []
    for r in fleet.ranks:
        if r.alive:
            sent.append(sum(1 / pair_interval(every[r.gid], every[p], t.lease) for p in r.peers if p in every))
            received.append(sum(1 / pair_interval(every[p], every[r.gid], t.lease) for p in r.peers if p in every))
    return sent, received


def peer_activity(fleet: Fleet, idle_interval: float) -> dict[str, Any]:
    """Heartbeats per rank per second now (every connected peer each heartbeat interval) and if
    peers with no room in flight between the two ranks were sent one only every `idle_interval`
    (a proposal, docs/scale.md): sent and received, the most any rank has."""
    t = fleet.cfg.timeouts
    active: dict[int, set[int]] = {r.gid: set() for r in fleet.ranks}
    for req in fleet.open.values():
        pranks = fleet.engines[("prefill", req.pe)]
        for d in fleet.engines[("decode", req.de)]:
            for p in pranks:
                if p in fleet.ranks[d].peers:
                    active[d].add(p)
                    active[p].add(d)
    sent, received = heartbeat_rates(fleet)
    now = [s + r for s, r in zip(sent, received)]
    proposed, busy = [], []
    for r in fleet.ranks:
        if not r.alive:
            continue
        a = len(active[r.gid] & r.peers)
        idle = len(r.peers) - a
        hb = heartbeat_interval(len(r.peers), base=t.heartbeat, lease=t.lease)   # its own pace, not its pairs'
        proposed.append(2 * (a / hb + idle / max(hb, idle_interval)))
        busy.append(a)
    return {"requests_in_flight": len(fleet.open), "active_peers_per_rank_max": max(busy, default=0),
            "heartbeats_per_rank_per_s_max": round(max(now, default=0), 1),
            f"heartbeats_per_rank_per_s_max_if_idle_peers_every_{idle_interval:g}s": round(max(proposed, default=0), 1)}


def summarize(fleet: Fleet, wall_s: float) -> dict[str, Any]:
    cfg = fleet.cfg
    reqs = fleet.requests
    n = max(1, len(reqs))
    ends = Counter()
    for req in reqs:
        states = {s for s, _ in req.outcome.values()}
        ends["success" if states == {KVPoll.Success} else "failed" if KVPoll.Success not in states else "mixed"] += 1
    took = [req.closed - req.opened for req in reqs if req.closed is not None
            and all(s is KVPoll.Success for s, _ in req.outcome.values())]
    reasons: Counter[str] = Counter()
    for req in reqs:
        for _, why in req.outcome.values():
            if why:
                reasons[re.sub(r"[0-9a-f]{4,}|\d+(\.\d+)?", "N", why)[:90]] += 1
    deadline = sum(1 for req in reqs for _, why in req.outcome.values() if why and " within " in why)
    ranks = [r for r in fleet.ranks]
    peers = [len(r.peers) for r in ranks if r.alive]
    hb_sent, hb_received = heartbeat_rates(fleet)
    hb_both = [s + r for s, r in zip(hb_sent, hb_received)]
    sim_s = max(fleet.now, 1e-9)
    # the ring: occupancy over the run, grants per prefill rank of each decode rank
    occ = {d: v for d, v in fleet.ring_occ.items()}
    ring = fleet.ranks[next(iter(occ))].ring if occ else None
    size = ring.size if ring is not None else 1
    busy = [v[0] / sim_s / size for v in occ.values()]
    peaks = [v[2] / size for v in occ.values()]
    fair = [jain(list(c.values())) for c in fleet.grants.values() if len(c) > 1]
    waits = {p: statistics.fmean(w) for p, w in fleet.grant_wait.items() if w}
    all_waits = [x for w in fleet.grant_wait.values() for x in w]
    room_msgs = {k: fleet.msgs[k] for k in ROOM_MESSAGES if fleet.msgs[k]}
    return {
        "config": {"prefill_engines": cfg.prefill_engines, "decode_engines": cfg.decode_engines,
                   "prefill_tp": list(cfg.prefill_tp), "decode_tp": list(cfg.decode_tp),
                   "prefill_ranks": sum(1 for r in ranks if r.side == "prefill"),
                   "decode_ranks": sum(1 for r in ranks if r.side == "decode"),
                   "models": [m.name for m in cfg.models], "requests": cfg.requests, "in_flight": cfg.in_flight,
                   "loss": cfg.network.loss, "deaths": cfg.deaths, "seed": cfg.seed},
        "wall_s": round(wall_s, 1),
        "events": fleet.events,
        "simulated_s": round(fleet.now, 3),
        "peak_in_flight": fleet.peak_in_flight,
        "invariants_broken": fleet.check(),
        "requests": dict(ends),
        "requests_refused": fleet.refused,
        "succeeded_request_s": {"p50": round(pct(took, 0.5), 4), "p99": round(pct(took, 0.99), 4)},
        "rooms_failed_by_a_deadline": deadline,
        "failure_reasons": dict(reasons.most_common(12)),
        "messages_per_request": {k: round(v / n, 3) for k, v in room_msgs.items()},
        "room_messages_per_request": round(sum(room_msgs.values()) / n, 2),
        "room_message_bytes_per_request": round(sum(fleet.msg_bytes[k] for k in room_msgs) / n, 1),
        "bytes_per_message": {k: round(fleet.msg_bytes[k] / v, 1) for k, v in room_msgs.items()},
        "connection_setup_messages_per_request": round(sum(fleet.setup_msgs.values()) / n, 3),
        "messages_sent_per_rank": {"mean": round(statistics.fmean(fleet.msgs_by_rank.values()), 1),
                                   "max": max(fleet.msgs_by_rank.values(), default=0)},
        "lost_messages": fleet.net.lost,
        "core_cpu_us_per_request": round(fleet.core_s / n * 1e6, 1),
        "core_calls_per_request": round(fleet.core_calls / n, 1),
        "connected_peers_per_rank": {"mean": round(statistics.fmean(peers), 1), "max": max(peers, default=0)},
        "heartbeats_per_rank_per_s": {"sent_max": round(max(hb_sent, default=0), 1),
                                      "sent_and_received_max": round(max(hb_both, default=0), 1),
                                      "sent_and_received_mean": round(statistics.fmean(hb_both), 1) if hb_both else 0.0},
        "watermark_updates_per_decode_rank_per_s": round(
            fleet.msgs["WatermarkUpdate"] / max(1, len(occ)) / sim_s, 1),
        "rendezvous_lookups_per_request": round(fleet.lookups / n, 4),
        "ring": {"rings": len(occ), "mean_occupancy": round(statistics.fmean(busy), 4) if busy else 0.0,
                 "peak_occupancy_max": round(max(peaks, default=0.0), 4),
                 "grant_bytes_jain_mean": round(statistics.fmean(fair), 4) if fair else None,
                 "grant_bytes_jain_min": round(min(fair), 4) if fair else None,
                 "grant_wait_ms_p50": round(pct(all_waits, 0.5) * 1e3, 3),
                 "grant_wait_ms_p99": round(pct(all_waits, 0.99) * 1e3, 3),
                 "grant_wait_jain_across_prefill_ranks": round(jain(list(waits.values())), 4) if waits else None,
                 "overlaps": fleet.overlaps},
        "death": {"ranks_killed": len(fleet.deaths),
                  "detected_s": {"min": round(min(fleet.detect, default=0), 3),
                                 "p50": round(pct(fleet.detect, 0.5), 3),
                                 "max": round(max(fleet.detect, default=0), 3)},
                  "requests_failed": len(fleet.fail_after_death),
                  "request_failed_after_s": {"p50": round(pct(fleet.fail_after_death, 0.5), 3),
                                             "max": round(max(fleet.fail_after_death, default=0), 3)}},
    }
