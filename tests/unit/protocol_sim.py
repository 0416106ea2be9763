"""An in-memory world for the pure room state machines: P prefill ranks, D decode ranks,
numpy KV caches, rings, per-pair FIFO control channels and a backend that copies bytes.

A seeded scheduler picks what happens next (deliver a message, land a write, finish a
scatter, tick the clock), so tests can explore many interleavings deterministically.
"""

from __future__ import annotations

import itertools
import random
from collections import defaultdict, deque
from dataclasses import dataclass, field

import numpy as np
import torch

from kvstage.transfer.config import Timeouts
from kvstage.transfer.draft_kv import DraftKV
from kvstage.transfer.layout import KVLayout
from kvstage.transfer.poll import KVPoll
from kvstage.transfer.protocol.actions import (
    AwaitUnit,
    DecodePrefix,
    PeerKey,
    PostWrite,
    PrepareScatter,
    PublishWatermark,
    Released,
    Scatter,
    Send,
    StatusChanged,
)
from kvstage.transfer.protocol.decode.room import DecodeRoom, RoomPlan
from kvstage.transfer.protocol.head_mapping import compute_assignments
from kvstage.transfer.protocol.messages import (
    AllocGrant,
    AllocRequest,
    MetaAck,
    Quiesced,
    RoomDone,
    RoomFailed,
    RoomMeta,
    WatermarkUpdate,
    WriterDone,
)
from kvstage.transfer.protocol.pieces import max_piece_pages
from kvstage.transfer.protocol.prefill.chunk_writes import WriteLimits
from kvstage.transfer.protocol.prefill.layer_sends import PER_CHUNK, LayerGrouping
from kvstage.transfer.protocol.prefill.room import PrefillRoom
from kvstage.transfer.protocol.ring import RemoteWatermark, RingAllocator, Watermark

SENTINEL = 0xA5  # the bytes of decode pages that hold a prefix: no write may touch them
UNWRITTEN = 0x5A  # the decode's draft entries the prefill does not have: no write may touch them


@dataclass(kw_only=True)
class Geometry:
    P: int
    D: int
    H: int
    layers: int = 2
    page_size: int = 2
    head_dim: int = 4
    mla: bool = False
    pages: int = 256  # pages per cache
    ring_bytes: int = 4096
    buffer_bytes: int = 2048
    staged: bool = True
    stages: tuple[range, ...] = ()  # a PP prefill: each stage's layers (P ranks each); () is one stage
    draft_p: int = 0   # draft KV entries of the prefill (after its layers; 0: no draft)
    draft_d: int = 0   # ... of the decode (may be more: decode-only speculation)

    @property
    def pp(self) -> tuple[range, ...]:
        """Each prefill stage's entries (a draft follows the one stage's layers)."""
        return self.stages or (range(self.layers + self.draft_p),)

    def entries(self, side: str) -> int:
        return self.layers + (self.draft_p if side == "prefill" else self.draft_d)


@dataclass
class PendingWrite:
    src_rank: int
    op: object
    waiting: bool  # staged: waiting for the watermark


def layouts(g: Geometry, tp: int, stages: tuple[range, ...] | None = None, draft: int = 0) -> list[KVLayout]:
    """Every rank's layout of one side (TP size `tp`; a PP prefill: each stage's ranks, in rank
    order s * tp + r; `draft` entries after the layers)."""
    stages = stages or (range(g.layers),)
    return [KVLayout(num_layers=g.layers, total_kv_heads=g.H, head_dim=g.head_dim, dtype=torch.uint8,
                     page_size=g.page_size, tp_size=tp, tp_rank=r, mla=g.mla, pp_size=len(stages), pp_rank=s,
                     stage=stage, draft=DraftKV(num_layers=draft) if draft else None)
            for s, stage in enumerate(stages) for r in range(tp)]


@dataclass(kw_only=True)
class World:
    g: Geometry
    seed: int
    drop_tags: float = 0.0  # probability a tag is lost (the write itself lands)
    dup_tags: float = 0.0
    drop_msgs: float = 0.0  # probability a control message is lost
    max_ranges: int = 65536  # direct path: descriptors per write
    hold_completions: bool = False  # the writer learns of its landed writes only when the test says
    now: float = 0.0
    rooms_p: dict = field(default_factory=dict)  # (rank, room) -> PrefillRoom
    rooms_d: dict = field(default_factory=dict)  # (rank, room) -> DecodeRoom
    chan: dict = field(default_factory=lambda: defaultdict(deque))  # (src key, dst key) -> messages
    writes: list = field(default_factory=list)
    tags: list = field(default_factory=list)  # (decode rank, src peer, tag)
    scatters: list = field(default_factory=list)  # (decode rank, Scatter)
    status_p: dict = field(default_factory=dict)
    status_d: dict = field(default_factory=dict)
    released_p: set = field(default_factory=set)
    released_d: set = field(default_factory=set)
    overlaps: int = 0
    completions: list = field(default_factory=list)  # (prefill rank, op) landed, not yet reported
    grouping: LayerGrouping = PER_CHUNK  # how the prefill rooms turn layer-wise sends into writes
    ready_objects: bool = False  # layer-wise sends carry a readiness object, waited on (AwaitUnit) in random order
    awaits: list = field(default_factory=list)  # (prefill rank, AwaitUnit) not waited on yet
    ready_done: set = field(default_factory=set)  # (prefill rank, room, page, layer) whose readiness was waited on
    unready_reads: int = 0  # direct writes of a batching room that read a layer before it was ready

    def __post_init__(self):
        g = self.g
        self.rng = random.Random(self.seed)
        self.timeouts = Timeouts(metadata=50, watermark=50, arrival=5, scatter=5, room=100)
        self.lp = layouts(g, g.P, g.stages or None, g.draft_p)
        self.ld = layouts(g, g.D, draft=g.draft_d)
        self.np = len(self.lp)   # prefill ranks: P per PP stage
        self.kp = [PeerKey("prefill", r, 1000 + r) for r in range(self.np)]
        self.kd = [PeerKey("decode", r, 2000 + r) for r in range(g.D)]
        nkv = 1 if g.mla else 2
        self.nt = nkv * g.entries("prefill")
        self.ntd = nkv * g.entries("decode")
        nrng = np.random.default_rng(self.seed)
        self.cp = [
            nrng.integers(0, 256, (self.nt, g.pages, g.page_size, l.local_heads, g.head_dim), dtype=np.uint8)
            for l in self.lp
        ]
        self.cd = [
            np.zeros((self.ntd, g.pages, g.page_size, l.local_heads, g.head_dim), dtype=np.uint8) for l in self.ld
        ]
        self.written = [np.zeros(c.shape, dtype=np.int64) for c in self.cd]  # times each decode byte was written
        for c in self.cd:   # the decode's draft entries the prefill has not
            c[self.unwritten()] = UNWRITTEN
        self.mapping = compute_assignments(g.P, g.D, g.H, g.mla)
        self.rings = [RingAllocator(g.ring_bytes, align=8) for _ in range(g.D)]
        self.ring_mem = [np.zeros(g.ring_bytes, dtype=np.uint8) for _ in range(g.D)]
        self.ring_owner = [np.full(g.ring_bytes, -1, dtype=np.int64) for _ in range(g.D)]
        self.remote_wm = {
            (p, d): RemoteWatermark(self.kd[d].incarnation, g.ring_bytes) for p in range(self.np) for d in range(g.D)
        }
        self.op_ids = itertools.count(1)
        self.expected = {}  # (decode rank, room) -> (dst pages, src pages per prefill rank, prefix pages, prefix)
        self.prefix_seen = []  # (prefill rank, prefix) per DecodePrefix action
        self.free_pages = {}  # decode rank -> pages no room uses yet

    # -- set-up of rooms -----------------------------------------------------------------------
    def plan_for(self, d: int) -> RoomPlan:
        g = self.g
        writers, notices = self.mapping.prefill_peers_of(d)
        pp = range(len(g.pp))
        assigns = tuple((self.kp[s * g.P + p], self.mapping.find(p, d)) for s in pp for p in writers)
        hpb = self.nt * g.page_size * g.head_dim
        staged = g.staged and g.P != g.D and not g.mla
        mpp = max_piece_pages([hpb * a.num_heads for _, a in assigns], g.buffer_bytes, g.ring_bytes, 8) if staged else 0
        return RoomPlan(writers=assigns, notices=tuple(self.kp[s * g.P + p] for s in pp for p in notices),
                        staged=staged, head_page_bytes=hpb, num_layers=g.entries("prefill"), max_piece_pages=mpp,
                        ring_epoch=self.kd[d].incarnation, ring_size=g.ring_bytes, buffer_bytes=g.buffer_bytes,
                        piece_bytes=g.buffer_bytes if staged else 0, ring_align=8,
                        writer_layers={s * g.P + p: g.pp[s] for s in pp for p in writers} if g.stages else {})

    def add_room(
        self,
        room: int,
        n: int,
        chunks: list[int],
        late_init: bool = False,
        infer_last: bool = False,
        prefix: int | list[int] = 0,
        layer_sends: list[range] | None = None,
        shuffle_layers: bool = False,
    ):
        """A request of n pages; each prefill rank sends it in the given chunk sizes.
        late_init: the prefill senders learn n with init(), at a random point before their first
        chunk (before or after the decode side's metadata); infer_last: no chunk says last;
        prefix: the first pages each decode rank already holds (one k for all, or one per rank):
        its destination pages are the rest, and the prefix pages get a sentinel that must stay.
        layer_sends: each chunk is sent as these layer ranges (layer-wise sending), in this order
        or, with shuffle_layers, in a random order per chunk (the same on every prefill rank: the
        ranks of a TP group send the same units in the same order)."""
        g = self.g
        session = room * 7 + 1
        src = [np.array(self.rng.sample(range(g.pages), n)) for _ in range(self.np)]
        for p in range(self.np):
            self.rooms_p[(p, room)] = PrefillRoom(
                room=room,
                num_pages=None if late_init else n,
                layout=self.lp[p],
                me=self.kp[p].incarnation,
                now=self.now,
                timeouts=self.timeouts,
                op_ids=self.op_ids,
                limits=WriteLimits(max_ranges=self.max_ranges),
                grouping=self.grouping,
            )
            self.status_p[(p, room)] = KVPoll.Bootstrapping
        for d in range(g.D):
            free = self.free_pages.setdefault(d, list(range(g.pages)))
            self.rng.shuffle(free)
            k = prefix[d] if isinstance(prefix, list) else prefix
            held = np.array([free.pop() for _ in range(k)], dtype=np.int64)
            for t in self.tensors_of(range(g.entries("prefill")), "decode"):   # the entries a room writes
                self.cd[d][t, held] = SENTINEL
            dst = np.array([free.pop() for _ in range(n - k)])
            r = DecodeRoom(room=room, session=session, me=self.kd[d].incarnation, layout=self.ld[d], now=self.now,
                           timeouts=self.timeouts)
            self.rooms_d[(d, room)] = r
            self.status_d[(d, room)] = KVPoll.Bootstrapping
            self.expected[(d, room)] = (dst, src, held, k)
            self.apply_d(d, r.on_plan(self.plan_for(d), self.now))
            self.apply_d(d, r.init(dst, self.now, prefix_pages=k))
        self.pending_chunks = getattr(self, "pending_chunks", [])
        orders = []   # the layer sends of each chunk, in one order for every rank (as one forward pass gives)
        for _ in chunks:
            sends = list(layer_sends or ())
            if shuffle_layers:
                self.rng.shuffle(sends)
            orders.append(sends)
        for p in range(self.np):
            stage = self.lp[p].layers
            pos = 0
            if late_init:
                self.pending_chunks.append((p, room, n, None))  # init(n), in order before the chunks
            for i, c in enumerate(chunks):
                last = None if infer_last else i == len(chunks) - 1
                if layer_sends is None:
                    self.pending_chunks.append((p, room, src[p][pos : pos + c], last))
                else:
                    for rng in orders[i]:   # a PP stage sends its part of each send
                        mine = range(max(rng.start, stage.start), min(rng.stop, stage.stop))
                        if len(mine):
                            self.pending_chunks.append((p, room, src[p][pos : pos + c], None, mine))
                pos += c

    # -- action application ----------------------------------------------------------------------
    def send(self, src: PeerKey, dst: PeerKey, msg) -> None:
        if self.rng.random() >= self.drop_msgs:
            self.chan[(src, dst)].append(msg)

    def apply_p(self, p: int, actions):
        for a in actions:
            if isinstance(a, Send):
                self.send(self.kp[p], a.peer, a.msg)
            elif isinstance(a, PostWrite):
                self.writes.append(PendingWrite(p, a.op, a.op.staged))
            elif isinstance(a, AwaitUnit):
                self.awaits.append((p, a))
            elif isinstance(a, DecodePrefix):
                self.prefix_seen.append((p, a.pages))
            elif isinstance(a, (StatusChanged, Released)):
                pass
            else:
                raise AssertionError(f"unexpected prefill action {a}")

    def apply_d(self, d: int, actions):
        for a in actions:
            if isinstance(a, Send):
                self.send(self.kd[d], a.peer, a.msg)
            elif isinstance(a, Scatter):
                self.scatters.append((d, a))
            elif isinstance(a, PublishWatermark):
                wm = self.rings[d].watermark
                for p in range(self.np):
                    self.send(
                        self.kd[d],
                        self.kp[p],
                        WatermarkUpdate(
                            src=self.kd[d].incarnation,
                            dst=self.kp[p].incarnation,
                            epoch=self.kd[d].incarnation,
                            round=wm.round,
                            tail=wm.tail,
                        ),
                    )
            elif isinstance(a, (StatusChanged, Released, PrepareScatter)):   # a hint to the scatter: no effect here
                pass
            else:
                raise AssertionError(f"unexpected decode action {a}")

    def refresh_status(self):
        for key, r in self.rooms_p.items():
            self.status_p[key] = r.state
            if r.released:
                self.released_p.add(key)
        for key, r in self.rooms_d.items():
            self.status_d[key] = r.state
            if r.released:
                self.released_d.add(key)

    # -- events ----------------------------------------------------------------------------------
    def deliver(self, src: PeerKey, dst: PeerKey):
        msg = self.chan[(src, dst)].popleft()
        if dst.engine_id == "prefill":
            p = dst.tp_rank
            room = getattr(msg, "room", None)
            r = self.rooms_p.get((p, room))
            if isinstance(msg, WatermarkUpdate):
                self.remote_wm[(p, src.tp_rank)].update(msg.epoch, Watermark(msg.round, msg.tail))
                return
            if r is None:
                return
            if isinstance(msg, RoomFailed) and r.released:
                # the shell: a finished room has nothing in flight (an earlier Quiesced was lost)
                self.send(
                    dst, src, Quiesced(src=dst.incarnation, dst=src.incarnation, room=msg.room, session=msg.session)
                )
                return
            if isinstance(msg, RoomMeta):
                self.send(
                    dst, src, MetaAck(src=dst.incarnation, dst=src.incarnation, room=msg.room, session=msg.session)
                )
                self.apply_p(p, r.add_meta(src, self.g.D, msg, self.now))
            elif isinstance(msg, AllocGrant):
                self.apply_p(p, r.on_grant(src, msg, self.now))
            elif isinstance(msg, RoomDone):
                self.apply_p(p, r.on_room_done(src, msg.session, self.now))
            elif isinstance(msg, RoomFailed):
                self.apply_p(p, r.on_room_failed(src, msg.session, msg.kind, msg.reason, self.now))
            else:
                raise AssertionError(msg)
        else:
            d = dst.tp_rank
            r = self.rooms_d.get((d, msg.room))
            if r is None:
                return
            if isinstance(msg, AllocRequest):
                self.apply_d(d, r.on_alloc_request(src, msg, self.rings[d], self.now))
            elif isinstance(msg, WriterDone):
                self.apply_d(d, r.on_writer_done(src, msg, self.now))
            elif isinstance(msg, RoomFailed):
                self.apply_d(d, r.on_room_failed(src, msg.session, msg.kind, msg.reason, self.now))
            elif isinstance(msg, Quiesced):
                self.apply_d(d, r.on_quiesced(src, msg.session, self.rings[d], self.now))
            elif isinstance(msg, MetaAck):
                r.on_meta_ack(src, msg.session)
            else:
                raise AssertionError(msg)

    def write_ready(self, w: PendingWrite) -> bool:
        if not w.op.staged:
            return True
        rw = self.remote_wm[(w.src_rank, w.op.peer.tp_rank)]
        region_bytes = w.op.nbytes  # the writer's own part must be free
        return rw.allows(w.op.ring_start + w.op.writer_offset, region_bytes)

    def land(self, w: PendingWrite):
        op, p, d = w.op, w.src_rank, w.op.peer.tp_rank
        g = self.g
        tensors, dst_t = self.tensors_of(op.layers), self.tensors_of(op.layers, "decode")
        src = self.cp[p][tensors][:, op.src_pages][:, :, :, op.src_heads[0] : op.src_heads[1]]
        if op.staged:
            data = np.ascontiguousarray(src).reshape(-1)
            assert data.size == op.nbytes
            off = (op.ring_start % g.ring_bytes) + op.writer_offset
            owners = self.ring_owner[d][off : off + op.nbytes]
            # a byte may only be overwritten once the piece that owned it was freed (scattered, or
            # given up by a failed room once its writers stopped)
            held = np.array([o >= 0 and o != op.ring_start and self.rings[d].holds(int(o)) for o in owners], dtype=bool)
            busy = owners[held]
            if busy.size:
                self.overlaps += 1
            self.ring_mem[d][off : off + op.nbytes] = data
            self.ring_owner[d][off : off + op.nbytes] = op.ring_start
        else:
            if self.ready_objects and self.rooms_p[(p, op.room)].batcher is not None:
                self.unready_reads += any((p, op.room, int(page), layer) not in self.ready_done
                                          for page in op.src_pages for layer in op.layers)
            for j, t in enumerate(dst_t):
                self.cd[d][t, op.dst_pages, :, op.dst_heads[0] : op.dst_heads[1]] = src[j]
                self.written[d][t, op.dst_pages, :, op.dst_heads[0] : op.dst_heads[1]] += 1
        if self.hold_completions:
            self.completions.append((p, op))
        else:
            self.apply_p(p, self.rooms_p[(p, op.room)].on_write_done(op.op_id, True, None, self.now))
        if self.rng.random() >= self.drop_tags:
            self.tags.append((d, self.kp[p], op.tag))
            if self.rng.random() < self.dup_tags:
                self.tags.append((d, self.kp[p], op.tag))

    def do_scatter(self, d: int, s: Scatter):
        g = self.g
        r = self.rooms_d[(d, s.room)]
        tensors = self.tensors_of(s.layers, "decode")
        for part in s.parts:
            nheads = part.dst_heads[1] - part.dst_heads[0]
            data = self.ring_mem[d][part.region_offset : part.region_offset + part.nbytes]
            block = data.reshape(len(tensors), s.dst_pages.size, g.page_size, nheads, g.head_dim)
            for j, t in enumerate(tensors):
                self.cd[d][t, s.dst_pages, :, part.dst_heads[0] : part.dst_heads[1]] = block[j]
                self.written[d][t, s.dst_pages, :, part.dst_heads[0] : part.dst_heads[1]] += 1
            self.ring_owner[d][part.region_offset : part.region_offset + part.nbytes] = -1
        self.apply_d(d, r.on_scattered(s.key, True, None, self.rings[d], self.now))

    def tensors_of(self, layers: range, side: str = "prefill") -> list[int]:
        """Cache tensor indices (K entries, then V entries) of `layers` in one side's cache."""
        per = self.g.entries(side)
        return [kv * per + layer for kv in range((self.nt if side == "prefill" else self.ntd) // per)
                for layer in layers]

    def unwritten(self) -> list[int]:
        """Decode cache tensors of the draft entries the prefill does not have."""
        return self.tensors_of(range(self.g.entries("prefill"), self.g.entries("decode")), "decode")

    def written_once(self, room: int) -> bool:
        """Every destination byte of the room (every page, layer, draft entry, K/V and head) was
        written exactly once, and no prefix byte nor byte of a draft entry the prefill lacks at
        all (which still hold their sentinel)."""
        sent = self.tensors_of(range(self.g.entries("prefill")), "decode")
        extra = self.unwritten()
        for d in range(self.g.D):
            dst, _, held, _ = self.expected[(d, room)]
            if (self.written[d][sent][:, dst] != 1).any() or (self.written[d][:, held] != 0).any():
                return False
            if (self.written[d][extra] != 0).any() or (self.cd[d][extra] != UNWRITTEN).any():
                return False
        return True

    def cancel_failed_writes(self):
        """What the engine shell does: queued writes of a failed room are never started."""
        for w in list(self.writes):
            r = self.rooms_p[(w.src_rank, w.op.room)]
            if r.state is KVPoll.Failed:
                self.writes.remove(w)
                self.apply_p(w.src_rank, r.on_write_done(w.op.op_id, False, "cancelled", self.now))

    def step(self) -> bool:
        """One random event; False when nothing can happen any more."""
        self.cancel_failed_writes()
        choices = []
        if self.pending_chunks:
            choices.append("chunk")
        live = [k for k, q in self.chan.items() if q]
        if live:
            choices += ["msg"] * 3
        ready = [w for w in self.writes if self.write_ready(w)]
        if ready:
            choices += ["write"] * 2
        if self.tags:
            choices += ["tag"] * 2
        if self.scatters:
            choices.append("scatter")
        if self.awaits:
            choices.append("ready")
        if not choices:
            return False
        what = self.rng.choice(choices)
        if what == "chunk":
            # chunks of one prefill rank stay in order; ranks interleave freely
            ranks = sorted({c[0] for c in self.pending_chunks})
            p = self.rng.choice(ranks)
            i = next(i for i, c in enumerate(self.pending_chunks) if c[0] == p)
            _, room, pages, last, *layers = self.pending_chunks.pop(i)
            r = self.rooms_p[(p, room)]
            if isinstance(pages, int):
                self.apply_p(p, r.init(pages, self.now))
            else:
                ready = ((room, tuple(pages.tolist()), layers[0]),) if self.ready_objects and layers else ()
                self.apply_p(p, r.add_chunk(pages, last, self.now, layers=layers[0] if layers else None, ready=ready))
        elif what == "ready":
            p, a = self.awaits.pop(self.rng.randrange(len(self.awaits)))
            for room_, pages_, layers_ in a.ready:
                self.ready_done.update((p, room_, page, layer) for page in pages_ for layer in layers_)
            self.apply_p(p, self.rooms_p[(p, a.room)].on_unit_ready(a.seq, None, self.now))
        elif what == "msg":
            src, dst = self.rng.choice(live)
            self.deliver(src, dst)
        elif what == "write":
            w = self.rng.choice(ready)
            self.writes.remove(w)
            self.land(w)
        elif what == "tag":
            d, peer, tag = self.tags.pop(self.rng.randrange(len(self.tags)))
            r = self.rooms_d.get((d, tag.room))
            if r is not None:
                self.apply_d(d, r.on_tag(peer, tag, self.now).actions)
        else:
            d, s = self.scatters.pop(self.rng.randrange(len(self.scatters)))
            self.do_scatter(d, s)
        self.now += 0.001
        return True

    def tick_all(self):
        for (p, _), r in self.rooms_p.items():
            self.apply_p(p, r.tick(self.now))
        for (d, _), r in self.rooms_d.items():
            self.apply_d(d, r.tick(self.rings[d], self.now))
        for (p, d), view in self.remote_wm.items():  # heartbeats carry the watermark
            wm = self.rings[d].watermark
            if self.rng.random() >= self.drop_msgs:
                view.update(self.kd[d].incarnation, wm)

    def settle(self, max_time: float = 300.0, tick: float = 0.25):
        """Run events; when nothing can happen, let time pass (deadlines, retransmissions)
        until every room on both sides is released or max_time is up."""
        while self.now < max_time:
            self.run()
            if all(r.released for r in self.rooms_p.values()) and all(r.released for r in self.rooms_d.values()):
                break
            self.now += tick
            self.tick_all()
        self.refresh_status()

    def run(self, max_steps: int = 200_000):
        for _ in range(max_steps):
            if not self.step():
                break
        self.refresh_status()

    def check_bytes(self, room: int, ranks=None) -> bool:
        """Every decode rank (or those in `ranks`) holds the room's bytes exactly."""
        g = self.g
        for d in range(g.D) if ranks is None else ranks:
            dst, src, held, k = self.expected[(d, room)]
            sent = self.tensors_of(range(g.entries("prefill")), "decode")
            if held.size and not (self.cd[d][sent][:, held] == SENTINEL).all():
                return False  # a byte landed in a page that holds the prefix
            for a in self.mapping.for_decode(d):
                for s, stage in enumerate(g.pp):   # each stage's ranks hold its layers
                    p, t = s * g.P + a.prefill_rank, self.tensors_of(stage)
                    got = self.cd[d][self.tensors_of(stage, "decode")][:, dst][:, :, :, a.dst_heads[0] : a.dst_heads[1]]
                    want = self.cp[p][t][:, src[p][k:]][:, :, :, a.src_heads[0] : a.src_heads[1]]
                    if not np.array_equal(got, want):
                        return False
        return True
