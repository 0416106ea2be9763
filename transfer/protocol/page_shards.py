"""Who writes which pages, when the prefill engine shards its KV cache by page. Pure.

KV cache sharding (SGLang 0.5.23's ``--enable-kv-cache-sharding`` on a prefill engine of an MLA
model): the latent KV is the same on every attention TP rank, so instead of holding a copy each,
the N ranks of the TP group split the pages. A request's logical page ``l`` (the page id the
serving engine's allocator hands out, the same on every rank) lives on rank ``l % N`` at local
page ``l // N`` of that rank's cache. Every rank is given the request's whole logical page list
and sends the pages it owns; the decode engine (not sharded, of the same attention TP size, as
SGLang requires) takes every page of each request from whichever prefill rank owns it, so each
decode rank has N writers, each writing some of the request's page positions.

A sharded writer's direct write names the positions it holds with a page mask in its tag
(``Tag.pages_mask``: bit i set means position ``page_start + i`` is in the write), and the decode
rank's tracker takes each (page, layer) cell once from any writer (tracker.py, ``shared``).
The write holding the request's last position of its last layer carries the state pool items
(the aux row): that is the write of the rank owning that page.

Invariants (tested in ``tests/unit/test_page_shards.py``):
- for any logical page list, the owned masks of the N ranks partition the positions: every
  position is owned by exactly one rank, the one with ``page % N == rank``;
- a mask round-trips through ``encode_mask`` / ``decode_mask`` for any length; a mask whose
  bits run past its write's page count is refused;
- ``pairing_problem`` is None exactly for the pairings kvstage serves (an MLA prefill sharded
  over its whole TP group, a decode engine of the same TP size, no DCP on either side, no draft
  pools); its reason names both layouts.

With pipeline parallelism on either side each prefill stage's TP group shards its own layers'
pages the same way: a decode rank's writers are every rank of each stage it takes layers from
(peering.needed_ranks), the tracker takes each (page, layer) cell once from a writer of the stage
holding that layer, and the aux row comes with the last page of the last stage's last layer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .head_mapping import Assignment

#: Pages a sharded writer puts in one write at most: its tag's mask stays far below the tag's
#: size limit (tags.MAX_TAG_BYTES) at 256 bytes.
MAX_MASK_PAGES = 2048


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardedPages:
    """The positions of a chunk one rank owns: `mask` over the chunk's positions, `local` the
    owned pages' ids in that rank's own cache (in position order)."""

    mask: np.ndarray    # bool, one per position of the chunk
    local: np.ndarray   # int64, local page ids of the owned positions

    @property
    def count(self) -> int:
        return int(self.local.size)


def owned(pages: np.ndarray, shards: int, rank: int) -> ShardedPages:
    """The positions of logical `pages` that rank `rank` of `shards` owns, and their local pages."""
    arr = np.asarray(pages, dtype=np.int64)
    mask = arr % shards == rank
    return ShardedPages(mask=mask, local=arr[mask] // shards)


def encode_mask(mask: np.ndarray) -> bytes:
    """A write's page mask as tag bytes (bit i of byte i // 8, least significant first)."""
    return np.packbits(np.asarray(mask, dtype=bool), bitorder="little").tobytes()


def decode_mask(data: bytes, num_pages: int) -> np.ndarray | None:
    """The mask of a write of `num_pages` positions from its tag bytes; None when the bytes do
    not describe `num_pages` positions (wrong length, or a bit set past the last position)."""
    if num_pages <= 0 or len(data) != -(-num_pages // 8):
        return None
    bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8), bitorder="little").astype(bool)
    if bits[num_pages:].any():
        return None
    return bits[:num_pages]


def pool_assignment(a: Assignment, page_shards: int) -> Assignment:
    """The flow as the state pools see it: with sharded pages any writer may hold the request's
    last page, so each carries the pools as the first writer would (pool_parts.writer_segments
    gives replicated pools to writer 0 only); unchanged without sharding."""
    return replace(a, writer_index=0) if page_shards > 1 else a


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardSide:
    """What a pairing of a sharded prefill needs to know of one side."""

    tp_size: int
    mla: bool
    page_shards: int = 1
    pp_size: int = 1
    dcp_size: int = 1
    draft_pools: int = 0

    def describe(self, side: str) -> str:
        extra = "".join(f", {k} {v}" for k, v in (("PP", self.pp_size), ("DCP", self.dcp_size),
                                                  ("draft pools", self.draft_pools)) if v not in (0, 1))
        shards = f", KV pages sharded {self.page_shards} ways" if self.page_shards > 1 else ""
        return f"{side} TP {self.tp_size} ({'MLA' if self.mla else 'GQA/MHA'}{shards}{extra})"


def pairing_problem(prefill: ShardSide, decode: ShardSide) -> str | None:
    """Why kvstage cannot move requests from this prefill engine to this decode engine because
    of page sharding (None: it can, or neither side shards). Served, as SGLang's mooncake backend
    serves it: a prefill of an MLA model sharded over its whole TP group (of each PP stage), no
    DCP or draft pools there, to a decode engine that does not shard, of the same TP size,
    without DCP (any PP on either side)."""
    if prefill.page_shards == 1 and decode.page_shards == 1:
        return None
    both = f"{prefill.describe('prefill')} -> {decode.describe('decode')}"
    if decode.page_shards != 1:
        return f"{both}: a decode engine does not shard its KV pages (SGLang shards prefill engines only)"
    if not (prefill.mla and decode.mla):
        return f"{both}: KV page sharding is served for MLA only (the latent KV is the same on every TP rank)"
    if prefill.page_shards != prefill.tp_size:
        return f"{both}: the prefill's pages must be sharded over its whole TP group ({prefill.tp_size} ranks)"
    if decode.tp_size != prefill.tp_size:
        return f"{both}: a sharded prefill needs a decode engine of the same TP size (as SGLang's)"
    if prefill.dcp_size != 1 or decode.dcp_size != 1:
        return f"{both}: KV page sharding with decode context parallel is not served (SGLang refuses it too)"
    if prefill.draft_pools:
        return f"{both}: KV page sharding with draft KV is not served"
    return None
