"""Which bytes of the state pools each (prefill rank -> decode rank) flow moves, and where they sit
in a write. Pure.

Pool items ride with the request's last page: on the staged path at the end of each writer's
part of the last piece (so no extra write), on the direct path as more descriptors of the write
that carries the last page. Inside a writer's pool block the order is: pools by name, each
pool's tensors in order, each tensor's items in the order the request names them.

A pool bound to a model layer (`PoolSpec.layer`, a hybrid model's per-layer state) moves in the
flows whose writer's stage holds that layer and whose decode rank's stage does too, with the last
page of the last layer that flow writes (`carried_pools`); a pool of no layer moves with the model's
last layer, as above.

A heads pool is split like KV heads over its own global head count, and must have the same
writers as the KV for every decode rank (checked when peers connect): then the pool bytes of a
flow travel in that flow's write. A pool whose head axis is several sub-blocks, each sharded on
its own (`PoolSpec.blocks`), is split block by block: a flow carries one segment per block and
tensor, at that block's offset in each side's share. A replicated pool is written to each decode
rank by its first KV writer (writer_index 0).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ..draft_kv import draft_pool_entry, is_draft_pool
from ..pool_spec import PoolSpec
from .head_mapping import Assignment, HeadMapping, compute_assignments


@dataclass(frozen=True)
class PoolSegment:
    """One pool tensor's share of a flow: local head ranges (None: the whole item) and the bytes
    it moves per item."""

    pool: str
    tensor: int
    src_heads: tuple[int, int] | None
    dst_heads: tuple[int, int] | None
    item_bytes: int


@dataclass(frozen=True)
class PoolCopy:
    """One segment of one request: the items on each side (None where that side's are not
    known or not needed) and where its bytes sit in the writer's pool block."""

    segment: PoolSegment
    src_items: np.ndarray | None
    dst_items: np.ndarray | None
    offset: int
    nbytes: int


def carried_pools(specs: Sequence[PoolSpec], layers: range, unbound: bool) -> tuple[PoolSpec, ...]:
    """The pools a flow writing `layers` (the layers both its ranks' stages hold) carries: those
    of a layer among them, and with `unbound` (it writes the model's last layer there) the pools
    of no layer."""
    return tuple(s for s in specs if (s.layer in layers if s.layer >= 0 else unbound))


def writer_segments(specs: Sequence[PoolSpec], prefill_tp: int, decode_tp: int, kv: Assignment) -> tuple[PoolSegment, ...]:
    """The pool segments the KV flow `kv` also carries."""
    out: list[PoolSegment] = []
    for spec in sorted(specs, key=lambda s: s.name):
        if spec.sharding == "replicated":
            if kv.writer_index == 0:
                out += [PoolSegment(spec.name, t, None, None, spec.row_bytes(t)) for t in range(len(spec.rows))]
            continue
        for t in range(len(spec.rows)):
            for src, dst in block_head_ranges(spec.head_blocks(), prefill_tp, decode_tp, kv):
                out.append(PoolSegment(spec.name, t, src, dst, (src[1] - src[0]) * spec.row_bytes(t)))
    return tuple(out)


def _local(block: int, tp: int) -> int:
    return max(1, block // tp)


def block_head_ranges(blocks: Sequence[int], prefill_tp: int, decode_tp: int,
                      kv: Assignment) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """(src, dst) local head ranges flow `kv` moves of a heads pool made of `blocks` (global
    sizes, each sharded on its own): per block the plain heads mapping, shifted to where the block
    starts in each side's share."""
    out = []
    src_at = dst_at = 0
    for block in blocks:
        a = compute_assignments(prefill_tp, decode_tp, block).find(kv.prefill_rank, kv.decode_rank)
        if a is not None:
            out.append(((src_at + a.src_heads[0], src_at + a.src_heads[1]),
                        (dst_at + a.dst_heads[0], dst_at + a.dst_heads[1])))
        src_at, dst_at = src_at + _local(block, prefill_tp), dst_at + _local(block, decode_tp)
    return out


def writers_mismatch(specs: Sequence[PoolSpec], prefill_tp: int, decode_tp: int, kv_heads: int, mla: bool) -> str:
    """Why these heads pools cannot travel with the KV between these TP sizes ("" when they can)."""
    kv = compute_assignments(prefill_tp, decode_tp, kv_heads, mla)
    for spec in specs:
        if spec.sharding != "heads":
            continue
        for block in spec.head_blocks():
            why = _block_writers_mismatch(spec, block, kv, prefill_tp, decode_tp, kv_heads, mla)
            if why:
                return why
    return ""


def _block_writers_mismatch(spec: PoolSpec, block: int, kv: HeadMapping, prefill_tp: int, decode_tp: int,
                            kv_heads: int, mla: bool) -> str:
    pools = compute_assignments(prefill_tp, decode_tp, block)
    for d in range(decode_tp):
        if sorted(kv.writers_of(d)) != sorted(pools.writers_of(d)):
            what = f"{spec.heads} heads" if not spec.blocks else f"a block of {block} of its heads {spec.blocks}"
            name = f"draft KV entry {draft_pool_entry(spec.name)}" if is_draft_pool(spec.name) else f"pool {spec.name!r}"
            return (f"{name} ({what}) would be written to decode rank {d} by prefill "
                    f"ranks {sorted(pools.writers_of(d))}, its KV ({kv_heads} heads{', MLA' if mla else ''}) "
                    f"by {sorted(kv.writers_of(d))}: heads pools (a draft of its own geometry too) must have "
                    f"the KV's writers (prefill TP {prefill_tp}, decode TP {decode_tp})")
    return ""


def request_copies(segments: Sequence[PoolSegment], src: Mapping[str, np.ndarray] | None,
                   dst: Mapping[str, np.ndarray] | None) -> tuple[PoolCopy, ...]:
    """The copies of one request along one flow, laid out one after another. Only the pools the
    request names (on the side whose items are given) are moved."""
    named = src if src is not None else dst
    out: list[PoolCopy] = []
    offset = 0
    for seg in segments:
        if named is None or seg.pool not in named:
            continue
        n = int(named[seg.pool].size)
        out.append(PoolCopy(seg, src.get(seg.pool) if src is not None else None,
                            dst.get(seg.pool) if dst is not None else None, offset, n * seg.item_bytes))
        offset += n * seg.item_bytes
    return tuple(out)


def block_bytes(copies: Sequence[PoolCopy]) -> int:
    return sum(c.nbytes for c in copies)


def part_offsets(sizes: Sequence[int]) -> list[int]:
    """Offsets of the writers' parts of a region, in writer order, each `sizes[i]` long."""
    out, pos = [], 0
    for n in sizes:
        out.append(pos)
        pos += n
    return out


def counts_mismatch(mine: Mapping[str, np.ndarray], theirs: Mapping[str, int]) -> str:
    """Why two sides' pool items of one request disagree ("" when they name the same pools and
    the same number of items in each)."""
    a = {k: int(v.size) for k, v in mine.items()}
    if a == dict(theirs):
        return ""
    return f"pool items differ: {a} here vs {dict(theirs)} at the peer (pool: number of items)"


def final_part(specs: Sequence[PoolSpec], mapping: HeadMapping, a: Assignment, head_bytes: int,
               src: Mapping[str, np.ndarray], dst: Mapping[str, np.ndarray] | None) -> tuple[int, tuple[PoolCopy, ...]]:
    """Prefill side, the last piece: where flow `a`'s part starts in the region (every writer's
    part before it is its KV, `head_bytes` per head, then its pool block) and its pool copies."""
    sizes = [head_bytes * w.num_heads
             + block_bytes(request_copies(writer_segments(specs, mapping.prefill_tp, mapping.decode_tp, w), src, None))
             for w in mapping.for_decode(a.decode_rank)]
    copies = request_copies(writer_segments(specs, mapping.prefill_tp, mapping.decode_tp, a), src, dst)
    return part_offsets(sizes)[a.writer_index], copies
