"""Engine-pair leases (transfer/protocol/engine_leases.py) driven over a fleet's connections: every
rank's `EngineLeases` ticked by its control loop, its beats carried by a seeded network, ranks
killed (silent from then on) or cut off (alive, but nothing it sends or should receive arrives).

It counts the beats each rank sends and receives (and their encoded bytes), and checks, as it
runs, what the scheme promises:

- no live, reachable rank is ever declared lost (`false_losses`);
- every rank linked to a killed rank declares it lost within the lease of the kill (plus the
  tick and transit), never before the lease less the stalest a stamp may be (`detect_s`);
- a rank declared lost while alive (cut off) had already stopped writing to the rank that
  declared it: its fence ran out first (`fence_breaks`);
- how stale the freshest stamp a rank holds of a live peer gets (`stalest_s`, under the lease),
  and the least fence a writer had left (`fence_slack_min_s`, above zero): both from one lease
  into the run on (before it, the first stamps and acknowledgements are still on their way).
"""

from __future__ import annotations

import heapq
import itertools
import random
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import msgspec

from ..transfer.protocol.engine_leases import EngineLeases
from .fleet import Fleet


@dataclass(frozen=True)
class BeatRank:
    gid: int
    engine: str
    incarnation: int


@dataclass
class BeatRun:
    seconds: float
    sent_per_s: dict[int, float]
    received_per_s: dict[int, float]
    bytes_per_s_max: float
    detect_s: list[float] = field(default_factory=list)
    false_losses: list[str] = field(default_factory=list)
    fence_breaks: list[str] = field(default_factory=list)
    missed: list[str] = field(default_factory=list)     # linked to a killed rank and never declared it
    stalest_s: float = 0.0
    fence_slack_min_s: float = float("inf")
    labels: dict[int, str] = field(default_factory=dict)   # gid -> its engine, for the report
    peers: dict[int, int] = field(default_factory=dict)    # gid -> remote ranks it is linked to

    def both_max(self) -> float:
        return max((self.sent_per_s[g] + self.received_per_s[g] for g in self.sent_per_s), default=0.0)

    def summary(self) -> dict[str, object]:
        both = [self.sent_per_s[g] + self.received_per_s[g] for g in self.sent_per_s]
        hot = sorted(self.sent_per_s, key=lambda g: -(self.sent_per_s[g] + self.received_per_s[g]))[:3]
        return {"simulated_s": self.seconds,
                "hottest_ranks": [{"engine": self.labels.get(g, ""), "peer_ranks": self.peers.get(g, 0),
                                   "sent_per_s": round(self.sent_per_s[g], 1),
                                   "received_per_s": round(self.received_per_s[g], 1)} for g in hot],
                "beats_per_rank_per_s": {"sent_max": round(max(self.sent_per_s.values(), default=0), 1),
                                         "received_max": round(max(self.received_per_s.values(), default=0), 1),
                                         "both_max": round(max(both, default=0), 1),
                                         "both_mean": round(statistics.fmean(both), 1) if both else 0},
                "beat_bytes_per_rank_per_s_max": round(self.bytes_per_s_max),
                "stalest_stamp_of_a_live_peer_s": round(self.stalest_s, 3),
                "least_fence_left_s": round(self.fence_slack_min_s, 3),
                "declared_lost_after_kill_s": {"min": round(min(self.detect_s), 3) if self.detect_s else None,
                                               "max": round(max(self.detect_s), 3) if self.detect_s else None,
                                               "n": len(self.detect_s)},
                "false_losses": len(self.false_losses), "fence_breaks": len(self.fence_breaks),
                "missed": len(self.missed)}


def run_beats(ranks: Sequence[BeatRank], links: Iterable[tuple[int, int]], *, lease: float, base: float,
              sibling_every: float, seconds: float, tick: float = 0.25, warmup: float = 5.0, seed: int = 0,
              kills: Sequence[tuple[float, int]] = (), cuts: Sequence[tuple[float, int]] = (),
              loss: float = 0.0) -> BeatRun:
    """`links`: connected pairs of gids (prefill, decode: the first writes to the second);
    `kills` / `cuts`: (time, gid). Rates are counted from `warmup` on."""
    rng = random.Random(seed)
    by_gid = {r.gid: r for r in ranks}
    inc_to_gid = {r.incarnation: r.gid for r in ranks}
    engines: dict[str, list[int]] = defaultdict(list)
    for r in ranks:
        engines[r.engine].append(r.gid)
    leases = {r.gid: EngineLeases(me=r.incarnation, engine=r.engine, lease=lease, sibling_every=sibling_every,
                                  base=base, now=0.0) for r in ranks}
    for r in ranks:
        leases[r.gid].set_siblings({by_gid[g].incarnation for g in engines[r.engine]}, 0.0)
    writes: set[tuple[int, int]] = set()
    linked: set[tuple[int, int]] = set()
    for a, b in links:
        leases[a].connect(by_gid[b].incarnation, by_gid[b].engine, 0.0)
        leases[b].connect(by_gid[a].incarnation, by_gid[a].engine, 0.0)
        writes.add((a, b))
        linked |= {(a, b), (b, a)}
    writers = {a for a, _ in writes}
    dead: dict[int, float] = {}
    cut: dict[int, float] = {}
    sent: Counter[int] = Counter()
    received: Counter[int] = Counter()
    nbytes: Counter[int] = Counter()
    out = BeatRun(seconds=seconds, sent_per_s={}, received_per_s={}, bytes_per_s_max=0.0,
                  labels={r.gid: r.engine for r in ranks})
    for a, b in links:
        out.peers[a] = out.peers.get(a, 0) + 1
        out.peers[b] = out.peers.get(b, 0) + 1
    enc = msgspec.msgpack.Encoder()
    events: list[tuple[float, int, str, tuple]] = []
    order = itertools.count()
    last_arrival: dict[tuple[int, int], float] = {}
    for r in ranks:
        heapq.heappush(events, (rng.uniform(0, tick), next(order), "tick", (r.gid,)))
    for t, g in kills:
        heapq.heappush(events, (t, next(order), "kill", (g,)))
    for t, g in cuts:
        heapq.heappush(events, (t, next(order), "cut", (g,)))
    while events:
        now, _, kind, args = heapq.heappop(events)
        if now > seconds:
            break
        if kind == "kill":
            dead[args[0]] = now
        elif kind == "cut":
            cut[args[0]] = now
        elif kind == "deliver":
            src, dst, beat = args
            if dst in dead or dst in cut or src in cut:
                continue
            if now >= warmup:
                received[dst] += 1
            leases[dst].on_beat(beat, now)
        else:
            g = args[0]
            if g in dead:
                continue
            heapq.heappush(events, (now + tick, next(order), "tick", (g,)))
            me = leases[g]
            for send in me.beats(now, clock=now):
                dst = inc_to_gid[send.to]
                if now >= warmup:
                    sent[g] += 1
                    nbytes[g] += len(enc.encode(send.beat))
                if rng.random() < loss:
                    continue
                at = max(now + 50e-6 + rng.expovariate(1 / 200e-6), last_arrival.get((g, dst), 0.0))
                last_arrival[(g, dst)] = at
                heapq.heappush(events, (at, next(order), "deliver", (g, dst, send.beat)))
            _judge(g, now, me, by_gid, inc_to_gid, dead, cut, writes, writers, lease, out, leases)
    span = max(1e-9, seconds - warmup)
    out.sent_per_s = {r.gid: sent[r.gid] / span for r in ranks if r.gid not in dead and r.gid not in cut}
    out.received_per_s = {r.gid: received[r.gid] / span for r in ranks if r.gid not in dead and r.gid not in cut}
    out.bytes_per_s_max = max((nbytes[g] / span for g in out.sent_per_s), default=0.0)
    for g, t in dead.items():
        for a, b in linked:
            if b == g and a not in dead and a not in cut and seconds - t > lease + 2 * tick \
                    and by_gid[g].incarnation in leases[a].remotes:
                out.missed.append(f"{a} never declared {g} lost")
    return out


def _judge(g: int, now: float, me: EngineLeases, by_gid: dict[int, BeatRank], inc_to_gid: dict[int, int],
           dead: dict[int, float], cut: dict[int, float], writes: set[tuple[int, int]], writers: set[int],
           lease: float, out: BeatRun, leases: dict[int, EngineLeases]) -> None:
    """Rank `g`'s verdicts at `now` (a writer also judges its fences), checked against who is
    really dead or cut off; then how stale its peers' stamps and how short its fences are."""
    if g in cut:
        return
    for lost in me.verdicts(now, writes=g in writers):
        q = inc_to_gid[lost.rank]
        if q in dead:
            out.detect_s.append(now - dead[q])
        elif q in cut:
            if leases[q].may_write(by_gid[g].incarnation, now) and (q, g) in writes:
                out.fence_breaks.append(f"{q} may still write to {g}, which declared it lost at {now:.2f}")
        else:
            out.false_losses.append(f"{g} declared {q} lost ({lost.kind}) at {now:.2f}")
        me.disconnect(lost.rank)
    for p_inc in list(me.remotes):
        q = inc_to_gid[p_inc]
        if q in dead or q in cut:
            continue
        heard = me.heard(p_inc)
        if heard is not None and now >= lease:
            out.stalest_s = max(out.stalest_s, now - heard)
        if (g, q) in writes and now >= lease:
            out.fence_slack_min_s = min(out.fence_slack_min_s, me.remotes[p_inc].fence + lease - now)


def fleet_beats(fleet: Fleet, seconds: float, seed: int = 0) -> BeatRun:
    """Engine-pair leases over a finished fleet's connections (its live ranks and their peers),
    with the lease, interval and tick of its timeouts: the rank with the most peers keeps
    running; at `seconds` / 2 one prefill rank linked to it is killed and another cut off."""
    t = fleet.cfg.timeouts
    live = [r for r in fleet.ranks if r.alive]
    ranks = [BeatRank(r.gid, f"{r.side}-{r.engine}-tp{len(fleet.engines[(r.side, r.engine)])}", r.key.incarnation)
             for r in live]
    links = [(p, r.gid) for r in live if r.side == "decode" for p in sorted(r.peers) if fleet.ranks[p].alive]
    hot = max((r for r in live if r.side == "decode"), key=lambda r: (len(r.peers), -r.gid))
    writers = sorted(p for p in hot.peers if fleet.ranks[p].alive)
    half = seconds / 2
    kills = [(half, writers[0])] if writers else []
    cuts = [(half + 0.5, writers[-1])] if len(writers) > 1 else []
    return run_beats(ranks, links, lease=t.lease, base=t.heartbeat, sibling_every=t.heartbeat, seconds=seconds,
                     tick=fleet.cfg.tick_s, warmup=min(5.0, seconds / 4), seed=seed, kills=kills, cuts=cuts)
