"""The etcd rendezvous' keys, values and decisions. Pure (sans-IO): no client, no clock reads.

Key layout under a namespace ``NS`` (docs/bootstrap.md, "etcd"): one key per rank,

    /NS/ranks/<engine id, percent-encoded>/<tp_rank>

so an engine's ranks are one prefix (an engine id may contain "/": it is encoded, and "a" never
shares a prefix with "a/b"). The value is a versioned msgspec JSON record (`EtcdRecord`), never
pickle: readable with ``etcdctl get``, and decoded against the same bounds the bootstrap server
enforces (bootstrap/messages.py), so a foreign or oversized value is refused, not misread.

What the etcd client decides here: whether a registration may be written (`register_verdict`),
whether a lookup is complete (`read_engine`), and which ranks a watch event takes away from the
engines this client looked up (`WatchedRanks`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from urllib.parse import quote, unquote

import msgspec

from ..wire import prebuild_struct_info
from .messages import RankEntry, RecordEntry

RECORD_VERSION = 1


class EtcdRecord(msgspec.Struct, frozen=True, kw_only=True):
    """The value of one rank's key. ``epoch``: the store's revision when this incarnation first
    registered, plus one (grows with every new incarnation of the rank); ``registered_at``: the
    registering rank's wall clock."""

    v: int = RECORD_VERSION
    rank: RankEntry
    epoch: int
    registered_at: float

    def wire(self) -> RecordEntry:
        return RecordEntry(**msgspec.structs.asdict(self.rank), epoch=self.epoch,
                           registered_at=self.registered_at)


class _Version(msgspec.Struct):
    v: int = 0


_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(EtcdRecord)


def encode_record(record: EtcdRecord) -> bytes:
    return _ENCODER.encode(record)


def decode_record(value: bytes) -> EtcdRecord:
    """ValueError saying what is wrong: not JSON, another layout version, or out of bounds."""
    try:
        version = msgspec.json.decode(value, type=_Version).v
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"not a kvstage rank record: {exc}") from None
    if version != RECORD_VERSION:
        raise ValueError(f"rank record version {version}, this kvstage reads version {RECORD_VERSION}")
    try:
        return _DECODER.decode(value)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"malformed rank record: {exc}") from None


# ---- keys ----------------------------------------------------------------------------------------

def ranks_prefix(namespace: str) -> str:
    """Every rank of every engine under the namespace."""
    return f"/{namespace}/ranks/"


def engine_prefix(namespace: str, engine_id: str) -> str:
    return f"{ranks_prefix(namespace)}{quote(engine_id, safe='')}/"


def rank_key(namespace: str, engine_id: str, tp_rank: int) -> str:
    return f"{engine_prefix(namespace, engine_id)}{tp_rank}"


@dataclass(frozen=True)
class ParsedKey:
    """The rank a rank key names."""

    engine_id: str
    tp_rank: int


def parse_key(namespace: str, key: str) -> ParsedKey | None:
    """The rank of a rank key under the namespace, None for any other key."""
    root = ranks_prefix(namespace)
    if not key.startswith(root):
        return None
    engine, sep, rank = key[len(root):].rpartition("/")
    if not sep or not engine or "/" in engine or not rank.isdigit():
        return None
    return ParsedKey(unquote(engine), int(rank))


def prefix_end(prefix: str) -> str:
    """The first key after every key that starts with `prefix` (etcd's range_end for a prefix).
    Our prefixes are ASCII and end with "/", so the last character just moves up by one."""
    if not prefix or not prefix.isascii() or prefix[-1] == "\x7f":
        raise ValueError(f"not a kvstage key prefix: {prefix!r}")
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


# ---- registration ----------------------------------------------------------------------------------

class Verdict(enum.Enum):
    NEW = "new"              # no record of this rank: write it with a fresh epoch
    SAME = "same"            # this incarnation already holds it: rewrite, keeping its epoch
    REPLACE = "replace"      # another incarnation holds it: this one takes over (fresh epoch)
    CONFLICT = "conflict"    # refused, see the reason


@dataclass(frozen=True)
class RegisterDecision:
    verdict: Verdict
    epoch: int = 0
    reason: str = ""


def register_verdict(entry: RankEntry, existing: dict[int, EtcdRecord], revision: int) -> RegisterDecision:
    """May `entry` be written, given the engine's records read at store revision `revision`?

    The rules of the bootstrap server (bootstrap/registry.py), where every record is live (etcd
    removes a rank when its lease runs out): the same incarnation with other details is a
    conflict (a new process must pick a new incarnation); a rank whose engine has other ranks of
    another role or TP size is a conflict until those are gone.
    """
    mine = existing.get(entry.tp_rank)
    if mine is not None and mine.rank.incarnation == entry.incarnation:
        if mine.rank != entry:
            return RegisterDecision(Verdict.CONFLICT, reason=(
                f"rank {entry.engine_id!r}/{entry.tp_rank} incarnation {entry.incarnation} is already "
                "registered with different details; a new process must use a new incarnation"))
    blockers = sorted(r for r, rec in existing.items()
                      if r != entry.tp_rank and (rec.rank.role, rec.rank.tp_size) != (entry.role, entry.tp_size))
    if blockers:
        other = existing[blockers[0]].rank
        return RegisterDecision(Verdict.CONFLICT, reason=(
            f"engine {entry.engine_id!r} is registered as {other.role} tp_size={other.tp_size} with live "
            f"ranks {blockers}; this rank says {entry.role} tp_size={entry.tp_size} (the engine can change "
            "shape once its old ranks are gone: deregistered, or their leases ran out)"))
    if mine is None:
        return RegisterDecision(Verdict.NEW, epoch=revision + 1)
    if mine.rank.incarnation == entry.incarnation:
        return RegisterDecision(Verdict.SAME, epoch=mine.epoch)
    return RegisterDecision(Verdict.REPLACE, epoch=revision + 1)


# ---- lookups ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class EngineRead:
    """An engine's ranks as read from the store: complete when every rank of its TP size is there."""

    engine_id: str
    records: tuple[EtcdRecord, ...] = ()     # the ranks of the engine's shape, sorted by tp_rank
    missing: tuple[int, ...] = ()
    tp_size: int = 0
    role: str = ""
    unreadable: tuple[str, ...] = ()         # keys whose value could not be read, with why

    @property
    def known(self) -> bool:
        return bool(self.records)

    @property
    def complete(self) -> bool:
        return self.known and not self.missing

    def describe(self, where: str) -> str:
        """Why the lookup is not complete (for the timeout error)."""
        if not self.known:
            text = f"engine {self.engine_id!r} is unknown at {where} (no rank registered)"
        else:
            text = (f"{self.role} engine {self.engine_id!r} tp_size={self.tp_size} has ranks "
                    f"{[r.rank.tp_rank for r in self.records]}, missing ranks {list(self.missing)}")
        if self.unreadable:
            text += f"; unreadable records: {'; '.join(self.unreadable)}"
        return text


def read_engine(engine_id: str, values: dict[int, bytes | EtcdRecord]) -> EngineRead:
    """The engine's state from its keys' values by tp_rank. Its shape (role, TP size) is the one
    of its newest record (largest epoch); ranks of another shape are left out, as missing."""
    records: dict[int, EtcdRecord] = {}
    unreadable = []
    for rank, value in sorted(values.items()):
        try:
            rec = value if isinstance(value, EtcdRecord) else decode_record(value)
        except ValueError as exc:
            unreadable.append(f"rank {rank}: {exc}")
            continue
        if rec.rank.engine_id != engine_id or rec.rank.tp_rank != rank:
            unreadable.append(f"rank {rank}: the record names {rec.rank.engine_id!r}/{rec.rank.tp_rank}")
            continue
        records[rank] = rec
    if not records:
        return EngineRead(engine_id, unreadable=tuple(unreadable))
    newest = max(records.values(), key=lambda r: r.epoch).rank
    shaped = [records[r] for r in sorted(records)
              if r < newest.tp_size and (records[r].rank.role, records[r].rank.tp_size) == (newest.role, newest.tp_size)]
    have = {r.rank.tp_rank for r in shaped}
    return EngineRead(engine_id, tuple(shaped), tuple(r for r in range(newest.tp_size) if r not in have),
                      newest.tp_size, newest.role, tuple(unreadable))


# ---- watching the ranks this client looked up ---------------------------------------------------

@dataclass(frozen=True)
class RankGone:
    """A rank incarnation the rendezvous no longer holds (its key deleted or taken over)."""

    engine_id: str
    tp_rank: int
    incarnation: int
    reason: str


@dataclass(frozen=True)
class Sighting:
    """A rank's incarnation as a read of etcd found it, and its key's mod_revision then."""

    incarnation: int
    revision: int


@dataclass
class _Seen:
    incarnation: int
    revision: int       # the key's mod_revision when we saw it


class WatchedRanks:
    """The ranks of the engines this client looked up, kept up to date by the watch.

    A delete event of a remembered key, or a put that names another incarnation, newer than what
    was seen, takes that incarnation away and is reported once as a `RankGone`. Events about keys
    of engines never looked up are ignored; an event older than what a lookup saw changes nothing.
    """

    def __init__(self, namespace: str):
        self.namespace = namespace
        self._ranks: dict[ParsedKey, _Seen] = {}

    def __len__(self) -> int:
        return len(self._ranks)

    def engines(self) -> set[str]:
        return {k.engine_id for k in self._ranks}

    def remember(self, engine_id: str, ranks: dict[int, Sighting]) -> None:
        """A lookup's result, by tp_rank; newer knowledge wins."""
        for rank, got in ranks.items():
            key = ParsedKey(engine_id, rank)
            seen = self._ranks.get(key)
            if seen is None or got.revision >= seen.revision:
                self._ranks[key] = _Seen(got.incarnation, got.revision)

    def on_delete(self, key: str, revision: int, why: str) -> RankGone | None:
        where = parse_key(self.namespace, key)
        seen = self._ranks.get(where) if where else None
        if where is None or seen is None or revision <= seen.revision:
            return None
        del self._ranks[where]
        return RankGone(where.engine_id, where.tp_rank, seen.incarnation, why)

    def on_put(self, key: str, value: bytes, revision: int) -> RankGone | None:
        where = parse_key(self.namespace, key)
        seen = self._ranks.get(where) if where else None
        if where is None or seen is None or revision <= seen.revision:
            return None
        try:
            inc = decode_record(value).rank.incarnation
        except ValueError:
            return None   # not ours to judge: the next lookup reports it
        if inc == seen.incarnation:
            seen.revision = revision
            return None
        self._ranks[where] = _Seen(inc, revision)
        return RankGone(where.engine_id, where.tp_rank, seen.incarnation,
                        f"its rendezvous record in etcd was taken over by incarnation {inc} (the rank restarted)")

    def resync(self, engine_id: str, now: dict[int, Sighting], why: str) -> list[RankGone]:
        """After the watch could not resume (history compacted): compare with a fresh read of the
        engine, by tp_rank; whatever is no longer there is gone."""
        gone = []
        for key, seen in list(self._ranks.items()):
            if key.engine_id != engine_id:
                continue
            cur = now.get(key.tp_rank)
            if cur is None or cur.incarnation != seen.incarnation:
                gone.append(RankGone(key.engine_id, key.tp_rank, seen.incarnation, why))
                del self._ranks[key]
        self.remember(engine_id, now)
        return gone


prebuild_struct_info(globals())  # last: every Struct above is defined (see kvstage.wire)
