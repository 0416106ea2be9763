"""The rendezvous state: engines -> ranks, and every decision about them. Pure (sans-IO).

No sockets, threads or clock reads: the caller passes the time (``now``, a monotonic clock for
leases; ``wall`` for the registration timestamp it reports). Decisions are return values or a
`Refused` exception carrying an error kind and a reason for the Error reply.

Rules (docs/bootstrap.md has the long form):
- A rank is the key (engine_id, tp_rank). The same incarnation registering again keeps its
  record and epoch (idempotent); a different incarnation gets a new, larger epoch and replaces
  it. Epochs come from one counter that starts at ``epoch_base`` (the server derives it from its
  start time, so they also grow across server restarts) and never goes down.
- A rank that registers with ``epoch_hint`` (the epoch it held before) while the registry has
  no record of it gets that epoch back (a server restart must not look like a rank restart),
  unless a later record of that rank was removed here since (tombstones).
- All ranks of an engine agree on role and tp_size. A registration that disagrees is refused
  while any other rank of the engine is live; once they are all stale or gone, it replaces the
  engine (an engine restarted with another shape).
- A rank not heard from for ``lease_s`` is stale: left out of lookups, its heartbeats answered
  "stale" until it registers again. After ``forget_s`` it is removed.
- Counts are bounded (`Limits`); stale records are evicted to make room, else `Refused("full")`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import msgspec

from .messages import MAX_ID, RankEntry, RecordEntry, StatusRow

Key = tuple[str, int]  # (engine_id, tp_rank)


class Refused(Exception):
    """A request the registry will not apply; ``kind`` is an Error-reply kind."""

    def __init__(self, kind: str, text: str):
        super().__init__(f"{kind}: {text}")
        self.kind = kind
        self.text = text


@dataclass(frozen=True)
class Limits:
    max_engines: int = 1024
    max_ranks_per_engine: int = 256   # also the largest tp_size accepted
    max_ranks: int = 4096             # over all engines

    def __post_init__(self):
        for name in ("max_engines", "max_ranks_per_engine", "max_ranks"):
            if getattr(self, name) < 1:
                raise ValueError(f"Limits.{name} must be >= 1")


@dataclass
class _Slot:
    entry: RankEntry
    epoch: int
    registered_at: float
    last_seen: float
    reported_stale: bool = False

    def record(self) -> RecordEntry:
        return RecordEntry(**msgspec.structs.asdict(self.entry), epoch=self.epoch,
                           registered_at=self.registered_at)


@dataclass
class _Engine:
    role: str
    tp_size: int
    ranks: dict[int, _Slot] = field(default_factory=dict)


@dataclass(frozen=True)
class LookupResult:
    engine_id: str
    known: bool
    role: str = ""
    tp_size: int = 0
    records: tuple[RecordEntry, ...] = ()
    missing: tuple[int, ...] = ()
    stale: tuple[int, ...] = ()

    @property
    def complete(self) -> bool:
        return self.known and not self.missing


@dataclass(frozen=True)
class SweepResult:
    went_stale: tuple[Key, ...] = ()
    forgotten: tuple[Key, ...] = ()


class Registry:
    def __init__(self, lease_s: float = 10.0, forget_s: float | None = None,
                 limits: Limits = Limits(), epoch_base: int = 0):
        if lease_s <= 0:
            raise ValueError("lease_s must be > 0")
        forget_s = 6 * lease_s if forget_s is None else forget_s
        if forget_s < lease_s:
            raise ValueError("forget_s must be >= lease_s")
        if not 0 <= epoch_base < MAX_ID // 2:
            raise ValueError("epoch_base out of range")
        self.lease_s = lease_s
        self.forget_s = forget_s
        self.limits = limits
        self._epoch = epoch_base
        self._engines: dict[str, _Engine] = {}
        self._nranks = 0
        self._tombstones: OrderedDict[Key, int] = OrderedDict()  # last epoch of removed ranks

    # ---- queries ----------------------------------------------------------------------

    @property
    def num_engines(self) -> int:
        return len(self._engines)

    @property
    def num_ranks(self) -> int:
        return self._nranks

    @property
    def last_epoch(self) -> int:
        return self._epoch

    def _stale(self, slot: _Slot, now: float) -> bool:
        return now - slot.last_seen > self.lease_s

    def lookup(self, engine_id: str, now: float) -> LookupResult:
        eng = self._engines.get(engine_id)
        if eng is None:
            return LookupResult(engine_id, known=False)
        records, missing, stale = [], [], []
        for r in range(eng.tp_size):
            slot = eng.ranks.get(r)
            if slot is not None and not self._stale(slot, now):
                records.append(slot.record())
            else:
                missing.append(r)
                if slot is not None:
                    stale.append(r)
        return LookupResult(engine_id, True, eng.role, eng.tp_size, tuple(records),
                            tuple(missing), tuple(stale))

    def rows(self, now: float) -> list[StatusRow]:
        out = []
        for eid in sorted(self._engines):
            eng = self._engines[eid]
            for r in sorted(eng.ranks):
                s = eng.ranks[r]
                out.append(StatusRow(
                    engine_id=eid, role=eng.role, tp_size=eng.tp_size, tp_rank=r,
                    epoch=s.epoch, incarnation=s.entry.incarnation,
                    ctrl_endpoint=s.entry.ctrl_endpoint, backend=s.entry.backend,
                    age_s=max(0.0, now - s.last_seen), stale=self._stale(s, now), dp_rank=s.entry.dp_rank))
        return out

    # ---- updates ----------------------------------------------------------------------

    def register(self, entry: RankEntry, now: float, *, epoch_hint: int = 0,
                 wall: float | None = None) -> tuple[RecordEntry, bool]:
        """Apply a registration. Returns (record, fresh); fresh is False for an idempotent
        re-registration of the incarnation that already holds the rank."""
        eid, r = entry.engine_id, entry.tp_rank
        if entry.tp_size > self.limits.max_ranks_per_engine:
            raise Refused("full", f"tp_size {entry.tp_size} exceeds this server's limit of "
                                  f"{self.limits.max_ranks_per_engine} ranks per engine")
        if not 0 <= r < entry.tp_size:
            raise Refused("bad_request", f"tp_rank {r} is outside 0..{entry.tp_size - 1}")
        eng = self._engines.get(eid)
        slot = eng.ranks.get(r) if eng is not None else None
        if slot is not None and slot.entry.incarnation == entry.incarnation:
            if slot.entry != entry:
                raise Refused("conflict", (
                    f"rank {eid!r}/{r} incarnation {entry.incarnation} is already registered "
                    "with different details; a new process must use a new incarnation"))
            slot.last_seen = max(slot.last_seen, now)
            slot.reported_stale = False
            return slot.record(), False

        if eng is not None and (eng.role, eng.tp_size) != (entry.role, entry.tp_size):
            blockers = sorted(k for k, s in eng.ranks.items()
                              if k != r and not self._stale(s, now))
            if blockers:
                raise Refused("conflict", (
                    f"engine {eid!r} is registered as {eng.role} tp_size={eng.tp_size} with "
                    f"live ranks {blockers}; this rank says {entry.role} tp_size={entry.tp_size}"
                    " (the engine can change shape once its old ranks are gone or stale)"))
            self._drop_engine(eid)  # every old rank is stale, or this rank replaces it
            eng = slot = None

        if eng is None:
            self._make_room_for_engine(eid, now)
        if slot is None:
            self._make_room_for_rank(now)
        eng = self._engines.get(eid)  # room-making may have dropped an all-stale engine
        if eng is None:
            eng = self._engines[eid] = _Engine(entry.role, entry.tp_size)
        epoch = self._next_epoch(eid, r, epoch_hint if slot is None else 0)
        if slot is None:
            self._nranks += 1
        self._tombstones.pop((eid, r), None)
        eng.ranks[r] = _Slot(entry, epoch, now if wall is None else wall, now)
        return eng.ranks[r].record(), True

    def heartbeat(self, engine_id: str, tp_rank: int, incarnation: int, now: float) -> str:
        """ok | unknown | stale | superseded. Only "ok" refreshes the lease."""
        eng = self._engines.get(engine_id)
        slot = eng.ranks.get(tp_rank) if eng is not None else None
        if slot is None:
            return "unknown"
        if slot.entry.incarnation != incarnation:
            return "superseded"
        if self._stale(slot, now):
            return "stale"
        slot.last_seen = max(slot.last_seen, now)
        return "ok"

    def deregister(self, engine_id: str, tp_rank: int, incarnation: int) -> bool:
        eng = self._engines.get(engine_id)
        slot = eng.ranks.get(tp_rank) if eng is not None else None
        if slot is None or slot.entry.incarnation != incarnation:
            return False
        self._drop_rank(engine_id, tp_rank)
        return True

    def sweep(self, now: float) -> SweepResult:
        """Mark newly stale ranks (reported once) and forget ranks silent for ``forget_s``."""
        went_stale, forgotten = [], []
        for eid in list(self._engines):
            for r, slot in list(self._engines[eid].ranks.items()):
                if now - slot.last_seen > self.forget_s:
                    forgotten.append((eid, r))
                    self._drop_rank(eid, r)
                elif self._stale(slot, now) and not slot.reported_stale:
                    slot.reported_stale = True
                    went_stale.append((eid, r))
        return SweepResult(tuple(went_stale), tuple(forgotten))

    # ---- internals --------------------------------------------------------------------

    def _next_epoch(self, eid: str, r: int, hint: int) -> int:
        if 0 < hint <= MAX_ID and hint >= self._tombstones.get((eid, r), 0):
            self._epoch = max(self._epoch, hint)
            return hint
        self._epoch += 1
        return self._epoch

    def _drop_rank(self, eid: str, r: int) -> None:
        eng = self._engines[eid]
        slot = eng.ranks.pop(r)
        self._nranks -= 1
        self._tombstones[(eid, r)] = slot.epoch
        self._tombstones.move_to_end((eid, r))
        while len(self._tombstones) > self.limits.max_ranks:
            self._tombstones.popitem(last=False)
        if not eng.ranks:
            del self._engines[eid]

    def _drop_engine(self, eid: str) -> None:
        for r in list(self._engines[eid].ranks):
            self._drop_rank(eid, r)

    def _make_room_for_engine(self, eid: str, now: float) -> None:
        if len(self._engines) < self.limits.max_engines:
            return
        victims = [(max(s.last_seen for s in e.ranks.values()), k)
                   for k, e in self._engines.items()
                   if all(self._stale(s, now) for s in e.ranks.values())]
        if not victims:
            raise Refused("full", f"engine table full ({self.limits.max_engines} engines, none "
                                  f"stale); cannot add engine {eid!r}")
        self._drop_engine(min(victims)[1])

    def _make_room_for_rank(self, now: float) -> None:
        if self._nranks < self.limits.max_ranks:
            return
        victims = [(s.last_seen, eid, r) for eid, e in self._engines.items()
                   for r, s in e.ranks.items() if self._stale(s, now)]
        if not victims:
            raise Refused("full", f"rank table full ({self.limits.max_ranks} ranks, none stale)")
        _, eid, r = min(victims)
        self._drop_rank(eid, r)
