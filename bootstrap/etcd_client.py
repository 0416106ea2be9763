"""The etcd rendezvous: the bootstrap client's interface (bootstrap/rendezvous.py) on an etcd cluster.

Each registered rank is one key (bootstrap/etcd_records.py) attached to its own etcd lease with
the address' TTL: the keepalive thread renews the leases, `deregister` and `close` revoke them
(the key goes at once), and a rank that dies stops renewing, so etcd deletes its key when the
TTL runs out. Lookups read an engine's keys until all its ranks are there, like the bootstrap
client's. After the first lookup a watch on the namespace follows the ranks looked up: a key
deleted (lease expired or revoked) or taken over by another incarnation is reported to the
`on_gone` callbacks, which the decode side turns into a lost peer (transfer/engine).

Threads: the keepalive thread waits on an Event between rounds; the watch thread blocks in its
stream's socket (bootstrap/etcd_watch.py). Requests go to whichever member answers
(bootstrap/etcd_members.py), each bounded by ``request_timeout_s``.
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from etcd3gw import exceptions as etcd_exc
from etcd3gw.lease import Lease

from .client import BootstrapError, RankInfo, RankRecord, keep_round, poll_lookup
from .etcd_config import EtcdConfig, parse_etcd_url
from .etcd_members import Members
from .etcd_records import (
    EtcdRecord,
    RankGone,
    Sighting,
    Verdict,
    WatchedRanks,
    decode_record,
    encode_record,
    engine_prefix,
    parse_key,
    prefix_end,
    rank_key,
    ranks_prefix,
    read_engine,
    register_verdict,
)
from .etcd_watch import PrefixWatch, WatchEvent

log = logging.getLogger("kvstage.bootstrap.etcd")

_RACES = 8          # registration attempts when another writer changes the key between read and write
                    # (or the lease runs out before the write)
_LEASE_NOT_FOUND = "requested lease not found"   # etcd's answer to a put naming an expired lease


@dataclass(frozen=True)
class _Kv:
    key: str
    value: bytes
    mod_revision: int


@dataclass
class _Held:
    """A rank this client registered: its lease and epoch."""

    info: RankInfo
    lease: int
    epoch: int


def _b64(text: str | bytes) -> str:
    return base64.b64encode(text.encode() if isinstance(text, str) else text).decode()


class EtcdRendezvous:
    """Register, look up, keep alive and deregister ranks in etcd (``etcd://`` addresses)."""

    def __init__(self, addr: str, request_timeout_s: float = 2.0, config: EtcdConfig | None = None,
                 watch_idle_s: float = 15.0):
        """`watch_idle_s`: a watch stream silent this long is reopened (on the next member when
        its own does not answer): bounds how long a partitioned member can hide deletions."""
        if request_timeout_s <= 0 or watch_idle_s <= 0:
            raise ValueError("request_timeout_s and watch_idle_s must be > 0")
        self._watch_idle_s = watch_idle_s
        self.config = config or parse_etcd_url(addr)
        self.addr = addr
        self.request_timeout_s = request_timeout_s
        self._members = Members(self.config, request_timeout_s)
        self._ns = self.config.namespace
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._closed = False
        self._held: dict[tuple[str, int], _Held] = {}     # (engine, rank) -> what we wrote
        self._keep: dict[tuple[str, int], RankInfo] = {}
        self._superseded: set[tuple[str, int]] = set()
        self._keep_interval = max(0.1, self.config.ttl_s / 3)
        self._keep_thread: threading.Thread | None = None
        self._watched = WatchedRanks(self._ns)
        self._watch: PrefixWatch | None = None
        self._gone_callbacks: list[Callable[[RankGone], None]] = []

    # ---- the rendezvous interface ---------------------------------------------------------

    def register(self, info: RankInfo) -> RankRecord:
        """Write the rank's record under a lease of its own (idempotent for the same incarnation)."""
        self._check_open()
        entry = info._entry()
        key = rank_key(self._ns, info.engine_id, info.tp_rank)
        ran_out: set[int] = set()   # leases that expired before our put could use them
        for _ in range(_RACES):
            revision, kvs = self._range(engine_prefix(self._ns, info.engine_id), f"register {info.engine_id!r}")
            existing, mine = {}, None
            for kv in kvs:
                where = parse_key(self._ns, kv.key)
                try:
                    rec = decode_record(kv.value)
                except ValueError:
                    rec = None   # a record we cannot read is overwritten for our rank, ignored for others
                if where is not None and rec is not None:
                    existing[where.tp_rank] = rec
                if kv.key == key:
                    mine = kv
            decision = register_verdict(entry, existing, revision)
            if decision.verdict is Verdict.CONFLICT:
                raise BootstrapError(f"etcd {self.config.display} refused the registration: {decision.reason}",
                                     "conflict")
            lease = self._lease_for(info, decision.verdict, ran_out)
            epoch = decision.epoch
            with self._lock:
                held = self._held.get((info.engine_id, info.tp_rank))
            if decision.verdict is Verdict.NEW and held is not None and held.info.incarnation == info.incarnation:
                epoch = held.epoch   # its key ran out and comes back: the same incarnation keeps its epoch
            record = EtcdRecord(rank=entry, epoch=epoch, registered_at=time.time())
            try:
                put = self._put_if_unchanged(key, encode_record(record), lease, mine.mod_revision if mine else 0)
            except BootstrapError as exc:
                if _LEASE_NOT_FOUND not in str(exc):
                    raise
                # an overloaded etcd answered so late that the lease ran out before the put (or
                # the held one did meanwhile): read again, and grant a new lease
                log.warning("registering %s rank %d: etcd lease %x ran out before the put; trying with a new one",
                            info.engine_id, info.tp_rank, lease)
                ran_out.add(lease)
                continue
            if put:
                self._hold(info, lease, epoch)
                return RankRecord._from_wire(record.wire())
            if held is None or held.lease != lease:
                try:   # another writer came first: this new lease holds nothing
                    self._revoke(lease)
                except BootstrapError:
                    pass   # it runs out by itself
        why = "its leases kept running out before the put" if ran_out else "racing with other writers"
        raise BootstrapError(f"registering {info.engine_id!r}/{info.tp_rank} at {self.config.display} kept "
                             f"{why} ({_RACES} attempts)", "internal")

    def lookup(self, engine_id: str, timeout_s: float = 30.0) -> list[RankRecord]:
        """All ranks of an engine, sorted by tp_rank, once every one of them is registered. Polls
        until ``timeout_s``; then BootstrapTimeout saying what is missing or who did not answer."""
        if not isinstance(engine_id, str) or not engine_id:
            raise ValueError("engine_id must be a non-empty str")
        prefix = engine_prefix(self._ns, engine_id)

        def ask(left: float) -> tuple[list[RankRecord] | None, str]:
            revision, kvs = self._range(prefix, f"lookup {engine_id!r}")
            by_rank = {}
            for kv in kvs:
                where = parse_key(self._ns, kv.key)
                if where is not None and where.engine_id == engine_id:
                    by_rank[where.tp_rank] = kv
            read = read_engine(engine_id, {r: kv.value for r, kv in by_rank.items()})
            if not read.complete:
                return None, read.describe(self.config.display)
            seen = {r.rank.tp_rank: Sighting(r.rank.incarnation, by_rank[r.rank.tp_rank].mod_revision)
                    for r in read.records}
            self._follow(engine_id, seen, revision)
            return [RankRecord._from_wire(r.wire()) for r in read.records], ""
        return poll_lookup(engine_id, timeout_s, ask, self._stop, "etcd")

    def deregister(self, engine_id: str, tp_rank: int, incarnation: int) -> None:
        """Revoke the rank's lease (its key goes with it); a no-op for a rank this client did not
        register with this incarnation."""
        with self._lock:
            self._keep.pop((engine_id, tp_rank), None)
            held = self._held.get((engine_id, tp_rank))
            if held is None or held.info.incarnation != incarnation:
                return
            del self._held[(engine_id, tp_rank)]
        self._revoke(held.lease)

    def start_keepalive(self, info: RankInfo, interval_s: float = 1.0) -> None:
        """Renew the rank's lease from a background thread every TTL/3; register it again when its
        lease ran out meanwhile (same incarnation: same epoch). Stops for a rank another
        incarnation took over (register() again takes it back).

        `interval_s` (the bootstrap server's heartbeat, which counts a rank's staleness from each
        one) is checked and otherwise unused: etcd counts a lease's TTL from each renewal, so a
        renewal every TTL/3 leaves two more tries before the key goes, and renewing more often
        only adds requests (at the engine's 1 s heartbeat, 3.3x as many with the 10 s TTL)."""
        if interval_s <= 0:
            raise ValueError("interval_s must be > 0")
        with self._lock:
            if self._closed:
                raise BootstrapError("the etcd rendezvous client is closed", "closed")
            self._keep[(info.engine_id, info.tp_rank)] = info
            self._superseded.discard((info.engine_id, info.tp_rank))
            if self._keep_thread is None:
                self._keep_thread = threading.Thread(target=self._keepalive, daemon=True,
                                                     name="kvstage-etcd-keepalive")
                self._keep_thread.start()

    def on_gone(self, callback: Callable[[RankGone], None]) -> None:
        """Call `callback` (on the watch thread) for each rank looked up through this client whose
        key etcd deleted or another incarnation took over."""
        with self._lock:
            self._gone_callbacks.append(callback)

    def status(self) -> dict[str, Any]:
        """Every rank under the namespace, as the bootstrap client's status() rows (age_s: since
        the rank registered; etcd holds no stale ranks)."""
        _, kvs = self._range(ranks_prefix(self._ns), "status")
        now, rows, unreadable = time.time(), [], 0
        for kv in kvs:
            try:
                rec = decode_record(kv.value)
            except ValueError:
                unreadable += 1
                continue
            r = rec.rank
            rows.append({"engine_id": r.engine_id, "role": r.role, "tp_size": r.tp_size, "tp_rank": r.tp_rank,
                         "epoch": rec.epoch, "incarnation": r.incarnation, "ctrl_endpoint": r.ctrl_endpoint,
                         "backend": r.backend, "age_s": max(0.0, now - rec.registered_at), "stale": False,
                         "dp_rank": r.dp_rank})
        rows.sort(key=lambda x: (x["engine_id"], x["tp_rank"]))
        return {"rendezvous": "etcd", "address": self.config.display, "started_at": None,
                "lease_s": float(self.config.ttl_s), "auth": self.config.user is not None, "limits": {},
                "counters": {"unreadable_records": unreadable}, "ranks": rows}

    def close(self) -> None:
        """Stop the threads and revoke the leases still held (their keys go at once). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._stop.set()
            thread, watch = self._keep_thread, self._watch
            held, self._held = list(self._held.values()), {}
            self._keep.clear()
        if thread is not None:
            thread.join(self.request_timeout_s * len(self._members.members) + 2.0)
        if watch is not None:   # first: the revokes below are ours, nobody's to hear about
            watch.stop()
        for h in held:
            try:
                self._revoke(h.lease)
            except BootstrapError as exc:
                log.warning("closing: could not revoke the lease of %s rank %d (etcd deletes its key in %d s): %s",
                            h.info.engine_id, h.info.tp_rank, self.config.ttl_s, exc)
        self._members.close()

    def __enter__(self) -> EtcdRendezvous:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- etcd requests ----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._stop.is_set():
            raise BootstrapError("the etcd rendezvous client is closed", "closed")

    def _range(self, prefix: str, what: str) -> tuple[int, list[_Kv]]:
        body = {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))}
        rep = self._members.call(what, lambda c: c.post(c.get_url("/kv/range"), json=body))
        kvs = [_Kv(base64.b64decode(kv["key"]).decode(errors="replace"), base64.b64decode(kv.get("value", "")),
                   int(kv.get("mod_revision", 0))) for kv in rep.get("kvs", [])]
        return int(rep["header"]["revision"]), kvs

    def _put_if_unchanged(self, key: str, value: bytes, lease: int, mod_revision: int) -> bool:
        txn = {"compare": [{"key": _b64(key), "result": "EQUAL", "target": "MOD", "mod_revision": mod_revision}],
               "success": [{"request_put": {"key": _b64(key), "value": _b64(value), "lease": lease}}],
               "failure": []}
        rep = self._members.call(f"register {key}", lambda c: c.transaction(txn))
        return bool(rep.get("succeeded"))

    def _lease_for(self, info: RankInfo, verdict: Verdict, ran_out: set[int]) -> int:
        """The lease this incarnation already holds for the rank when it is still alive (and not
        in `ran_out`), else a new one."""
        with self._lock:
            held = self._held.get((info.engine_id, info.tp_rank))
        if (held is not None and held.info.incarnation == info.incarnation and verdict is Verdict.SAME
                and held.lease not in ran_out):
            return held.lease
        ttl = self.config.ttl_s
        rep = self._members.call("grant a lease", lambda c: c.post(c.get_url("/lease/grant"), json={"TTL": ttl, "ID": 0}))
        return int(rep["ID"])

    def _hold(self, info: RankInfo, lease: int, epoch: int) -> None:
        with self._lock:
            old = self._held.get((info.engine_id, info.tp_rank))
            self._held[(info.engine_id, info.tp_rank)] = _Held(info, lease, epoch)
            self._superseded.discard((info.engine_id, info.tp_rank))
        if old is not None and old.lease != lease:
            try:   # the key moved to the new lease; the old one holds nothing of ours any more
                self._revoke(old.lease)
            except BootstrapError:
                pass   # it runs out by itself

    def _revoke(self, lease: int) -> None:
        def revoke(c):
            try:
                return Lease(lease, c).revoke()
            except etcd_exc.Etcd3Exception as exc:
                if _LEASE_NOT_FOUND in str(exc.detail_text):
                    return True   # it ran out already: its keys are gone
                raise
        self._members.call("revoke a lease", revoke)

    # ---- keepalive -------------------------------------------------------------------------

    def _keepalive(self) -> None:
        failing: set[tuple[str, int]] = set()
        while True:
            with self._lock:
                interval = self._keep_interval
            if self._stop.wait(interval):
                return
            with self._lock:
                infos = [info for k, info in self._keep.items() if k not in self._superseded]
            if not keep_round(infos, self._keep_one, failing, self._stop, log):
                return

    def _keep_one(self, info: RankInfo, key: tuple[str, int]) -> None:
        with self._lock:
            held = self._held.get(key)
        if held is not None and held.info.incarnation == info.incarnation:
            ttl = self._members.call("renew a lease", lambda c: Lease(held.lease, c).refresh())
            if ttl > 0:
                return
        # the lease ran out (etcd deleted the key) or was never granted: write the record again,
        # unless another incarnation holds the rank now
        _, mine = self._range_key(rank_key(self._ns, *key))
        if mine is not None:
            try:
                other = decode_record(mine.value).rank.incarnation
            except ValueError:
                other = None
            if other is not None and other != info.incarnation:
                log.error("%s rank %d: incarnation %d holds this rank in etcd now; keepalive stops re-registering it "
                          "(register() again to take it back)", *key, other)
                with self._lock:
                    self._superseded.add(key)
                return
        with self._lock:
            if self._keep.get(key) is not info:
                return   # deregistered or replaced meanwhile
        rec = self.register(info)
        log.info("re-registered %s rank %d in etcd (its lease had run out), epoch %d", *key, rec.epoch)

    def _range_key(self, key: str) -> tuple[int, _Kv | None]:
        body = {"key": _b64(key)}
        rep = self._members.call(f"read {key}", lambda c: c.post(c.get_url("/kv/range"), json=body))
        kvs = rep.get("kvs", [])
        if not kvs:
            return int(rep["header"]["revision"]), None
        kv = kvs[0]
        return int(rep["header"]["revision"]), _Kv(key, base64.b64decode(kv.get("value", "")), int(kv["mod_revision"]))

    # ---- the watch --------------------------------------------------------------------------

    def _follow(self, engine_id: str, ranks: dict[int, Sighting], revision: int) -> None:
        """Remember a looked-up engine's ranks; the first lookup starts the watch after its revision."""
        with self._lock:
            self._watched.remember(engine_id, ranks)
            if self._watch is not None or self._closed:
                return
            self._watch = PrefixWatch(self._members, ranks_prefix(self._ns), revision + 1, self._on_events,
                                      self._resync, read_timeout_s=self._watch_idle_s,
                                      connect_timeout_s=self.request_timeout_s)
            watch = self._watch
        watch.start()

    def _on_events(self, events: list[WatchEvent]) -> None:
        gone = []
        with self._lock:
            for ev in events:
                if ev.kind == "DELETE":
                    g = self._watched.on_delete(ev.key, ev.revision, "its rendezvous record was deleted from etcd "
                                                "(its lease expired or was revoked: the rank died or closed)")
                else:
                    g = self._watched.on_put(ev.key, ev.value, ev.revision)
                if g is not None:
                    gone.append(g)
            callbacks = list(self._gone_callbacks)
        self._tell(gone, callbacks)

    def _resync(self) -> int:
        revision, kvs = self._range(ranks_prefix(self._ns), "resynchronise the watch")
        now: dict[str, dict[int, Sighting]] = {}
        for kv in kvs:
            where = parse_key(self._ns, kv.key)
            try:
                inc = decode_record(kv.value).rank.incarnation
            except ValueError:
                continue
            if where is not None:
                now.setdefault(where.engine_id, {})[where.tp_rank] = Sighting(inc, kv.mod_revision)
        gone = []
        with self._lock:
            for engine in self._watched.engines():
                gone += self._watched.resync(engine, now.get(engine, {}),
                                             "its rendezvous record is no longer in etcd")
            callbacks = list(self._gone_callbacks)
        self._tell(gone, callbacks)
        return revision

    @staticmethod
    def _tell(gone: list[RankGone], callbacks: list) -> None:
        for g in gone:
            log.info("etcd: %s rank %d (incarnation %d) is gone: %s", g.engine_id, g.tp_rank, g.incarnation,
                        g.reason)
            for cb in callbacks:
                try:
                    cb(g)
                except Exception:  # noqa: BLE001 - one listener must not keep the others from hearing
                    log.exception("an etcd rank-gone listener raised")
