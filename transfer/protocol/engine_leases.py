"""Leases per pair of engines: a rank's heartbeats grow with the peer ENGINES it serves, not with
the peer RANKS, and a dead peer rank is still declared lost within its lease. Pure (time passed
in, beats and verdicts returned).

Why per-rank-pair leases cannot meet the bound: a decode rank of TP 1 serving prefill engines of
TP 8 is connected to 8 ranks of each of them (216 at 64 x 64, docs/scale.md). Every one of them
must show it is alive at least once a lease, and every one must get acknowledgements back (its
write fence), so a rank-pair lease costs at least 2 x 216 / lease messages a second at that rank
(43 at a 10 s lease, with no margin at all; 173 at today's quarter lease). Only the peer engine's
ranks can aggregate their own liveness, so they talk to each other.

The scheme:

- Every rank stamps a number (`seq`), remembering when (`stamps`); a stamp proves the rank was
  alive at that time. Every beat carries `Vouch(rank, seq, age)` records: the stamps the sender
  knows of, and `age`, how long they were held by the ranks that relayed them (their own clocks'
  durations, so a lower bound of the time since the stamp left its rank: network transit is not
  counted). A receiver takes `heard = now - age`, which is never earlier than when the stamp's
  rank sent it: as safe as the receipt time a rank-pair lease uses (leases.py).
- The ranks of one engine (siblings) beat each other every `sibling_every`; such a beat vouches
  for the sender, names the remote ranks it is connected to (`links`), and relays what the
  receiver may need: stamps of remote ranks it is linked to, acknowledgements addressed to it,
  and the engine's acknowledgements to the peer engines it is linked to.
- Per pair of engines (E, F), one beat each way per slot. A slot is E's `engine_interval` (the
  configured interval while a rank sends at most HEARTBEATS_PER_S, longer with more peer
  engines, never longer than an eighth of the lease), or F's when that is longer (each engine
  beat tells its sender's, siblings pass on what they were told): two engines settle on the
  longer of their slots, so a rank receives no more engine beats than it sends. In each slot
  (number ``floor(clock / slot length)``; `clock` is wall time, so ranks of one engine on
  different hosts agree up to their clock offset; `slot_length`), the rank of E whose turn it is among E's live ranks
  linked to F sends one beat to one of its linked ranks of F (in turn). The beat vouches for
  every rank of E linked to F and carries the acknowledgements E's ranks give F's ranks.
- An acknowledgement `Ack(by, rank, seq)` says: rank `by` heard `rank` with stamp `seq` or later,
  so it will not declare `rank` lost before ``stamp time + lease``. `rank` fences its writes to
  `by` at ``stamps[seq] + lease`` (leases.py: the same rule, the same proof), however many hops
  the stamp and the acknowledgement took.
- A rank declares a linked remote rank lost when its latest stamp's `heard` is older than the
  lease (up to `looked`, as leases.py), and stops writing to a remote rank whose fence ran out.

Why a dead rank is still noticed within its lease: its stamps stop; the last one's `heard` is no
later than its death plus the transit times, and every receiver judges silence from `heard`, not
from when the relay delivered it. A live rank's stamp reaches every rank linked to it within one
sibling beat, one engine slot (two when a speaker died) and one more sibling beat, plus transit:
with the default 1 s and 10 s at most 1 + 2 x 1.25 + 1 = 4.5 s old, well inside the lease. The
fence chain (the stamp there, the acknowledgement back) is at most twice that, so a writer keeps
more than 1 s of fence (5.5 s when no speaker died) against its own or its peers' lateness.

What it costs: a rank sends and receives, per peer engine, about one beat each way per slot
divided by the number of its engine's ranks linked to that engine, plus 2 x (siblings) /
sibling_every. A rank alone in its engine (TP 1) with E peer engines sends and receives at most
2 x E a second up to 20 peer engines, 40 up to 25, then 1.6 x E (with the default 1 s and 10 s;
that is 2 x E / slot) (43.2 for a decode rank of TP 1 with 27 prefill engines, 51.2 with 32). A rank
of TP 8 with 32 peer engines: about 3 engine beats and 7 sibling beats a second each way. Beats
get larger instead (a few hundred records to a sibling of a rank with many peer engines).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field

from .kinds import StrKind
from .leases import HEARTBEATS_PER_S
from .messages import Ack, EngineBeat, Vouch


class LeaseMode(StrKind):
    """Which liveness a rank runs (EngineConfig.leases, env KVSTAGE_LEASES): every engine of a
    fleet runs the same one."""

    RANK = "rank"           # one lease per pair of connected ranks (leases.py, Heartbeat)
    ENGINE = "engine"       # one lease per pair of engines, the ranks of an engine vouching for each other


def check_engine_timeouts(heartbeat: float, lease: float) -> None:
    """Engine-pair leases need the beats to fit in the lease (EngineLeases' own check, said in
    the configuration's names): ValueError otherwise."""
    if heartbeat > lease / 8:
        raise ValueError(f"engine-pair leases (leases='engine', KVSTAGE_LEASES) need timeouts.heartbeat <= "
                         f"timeouts.lease / 8 (a beat relayed through a sibling and a peer engine must still "
                         f"fit in the lease twice), got heartbeat={heartbeat:g}, lease={lease:g}")


class BeatKind(StrKind):
    SIBLING = "sibling"     # to a rank of our own engine
    ENGINE = "engine"       # to a rank of a peer engine


class LossKind(StrKind):
    SILENT = "silent"       # no stamp of it heard within the lease
    FENCED = "fenced"       # we write to it and its acknowledgements stopped


@dataclass(frozen=True)
class SendBeat:
    to: int                 # the receiver's incarnation
    kind: BeatKind
    beat: EngineBeat


@dataclass(frozen=True)
class PeerLost:
    rank: int
    kind: LossKind
    reason: str


def engine_interval(peer_engines: int, *, base: float, lease: float, per_s: float = HEARTBEATS_PER_S) -> float:
    """Seconds per engine-pair slot: `base` while a rank speaking to every peer engine in every
    slot would send at most `per_s` a second, else peer_engines / per_s, capped at an eighth of
    the lease (the fence chain is up to about four slots and two sibling beats), never below base."""
    if per_s <= 0 or base <= 0 or lease <= 0:
        raise ValueError("the heartbeat interval, the lease and the heartbeat rate must be positive")
    return max(base, min(peer_engines / per_s, lease / 8))


@dataclass
class _Seen:
    seq: int
    heard: float            # local time, never earlier than when the stamp left its rank


@dataclass
class _Remote:
    engine: str
    fence: float            # our stamp time the peer acknowledged (connect time at first)
    seen: _Seen


@dataclass
class _Sibling:
    seen: _Seen
    links: dict[str, frozenset[int]] = field(default_factory=dict)
    everies: dict[str, float] = field(default_factory=dict)   # what peer engines told it their slot is
    beat_due: float = 0.0


class EngineLeases:
    """The liveness of one rank: its stamps, its siblings, the remote ranks it is linked to.

    Inputs: `set_siblings`, `connect` / `disconnect`, `on_beat`; outputs: `beats` (what to send
    now) and `verdicts` (remote ranks to declare lost). Invariants: a remote rank's `heard` only
    grows; an acknowledgement we send names only a stamp whose `heard` we hold; our fence on a
    peer is the time of a stamp of ours that peer acknowledged."""

    MAX_STAMPS = 4096

    def __init__(self, *, me: int, engine: str, lease: float, sibling_every: float, base: float, now: float,
                 per_s: float = HEARTBEATS_PER_S):
        if lease <= 0 or sibling_every <= 0 or base <= 0 or per_s <= 0:
            raise ValueError("the lease, the beat intervals and the rate must be positive")
        if sibling_every > lease / 4 or base > lease / 8:
            raise ValueError("beats must fit in the lease: sibling_every <= lease / 4, base <= lease / 8")
        self.me, self.engine, self.lease = me, engine, lease
        self.sibling_every, self.base, self.per_s = sibling_every, base, per_s
        self.seq = 0
        self.stamps: OrderedDict[int, float] = OrderedDict({0: now})
        self.siblings: dict[int, _Sibling] = {}
        self.remotes: dict[int, _Remote] = {}
        self.relayed: dict[int, _Seen] = {}         # stamps of remote ranks we are not linked to
        self.acks: dict[tuple[int, int], int] = {}  # (by, rank) -> seq, to carry on
        self._slot: dict[str, int] = {}             # peer engine -> the last slot we spoke in
        self._turn: dict[str, int] = {}             # peer engine -> which linked rank is next
        self._told: dict[str, float] = {}           # peer engine -> the slot length it told us

    # -- inputs ---------------------------------------------------------------------------------
    def set_siblings(self, ranks: set[int], now: float) -> None:
        """The other ranks of our engine (their incarnations), as the rendezvous names them."""
        for gone in set(self.siblings) - ranks:
            del self.siblings[gone]
        for r in ranks - set(self.siblings) - {self.me}:
            self.siblings[r] = _Sibling(seen=_Seen(0, now), beat_due=now)

    def connect(self, rank: int, engine: str, now: float, since: float | None = None) -> None:
        """A remote rank we are now connected to: its lease starts now, our fence at `since`
        (None: now), when the connection's lease began here (no later than now: a fence may only
        start earlier than the peer's lease of us, never later)."""
        if engine == self.engine:
            raise ValueError("a rank of our own engine is a sibling, not a remote rank")
        if since is not None and since > now:
            raise ValueError("a fence cannot start after now")
        old = self.relayed.pop(rank, None)
        seen = _Seen(old.seq, max(old.heard, now)) if old is not None else _Seen(0, now)
        self.remotes[rank] = _Remote(engine=engine, fence=now if since is None else since, seen=seen)

    def disconnect(self, rank: int) -> None:
        self.remotes.pop(rank, None)
        self.relayed.pop(rank, None)
        for key in [k for k in self.acks if rank in k]:
            del self.acks[key]

    def on_beat(self, beat: EngineBeat, now: float) -> None:
        if beat.sibling and beat.src in self.siblings:
            sib = self.siblings[beat.src]
            sib.links = {e: frozenset(rs) for e, rs in beat.links.items()}
            sib.everies = dict(beat.everies)
        elif not beat.sibling and beat.src in self.remotes and beat.every > 0:
            self._told[self.remotes[beat.src].engine] = beat.every
        for v in beat.vouches:
            self._seen(v.rank, v.seq, now - max(0.0, v.age))
        for a in beat.acks:
            if a.rank == self.me:
                remote = self.remotes.get(a.by)
                stamped = self.stamps.get(a.seq)
                if remote is not None and stamped is not None and stamped > remote.fence:
                    remote.fence = stamped
            elif a.seq > self.acks.get((a.by, a.rank), -1):
                self.acks[(a.by, a.rank)] = a.seq

    # -- outputs --------------------------------------------------------------------------------
    def beats(self, now: float, clock: float) -> list[SendBeat]:
        """The beats due at `now` (monotonic time); `clock` (wall time) picks the engine slot."""
        out: list[SendBeat] = []
        for r, remote in self.remotes.items():   # we acknowledge the latest stamp we hold of each
            if remote.seen.seq > 0:
                self.acks[(self.me, r)] = remote.seen.seq
        ranks_of = self._ranks_of()
        if any(now >= sib.beat_due for sib in self.siblings.values()):
            self._forget(ranks_of)
        for r, sib in self.siblings.items():
            if now >= sib.beat_due:
                sib.beat_due = now + self.sibling_every
                out.append(SendBeat(r, BeatKind.SIBLING, self._to_sibling(r, ranks_of, now)))
        own = engine_interval(len(ranks_of), base=self.base, lease=self.lease, per_s=self.per_s)
        for engine, linked in self._linked_engines().items():
            slot = math.floor(clock / self.slot_length(engine, own))
            if self._slot.get(engine) == slot:
                continue
            speakers = self._speakers(engine, now)
            if speakers[(slot + _mix(engine)) % len(speakers)] != self.me:
                continue
            self._slot[engine] = slot
            turn = self._turn.get(engine, 0)
            self._turn[engine] = turn + 1
            to = linked[turn % len(linked)]
            out.append(SendBeat(to, BeatKind.ENGINE, self._to_engine(to, engine, ranks_of[engine], own, now)))
        return out

    def slot_length(self, engine: str, own: float) -> float:
        """Our slot towards `engine`: our own (`own`), or what that engine told us or a sibling
        when longer (up to an eighth of the lease)."""
        told = max([self._told.get(engine, 0.0)] + [s.everies.get(engine, 0.0) for s in self.siblings.values()])
        return max(own, min(told, self.lease / 8))

    def verdicts(self, now: float, looked: float | None = None, writes: bool = False) -> list[PeerLost]:
        """Remote ranks to declare lost now: silent past the lease (judged up to `looked`, as
        leases.py), or, when we write to them (`writes`), our fence on them ran out. A rank stays
        in the verdicts until the shell `disconnect`s it."""
        upto = now if looked is None else min(now, looked)
        out = []
        for rank, remote in self.remotes.items():
            if upto - remote.seen.heard > self.lease:
                out.append(PeerLost(rank, LossKind.SILENT, f"no stamp of it heard for {self.lease:g} s (lease expired)"))
            elif writes and not self.may_write(rank, now):
                out.append(PeerLost(rank, LossKind.FENCED, (
                    f"its acknowledgements stopped (write lease expired: the last stamp of ours it acknowledged is "
                    f"{now - remote.fence:.1f} s old, lease {self.lease:g} s; it was last heard "
                    f"{now - remote.seen.heard:.1f} s ago)")))
        return out

    def may_write(self, rank: int, now: float) -> bool:
        remote = self.remotes.get(rank)
        return remote is not None and now < remote.fence + self.lease

    def heard(self, rank: int) -> float | None:
        """When we last know the rank was alive (None: not linked)."""
        remote = self.remotes.get(rank)
        return remote.seen.heard if remote is not None else None

    # -- the rule's parts -----------------------------------------------------------------------
    def _stamp(self, now: float) -> Vouch:
        if now > self.stamps[self.seq]:
            self.seq += 1
            self.stamps[self.seq] = now
            while len(self.stamps) > self.MAX_STAMPS:
                self.stamps.popitem(last=False)
        return Vouch(self.me, self.seq, 0.0)

    def _seen(self, rank: int, seq: int, heard: float) -> None:
        if rank == self.me:
            return
        sib = self.siblings.get(rank)
        remote = self.remotes.get(rank)
        seen = sib.seen if sib is not None else remote.seen if remote is not None else self.relayed.get(rank)
        if seen is None:
            self.relayed[rank] = _Seen(seq, heard)
            return
        if seq > seen.seq:
            seen.seq = seq
        if heard > seen.heard:
            seen.heard = heard

    def _forget(self, ranks_of: dict[str, set[int]]) -> None:
        """Drop the stamps and acknowledgements of remote ranks that neither we nor a sibling
        are connected to any more (they died, or their connections ended)."""
        known: set[int] = set().union(*ranks_of.values()) if ranks_of else set()
        for r in [r for r in self.relayed if r not in known]:
            del self.relayed[r]
        mine = {self.me, *self.siblings}
        for key in [k for k in self.acks if (k[1] if k[0] in mine else k[0]) not in known]:
            del self.acks[key]

    def _linked_engines(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for r, remote in sorted(self.remotes.items()):
            out.setdefault(remote.engine, []).append(r)
        return out

    def _speakers(self, engine: str, now: float) -> list[int]:
        """Our engine's ranks that take turns speaking to `engine`: us, and the siblings heard
        within two sibling beats that are linked to it."""
        fresh = 2 * self.sibling_every + self.sibling_every / 2
        return sorted([self.me] + [r for r, s in self.siblings.items()
                                   if engine in s.links and now - s.seen.heard <= fresh])

    def _vouch(self, rank: int, seen: _Seen, now: float) -> Vouch:
        return Vouch(rank, seen.seq, max(0.0, now - seen.heard))

    def _ranks_of(self) -> dict[str, set[int]]:
        """Peer engine -> its ranks linked to us or to a sibling."""
        out: dict[str, set[int]] = {}
        for r, remote in self.remotes.items():
            out.setdefault(remote.engine, set()).add(r)
        for s in self.siblings.values():
            for engine, rs in s.links.items():
                out.setdefault(engine, set()).update(rs)
        return out

    def _to_sibling(self, to: int, ranks_of: dict[str, set[int]], now: float) -> EngineBeat:
        """Our stamp and links; the stamps of the remote ranks it is linked to; the
        acknowledgements addressed to it, and our engine's to every rank of the engines it is
        linked to (it may be the one to speak to them)."""
        sib = self.siblings[to]
        vouches = [self._stamp(now)]
        for rs in sib.links.values():
            for r in rs:
                seen = self.remotes[r].seen if r in self.remotes else self.relayed.get(r)
                if seen is not None and seen.seq > 0:
                    vouches.append(self._vouch(r, seen, now))
        spoken: set[int] = set()
        for engine in sib.links:
            spoken |= ranks_of.get(engine, set())
        acks = [Ack(by, rank, seq) for (by, rank), seq in self.acks.items()
                if rank == to or (by != to and rank in spoken)]
        links: dict[str, list[int]] = {}
        for r, remote in self.remotes.items():
            links.setdefault(remote.engine, []).append(r)
        return EngineBeat(src=self.me, dst=to, vouches=vouches, acks=acks, links=links, everies=dict(self._told),
                          sibling=True)

    def _to_engine(self, to: int, engine: str, theirs: set[int], own: float, now: float) -> EngineBeat:
        """Our stamp and those of our siblings linked to `engine`; our engine's acknowledgements
        to its ranks (`theirs`)."""
        vouches = [self._stamp(now)] + [self._vouch(r, s.seen, now) for r, s in self.siblings.items()
                                        if engine in s.links and s.seen.seq > 0]
        acks = [Ack(by, rank, seq) for (by, rank), seq in self.acks.items() if rank in theirs]
        return EngineBeat(src=self.me, dst=to, vouches=vouches, acks=acks, every=own)


def _mix(engine: str) -> int:
    """A stable spread of the engines over the speakers' turns (not Python's salted hash)."""
    return sum(engine.encode()) * 2654435761 % (1 << 16)
