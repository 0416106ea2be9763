"""End-to-end integrity of the bytes moved (EngineConfig(verify=True) / KVSTAGE_VERIFY=1), and
the `corrupt_data` fault that tests it.

Prefill: every staged piece and every direct write carries, in its tag, the xxh3-64 digest of
its source bytes (staging/digests.py). Decode: a staged piece's ring bytes are digested before
they are scattered (on the scatter thread); a direct write's pages and items right when its tag
arrives, before the room may succeed. A mismatch fails the room with kind `corrupt` on both
sides and is counted; it is never reported as Success. Both peers must agree on the setting
(checked at Hello). Digesting happens on the control thread for direct writes: verify costs
throughput, measured in docs/journal/benchmarks-2026-11.md.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import msgspec
import torch

from ...staging.digests import gathered_digest
from ...staging.gather_scatter import GathersKV
from ...staging.handler import StagingHandler
from ...staging.kernels import gatherer_class
from ...staging.workers import PartDigest
from ..kv_buffers import KVBuffers
from ..layout import KVLayout
from ..protocol.actions import Scatter, WriteOp
from ..protocol.decode.room import DecodeRoom, PageSpan, RingSpan
from ..protocol.tags import Tag, TagCodec
from ..protocol.token_mapping import run_slots
from .stats import Stats


class Integrity:
    """Built before the engine context (which carries it): it gets the few parts it reads."""

    def __init__(self, *, verify: bool, layout: KVLayout, buffers: KVBuffers, tags: TagCodec,
                 handler: StagingHandler, stats: Stats, corrupt_data: float = 0.0, seed: int = 0):
        self.verify = bool(verify)
        self.layout, self.buffers, self.tags, self.handler, self.stats = layout, buffers, tags, handler, stats
        self.corrupt_data = corrupt_data
        self._rng = random.Random(seed + 7)
        self._gatherer: GathersKV | None = None   # staging/kernels.py: a Gatherer, made on first use
        self.corrupted_rooms: set[int] = set()

    def _gather(self) -> GathersKV:
        if self._gatherer is None:
            self._gatherer = gatherer_class(self.buffers.device)()
        return self._gatherer

    # -- prefill ----------------------------------------------------------------------------------
    def direct_tags(self, op: WriteOp, groups: int = 1) -> list[bytes]:
        """The tags of a direct write's `groups` backend writes (one per pair of memory kinds),
        each with the digest of ALL the write's source bytes when verifying: the decode rank
        checks the write once, when its last group landed."""
        tag = op.tag
        if self.verify:
            b = self.buffers
            k, v = b.layer_views(op.layers)
            pages, page_size = op.src_pages, self.layout.page_size
            if op.token_runs is not None:   # decode context parallel: the tokens' slots, in order
                pages, page_size = run_slots(op.token_runs[0], op.token_runs[2]), 1
            d = gathered_digest(self._gather(), k, v, pages, page_size, op.src_heads, b.pools, op.pools, op.nbytes)
            tag = msgspec.structs.replace(tag, digest=d)
        if groups == 1:
            return [self.tags.encode(tag)]
        return [self.tags.encode(msgspec.structs.replace(tag, group=i, groups=groups)) for i in range(groups)]

    def sealer(self, tag: Tag) -> Callable[[int], bytes] | None:
        """For a staged piece: how its transfer worker seals the tag once it gathered the bytes."""
        if not self.verify:
            return None
        codec = self.tags
        return lambda d: codec.encode(msgspec.structs.replace(tag, digest=d))

    # -- decode -----------------------------------------------------------------------------------
    def on_landed(self, room: DecodeRoom, tag: Tag) -> str | None:
        """A tag arrived for `room`: inject the corrupt_data fault, then (direct, verifying) check
        the landed bytes. Returns why the room must fail as `corrupt`, or None."""
        span = room.landed_span(tag) if (self.corrupt_data or self.verify) else None
        if span is None:
            return None
        if self.corrupt_data and self._rng.random() < self.corrupt_data:
            self._flip(room.room, span)
        if not self.verify or not isinstance(span, PageSpan):
            return None  # staged pieces are checked on the scatter thread, before the scatter
        b = self.buffers
        k, v = b.layer_views(span.layers)
        got = gathered_digest(self._gather(), k, v, span.pages, span.page_tokens or self.layout.page_size, span.heads,
                              b.pools, span.copies, span.nbytes, dst=True)
        if got != tag.digest:
            return (f"corrupt data from prefill rank {tag.writer}, chunk {tag.chunk} part {tag.piece}: the landed "
                    f"bytes' digest {got:#018x} is not the sent {tag.digest:#018x}")
        return None

    def scatter_checks(self, s: Scatter) -> tuple[PartDigest, ...]:
        """Every writer's part of a landed piece with the digest it must have, when verifying."""
        if not self.verify:
            return ()
        view = self.handler.ring_view
        return tuple(PartDigest(view=view(c.ring_offset, c.nbytes), digest=c.digest, writer=c.writer)
                     for c in s.checks)

    def _flip(self, room: int, span: RingSpan | PageSpan) -> None:
        """Flip one byte of what the write landed (the fault `corrupt_data`); none where no KV
        byte landed (a DCP rank's write of its pool items alone)."""
        if isinstance(span, PageSpan) and not len(span.pages):
            return
        stats = self.stats
        stats.count("faults_injected", "corrupt_data")
        if room not in self.corrupted_rooms:
            self.corrupted_rooms.add(room)
            stats.add("corrupted_rooms")
        if isinstance(span, RingSpan):
            v = self.handler.ring_view(span.offset + self._rng.randrange(span.nbytes), 1)
        else:
            pages, heads = span.pages, span.heads
            k = self.buffers.entry_k[self._rng.choice(span.layers) - self.buffers.first_layer]
            token = int(pages[self._rng.randrange(len(pages))]) * (span.page_tokens or self.layout.page_size)
            v = k[token, heads[0]].view(torch.uint8)[:1]
        v.bitwise_xor_(0xFF)
