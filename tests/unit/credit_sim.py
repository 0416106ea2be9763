"""An in-memory world for ring credits: P prefill ranks writing single-writer staged pieces into
one decode ring, through the pure credit rules (transfer/protocol/decode/credits.py, prefill/credits.py) and
the grant fallback, with real ring bytes, FIFO control channels that may lose messages, writes
and tags that land in any order, aborts, dying prefill ranks and reused room ids.

The rooms' own state machines are not in this world (protocol_sim.World drives those): a
request here is the list of pieces one prefill rank writes for one use of a room, which the
decode side scatters into a destination buffer of its own. What it checks while it runs:

- no write lands on a ring byte that another write still holds (no two writers in one region);
- every scatter reads exactly the bytes its write put there;
- a staged write taken from a credit lies inside a credit the decode side gave that rank.

And at the end (`check`): every request that was not aborted and whose rank lived holds its
bytes, each byte written exactly once; no request's destination got a byte of another; the ring
is empty (every credit and grant region was given back); nothing was left waiting (deadlock).
"""

from __future__ import annotations

import random
from collections import defaultdict, deque
from dataclasses import dataclass, field

import numpy as np

from kvstage.transfer.protocol.credits import ClaimVerdict, CreditSpan, GrantVerdict, WriteRef
from kvstage.transfer.protocol.decode.credits import CreditLedger
from kvstage.transfer.protocol.messages import CreditAck, CreditGrant, CreditReturn, CreditWrite
from kvstage.transfer.protocol.prefill.credits import CreditPurse
from kvstage.transfer.protocol.ring import Region, RemoteWatermark, RingAllocator, Watermark

EPOCH = 7
DECODE = -1   # the decode rank's end of a channel


@dataclass(frozen=True)
class Ask:
    """prefill -> decode: ring space for one piece (the grant path's AllocRequest)."""

    rank: int
    room: int
    session: int
    piece: int
    nbytes: int


@dataclass(frozen=True)
class Granted:
    """decode -> prefill: the piece's region (the grant path's AllocGrant)."""

    room: int
    session: int
    piece: int
    region: Region


@dataclass
class Request:
    rank: int
    room: int
    session: int
    sizes: list[int]                 # each piece's bytes (one piece per write)
    data: np.ndarray                 # all pieces' bytes, in order
    next_piece: int = 0              # pieces of it gathered so far (prefill)
    posted: int = 0                  # writes posted, not completed (prefill)
    aborted: bool = False            # decode side ended it
    done: set[int] = field(default_factory=set)      # pieces scattered (decode)
    dest: np.ndarray | None = None
    written: np.ndarray | None = None                 # times each destination byte was written

    @property
    def key(self) -> tuple[int, int]:
        return (self.room, self.session)

    def piece(self, i: int) -> tuple[int, int]:
        lo = sum(self.sizes[:i])
        return lo, lo + self.sizes[i]


@dataclass
class Write:
    wid: int
    rank: int
    req: Request
    piece: int
    start: int                       # linear ring position
    nbytes: int
    span: CreditSpan | None          # taken from a credit; None: a granted region
    forged: bool = False             # a faulty rank's write its purse never handed out


@dataclass
class CreditWorld:
    P: int
    ring_bytes: int
    piece_bytes: int                 # the credit floor: the largest piece
    seed: int
    drop_msgs: float = 0.0
    align: int = 64
    now: int = 0
    chan: dict = field(default_factory=lambda: defaultdict(deque))   # (src, dst) -> messages
    requests: list[Request] = field(default_factory=list)
    writes: list[Write] = field(default_factory=list)      # posted, not landed
    tags: list[Write] = field(default_factory=list)        # landed, tag on its way
    scatters: list[Write] = field(default_factory=list)    # accepted, scatter pending
    completions: list[Write] = field(default_factory=list) # landed, the writer not told yet
    waiting: dict = field(default_factory=dict)            # (rank, room, session, piece) -> ask outstanding
    granted: dict = field(default_factory=dict)            # (rank, room, session, piece) -> Region (decode)
    held_grants: dict = field(default_factory=lambda: defaultdict(list))  # rank -> [(req, piece, Region)] (prefill)
    grant_wids: dict = field(default_factory=dict)         # (rank, room, session, piece) -> its write's id
    asked: set = field(default_factory=set)                # asks the decode side allocated a region for
    dead: set[int] = field(default_factory=set)
    overlaps: int = 0
    bad_reads: int = 0
    rejected: list = field(default_factory=list)           # (rank, verdict, reason)
    credit_writes: int = 0
    grant_writes: int = 0
    chunks: bool = False             # gather several pieces at once, as a chunk (PrefillRoom._credit_writes)
    mixed: int = 0                   # chunks whose first pieces went by credit and the rest by grant

    def __post_init__(self):
        self.rng = random.Random(self.seed)
        self.ring = RingAllocator(self.ring_bytes, align=self.align)
        self.mem = np.zeros(self.ring_bytes, dtype=np.uint8)
        self.owner = np.full(self.ring_bytes, -1, dtype=np.int64)
        self.ledger = CreditLedger(self.ring, floor=self.piece_bytes)
        self.purses = [CreditPurse(epoch=EPOCH, ring_size=self.ring_bytes) for _ in range(self.P)]
        self.views = [RemoteWatermark(EPOCH, self.ring_bytes) for _ in range(self.P)]
        self.wids = iter(range(1, 1 << 30))
        for p in range(self.P):
            self.ledger.connect(p)

    # -- requests ---------------------------------------------------------------------------
    def add_request(self, rank: int, room: int, session: int, sizes: list[int]) -> Request:
        data = np.frombuffer(self.rng.randbytes(sum(sizes)), dtype=np.uint8).copy()
        r = Request(rank, room, session, sizes, data, dest=np.zeros(sum(sizes), np.uint8),
                    written=np.zeros(sum(sizes), np.int64))
        self.requests.append(r)
        self.ledger.add_demand(rank, room, session, sum(sizes))   # the decode side sent its metadata
        self._issue()
        return r

    def abort(self, r: Request) -> None:
        """The decode caller aborts: the room's use ends here; the prefill rank stops with it."""
        r.aborted = True
        self._end_room(r)

    def kill(self, rank: int) -> None:
        """The prefill rank dies: its posted writes may still land, nothing else comes from it."""
        self.dead.add(rank)

    def _end_room(self, r: Request) -> None:
        if self.ledger.end_room(r.room, r.session):
            self._publish()
        self._issue()

    # -- channels ---------------------------------------------------------------------------
    def send(self, src: int, dst: int, msg) -> None:
        if self.rng.random() >= self.drop_msgs:
            self.chan[(src, dst)].append(msg)

    def _issue(self) -> None:
        for got in self.ledger.issue():
            self._grant(got)

    def _grant(self, got) -> None:
        wm = self.ring.watermark
        self.send(DECODE, got.peer, CreditGrant(src=0, epoch=EPOCH, credit=got.credit, start=got.start,
                                                 nbytes=got.nbytes, wm_round=wm.round, wm_tail=wm.tail))

    def _publish(self) -> None:
        for p in range(self.P):   # WatermarkUpdate (or a heartbeat): may be lost
            if self.rng.random() >= self.drop_msgs:
                self.views[p].update(EPOCH, self.ring.watermark)

    def deliver(self, src: int, dst: int) -> None:
        msg = self.chan[(src, dst)].popleft()
        if dst == DECODE:
            if src in self.dead:
                return
            if isinstance(msg, CreditReturn):
                res = self.ledger.on_return(src, msg.credit, [WriteRef(room=w.room, session=w.session, start=w.start,
                                                                        nbytes=w.nbytes) for w in msg.writes])
                if not res.ok:
                    self.rejected.append((src, "return", res.reason))
                    return
                self.send(DECODE, src, CreditAck(src=0, epoch=EPOCH, credit=msg.credit))
                if res.freed:
                    self._publish()
                self._issue()
            else:   # an ask for ring space: the grant path of one piece
                rank, room, session, piece, nbytes = msg.rank, msg.room, msg.session, msg.piece, msg.nbytes
                k = (rank, room, session, piece)
                r = self._req(rank, room, session)
                if k not in self.asked and r is not None and not r.aborted:   # answered once (allocs)
                    region = self.ring.allocate(nbytes)
                    assert isinstance(region, Region)
                    self.granted[k] = region
                    self.asked.add(k)
                if k in self.granted:
                    self.send(DECODE, rank, Granted(room, session, piece, self.granted[k]))
            return
        p = dst
        if p in self.dead:
            return
        if isinstance(msg, CreditGrant):
            self.views[p].update(EPOCH, Watermark(msg.wm_round, msg.wm_tail))
            v = self.purses[p].on_grant(credit=msg.credit, epoch=msg.epoch, start=msg.start, nbytes=msg.nbytes)
            assert v is not GrantVerdict.MISMATCH, (p, msg)
        elif isinstance(msg, CreditAck):
            self.purses[p].on_ack(msg.credit)
        else:
            room, session, piece, region = msg.room, msg.session, msg.piece, msg.region
            k = (p, room, session, piece)
            r = self._req(p, room, session)
            if k in self.waiting and r is not None:
                del self.waiting[k]
                self.held_grants[p].append((r, piece, region))

    def _req(self, rank: int, room: int, session: int) -> Request | None:
        return next((r for r in self.requests if (r.rank, r.room, r.session) == (rank, room, session)), None)

    # -- prefill ----------------------------------------------------------------------------
    def gather(self, r: Request) -> None:
        """The next piece's data is gathered: write it from a credit, or ask for a region."""
        if self.chunks:
            self.gather_chunk(r)
            return
        i = r.next_piece
        r.next_piece += 1
        nbytes = r.sizes[i]
        span = self.purses[r.rank].take(nbytes, r.room, r.session)
        if span is None:
            self.waiting[(r.rank, r.room, r.session, i)] = nbytes
            self.send(r.rank, DECODE, Ask(r.rank, r.room, r.session, i, nbytes))
            return
        self.credit_writes += 1
        self._post(Write(next(self.wids), r.rank, r, i, span.start, nbytes, span))

    def gather_chunk(self, r: Request) -> None:
        """The next 1..all pieces are gathered as one chunk: the first that fit the rank's
        credits are written into them (CreditPurse.take_some), the chunk's remainder is asked
        for, piece by piece (each piece's number is its own: the remainder's numbering)."""
        first = r.next_piece
        end = first + self.rng.randint(1, len(r.sizes) - first)
        r.next_piece = end
        spans = self.purses[r.rank].take_some(r.sizes[first:end], r.room, r.session)
        for i, span in enumerate(spans, first):
            self.credit_writes += 1
            self._post(Write(next(self.wids), r.rank, r, i, span.start, r.sizes[i], span))
        rest = range(first + len(spans), end)
        self.mixed += bool(spans) and bool(rest)
        for i in rest:
            self.waiting[(r.rank, r.room, r.session, i)] = r.sizes[i]
            self.send(r.rank, DECODE, Ask(r.rank, r.room, r.session, i, r.sizes[i]))

    def _post(self, w: Write) -> None:
        w.req.posted += 1
        self.writes.append(w)

    def post_granted(self, p: int) -> bool:
        """Post the granted writes the rank's watermark view lets it write."""
        moved = False
        for item in list(self.held_grants[p]):
            r, piece, region = item
            if r.aborted:   # it learnt of the abort: the region is never written
                self.held_grants[p].remove(item)
            elif self.views[p].allows(region.start, region.nbytes):
                self.held_grants[p].remove(item)
                self.grant_writes += 1
                w = Write(next(self.wids), p, r, piece, region.start, r.sizes[piece], None)
                self.grant_wids[(p, r.room, r.session, piece)] = w.wid
                self._post(w)
                moved = True
        return moved

    def complete(self, w: Write) -> None:
        """The writer's backend reports the write done."""
        w.req.posted -= 1
        if w.span is not None and w.rank not in self.dead and not w.forged:
            self.purses[w.rank].done(w.span, ok=True)

    def idle_ranks(self) -> None:
        for p in range(self.P):
            if p in self.dead:
                continue
            busy = any(r.rank == p and not r.aborted and r.next_piece < len(r.sizes) for r in self.requests)
            if not busy:
                self.purses[p].idle()
            for g in self.purses[p].returns():
                self.send(p, DECODE, CreditReturn(src=0, epoch=EPOCH, credit=g.credit, writes=[
                    CreditWrite(w.room, w.session, w.start, w.nbytes) for w in g.writes]))

    # -- decode -----------------------------------------------------------------------------
    def land(self, w: Write) -> None:
        off = w.start % self.ring_bytes
        sl = slice(off, off + w.nbytes)
        if (self.owner[sl] != -1).any():
            self.overlaps += 1
        lo, hi = w.req.piece(w.piece)
        self.mem[sl] = w.req.data[lo:hi]
        self.owner[sl] = w.wid
        self.tags.append(w)
        self.completions.append(w)

    def on_tag(self, w: Write) -> None:
        r = w.req
        if w.span is None:   # a granted region
            k = (w.rank, r.room, r.session, w.piece)
            if k in self.granted and not r.aborted:
                self.ledger.wrote(w.rank, r.room, r.session, w.nbytes)
                self.scatters.append(w)
            return
        c = self.ledger.claim(w.rank, w.start, w.nbytes, r.room, r.session)
        if c.verdict is ClaimVerdict.DUPLICATE:
            return
        if c.verdict is not ClaimVerdict.OK:   # never read: its bytes count as nobody's
            self._disown(w)
            self.rejected.append((w.rank, c.verdict, c.reason))
            if not r.aborted:
                self.abort(r)
            return
        if r.aborted or w.rank in self.dead:   # its room ended: dropped, not scattered
            self._release_credit(w)
            return
        self.scatters.append(w)

    def _disown(self, w: Write) -> None:
        off = w.start % self.ring_bytes
        held = self.owner[off:off + w.nbytes]
        held[held == w.wid] = -1

    def _release_credit(self, w: Write) -> None:
        self._disown(w)
        assert w.span is not None
        if self.ledger.release(w.rank, CreditSpan(credit=w.span.credit, start=w.start, nbytes=w.nbytes)):
            self._publish()
        self._issue()

    def scatter(self, w: Write) -> None:
        r = w.req
        off = w.start % self.ring_bytes
        lo, hi = r.piece(w.piece)
        if not r.aborted:
            got = self.mem[off:off + w.nbytes]
            if not np.array_equal(got, r.data[lo:hi]) or (self.owner[off:off + w.nbytes] != w.wid).any():
                self.bad_reads += 1
            r.dest[lo:hi] = got
            r.written[lo:hi] += 1
            r.done.add(w.piece)
            if len(r.done) == len(r.sizes):   # the room succeeded: its use ends
                self._end_room(r)
        if w.span is not None:
            self._release_credit(w)
        else:
            self._disown(w)
            region = self.granted.pop((w.rank, r.room, r.session, w.piece))
            if self.ring.free(region) is not None:
                self._publish()
            self._issue()

    def reap(self) -> None:
        """What the decode side does once a dead rank's writes can no longer land (its
        quarantine) and for aborted requests whose writer posts nothing more (Quiesced)."""
        for p in list(self.dead):
            if any(w.rank == p for w in self.writes + self.tags + self.scatters):
                continue
            for r in self.requests:
                if r.rank == p and not r.aborted and len(r.done) < len(r.sizes):
                    self.abort(r)
            if self.ledger.peer_lost(p):
                self._publish()
            self._free_grants(lambda k, p=p: k[0] == p)
        for r in self.requests:
            if r.aborted and r.posted == 0 and not any(w.req is r for w in self.tags + self.scatters):
                self._free_grants(lambda k, r=r: k[1:3] == (r.room, r.session) and k[0] == r.rank)

    def _free_grants(self, which) -> None:
        for k in [k for k in self.granted if which(k)]:
            if any(s.span is None and (s.rank, s.req.room, s.req.session, s.piece) == k for s in self.scatters):
                continue
            region = self.granted.pop(k)
            held = self.owner[region.offset:region.offset + region.nbytes]
            held[held == self.grant_wids.pop(k, -2)] = -1   # its write landed, never to be read
            if self.ring.free(region) is not None:
                self._publish()
        self._issue()

    # -- scheduling -------------------------------------------------------------------------
    def step(self) -> bool:
        gatherable = [r for r in self.requests if r.rank not in self.dead and not r.aborted
                      and r.next_piece < len(r.sizes)]
        live = [k for k, q in self.chan.items() if q]
        choices = []
        if gatherable:
            choices += ["gather"] * 2
        if live:
            choices += ["msg"] * 3
        if self.writes:
            choices += ["write"] * 2
        if self.tags:
            choices += ["tag"] * 2
        if self.scatters:
            choices += ["scatter"]
        if self.completions:
            choices += ["complete"]
        if not choices:
            return False
        what = "tick" if self.rng.random() < 0.03 else self.rng.choice(choices)   # heartbeats fall anywhere
        if what == "tick":
            self.tick()
        elif what == "gather":
            ranks = sorted({r.rank for r in gatherable})
            p = self.rng.choice(ranks)
            self.gather(self.rng.choice([r for r in gatherable if r.rank == p]))
        elif what == "msg":
            self.deliver(*self.rng.choice(live))
        elif what == "write":
            w = self.writes.pop(self.rng.randrange(len(self.writes)))
            if w.rank in self.dead and self.rng.random() < 0.5:
                w.req.posted -= 1    # a dead rank's write that never lands
            else:
                self.land(w)
        elif what == "tag":
            self.on_tag(self.tags.pop(self.rng.randrange(len(self.tags))))
        elif what == "scatter":
            self.scatter(self.scatters.pop(self.rng.randrange(len(self.scatters))))
        else:
            self.complete(self.completions.pop(self.rng.randrange(len(self.completions))))
        self.now += 1
        return True

    def tick(self) -> None:
        """A heartbeat: returns, re-sent grants and asks, watermark views, released resources."""
        self.idle_ranks()
        self._publish()
        for p in range(self.P):
            if p not in self.dead:
                for got in self.ledger.unacknowledged(p):
                    self._grant(got)
        for (rank, room, session, piece), nbytes in list(self.waiting.items()):
            r = self._req(rank, room, session)
            if rank in self.dead or r is None or r.aborted:   # it stopped asking (RoomFailed, or it died)
                del self.waiting[(rank, room, session, piece)]
            else:
                self.send(rank, DECODE, Ask(rank, room, session, piece, nbytes))
        self.reap()
        self._issue()
        for p in range(self.P):
            if p not in self.dead:
                self.post_granted(p)

    def run(self, max_ticks: int = 400) -> None:
        for _ in range(max_ticks):
            while self.step():
                pass
            self.tick()
            if self.quiet():
                return

    def quiet(self) -> bool:
        return (not self.writes and not self.tags and not self.scatters and not self.completions
                and not any(self.chan.values()) and not self.waiting
                and all(r.aborted or r.rank in self.dead or len(r.done) == len(r.sizes) for r in self.requests)
                and self.ring.live_regions == 0)

    # -- the end ----------------------------------------------------------------------------
    def check(self) -> None:
        assert self.overlaps == 0, "two writes held one ring byte"
        assert self.bad_reads == 0, "a scatter read bytes its write did not put there"
        for r in self.requests:
            assert r.written is not None and r.dest is not None
            assert (r.written <= 1).all(), "a destination byte was written twice"
            if not r.aborted and r.rank not in self.dead:
                assert len(r.done) == len(r.sizes), f"request {r.key} of rank {r.rank} never finished"
                assert (r.written == 1).all() and np.array_equal(r.dest, r.data)
        assert self.ring.live_regions == 0, "ring space was never given back"
        assert self.quiet(), "something is still waiting (deadlock)"
