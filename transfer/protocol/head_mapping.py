"""Who writes which KV heads where, when prefill TP (P) and decode TP (D) differ. Pure.

Everything starts from the global head count H. Rank r of a TP group of size T holds global
heads [r * H/T, (r+1) * H/T) when T <= H, or the single head r // (T/H) when T > H (copies of a
head sit on consecutive ranks: map by division, never by modulo). For every decode rank and
every head it holds, exactly one prefill rank holding that head writes it; replicas that nobody
needs write nothing. A prefill rank's heads inside one decode rank form one contiguous run, so
each (prefill rank, decode rank) pair is at most one assignment with one source and one
destination head range.

MLA: the latent is replicated on every rank; decode rank d is written by prefill rank d % P.
A prefill that shards its KV pages (page_shards.py, `page_shards` = P = D) holds each page on
one rank only: every prefill rank writes every decode rank, each the pages it owns.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..layout import KVLayout


@dataclass(frozen=True, slots=True)
class Assignment:
    """One (prefill rank -> decode rank) flow: local head ranges on both sides."""

    prefill_rank: int
    decode_rank: int
    src_heads: tuple[int, int]  # [start, stop) in the prefill rank's local heads
    dst_heads: tuple[int, int]  # [start, stop) in the decode rank's local heads
    writer_index: int           # position of this writer among the decode rank's writers
    num_writers: int            # writers the decode rank waits for per chunk

    @property
    def num_heads(self) -> int:
        return self.src_heads[1] - self.src_heads[0]


@dataclass(frozen=True)
class HeadMapping:
    """The full mapping between two TP groups of one model."""

    prefill_tp: int
    decode_tp: int
    total_heads: int
    mla: bool
    assignments: tuple[Assignment, ...]
    page_shards: int = 1        # > 1: the prefill shards its pages; each writer writes the pages it owns

    def for_prefill(self, prefill_rank: int) -> list[Assignment]:
        """Flows a prefill rank writes (empty for ranks holding only unneeded replicas)."""
        return [a for a in self.assignments if a.prefill_rank == prefill_rank]

    def for_decode(self, decode_rank: int) -> list[Assignment]:
        """Writers of a decode rank, ordered by writer_index."""
        return sorted((a for a in self.assignments if a.decode_rank == decode_rank),
                      key=lambda a: a.writer_index)

    def writers_of(self, decode_rank: int) -> list[int]:
        return [a.prefill_rank for a in self.for_decode(decode_rank)]

    def notice_rank(self, prefill_rank: int) -> int | None:
        """The decode rank that tells a non-writing prefill rank about each room, so its
        sender can finish (prefill rank p is told by decode rank p % D); None for writers."""
        if self.for_prefill(prefill_rank):
            return None
        return prefill_rank % self.decode_tp

    def decode_peers_of(self, prefill_rank: int) -> list[int]:
        """Decode ranks whose room metadata a prefill rank waits for."""
        ranks = [a.decode_rank for a in self.for_prefill(prefill_rank)]
        return ranks or [prefill_rank % self.decode_tp]

    def prefill_peers_of(self, decode_rank: int) -> tuple[list[int], list[int]]:
        """(writers, notice-only prefill ranks) a decode rank sends room metadata to."""
        writers = self.writers_of(decode_rank)
        notices = [p for p in range(self.prefill_tp)
                   if not self.for_prefill(p) and p % self.decode_tp == decode_rank]
        return writers, notices

    def find(self, prefill_rank: int, decode_rank: int) -> Assignment | None:
        for a in self.assignments:
            if a.prefill_rank == prefill_rank and a.decode_rank == decode_rank:
                return a
        return None


def _heads(tp: int, heads: int, rank: int) -> range:
    if tp <= heads:
        n = heads // tp
        return range(rank * n, rank * n + n)
    h = rank // (tp // heads)
    return range(h, h + 1)


def _holders(tp: int, heads: int, head: int) -> list[int]:
    """Ranks of a TP group that hold global `head`, in rank order."""
    if tp <= heads:
        return [head // (heads // tp)]
    rep = tp // heads
    return list(range(head * rep, head * rep + rep))


def build_mapping(prefill: KVLayout, decode: KVLayout) -> HeadMapping:
    """Compute every flow between a prefill TP group and a decode TP group.

    Only model geometry is read from the layouts (tp_rank is ignored). Raises ValueError when
    the two layouts do not describe the same model.
    """
    if prefill.total_kv_heads != decode.total_kv_heads:
        raise ValueError(f"total_kv_heads differ: prefill {prefill.total_kv_heads}, decode {decode.total_kv_heads}")
    if prefill.mla != decode.mla:
        raise ValueError(f"mla differs: prefill {prefill.mla}, decode {decode.mla}")
    return compute_assignments(prefill.tp_size, decode.tp_size, prefill.total_kv_heads, prefill.mla,
                               prefill.page_shards)


def compute_assignments(P: int, D: int, H: int, mla: bool = False, page_shards: int = 1) -> HeadMapping:
    """The mapping for prefill TP `P`, decode TP `D` and `H` global KV heads (memoized: a pure
    function of its arguments, and every room of an engine pair asks the same question: one
    object per question however it is asked, so rooms share it).
    `page_shards` > 1: the prefill shards its pages over its TP group (MLA, P = D = page_shards)."""
    return _assignments(P, D, H, bool(mla), page_shards)


@functools.lru_cache(maxsize=256)
def _assignments(P: int, D: int, H: int, mla: bool, page_shards: int) -> HeadMapping:
    for name, tp in (("prefill tp_size", P), ("decode tp_size", D)):
        if tp <= 0 or (not mla and H % tp and tp % H):
            raise ValueError(f"{name}={tp} does not divide, and is not a multiple of, total_kv_heads={H}")
    if page_shards != 1:
        if not mla or not P == D == page_shards:
            raise ValueError(f"pages sharded {page_shards} ways need an MLA model and prefill and decode TP sizes "
                             f"equal to it, got prefill TP {P}, decode TP {D}{'' if mla else ', not MLA'}")
        every = [Assignment(p, d, (0, 1), (0, 1), p, P) for d in range(D) for p in range(P)]
        return HeadMapping(P, D, H, True, tuple(every), page_shards)
    if mla:
        if H != 1:
            raise ValueError("MLA has exactly one latent head")
        replicated = [Assignment(d % P, d, (0, 1), (0, 1), 0, 1) for d in range(D)]
        return HeadMapping(P, D, H, True, tuple(replicated))

    flows: list[Assignment] = []
    for d in range(D):
        dst = _heads(D, H, d)
        # decode replicas of the same heads spread over the prefill replicas of those heads
        replica = d % (D // H) if D > H else 0
        runs: list[list[int]] = []  # [prefill_rank, first_head, stop_head]
        for h in dst:
            holders = _holders(P, H, h)
            p = holders[replica % len(holders)]
            if runs and runs[-1][0] == p and runs[-1][2] == h:
                runs[-1][2] = h + 1
            else:
                runs.append([p, h, h + 1])
        for w, (p, h0, h1) in enumerate(runs):
            src0 = _heads(P, H, p).start
            flows.append(Assignment(
                prefill_rank=p, decode_rank=d,
                src_heads=(h0 - src0, h1 - src0),
                dst_heads=(h0 - dst.start, h1 - dst.start),
                writer_index=w, num_writers=len(runs)))
    return HeadMapping(P, D, H, False, tuple(flows))
