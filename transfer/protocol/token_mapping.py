"""Who writes which tokens where, when the decode engine splits its KV by token position. Pure.

Decode context parallel (DCP) splits a request's KV along the token axis over the N ranks of a
DCP group (SGLang 0.5.23, MLA only): global token t lives on DCP rank ``t % N`` at local slot
``t // N``. A rank's pages hold its local slots in order, ``page_size`` slots a page, so one
page of each of the N ranks together covers ``page_size * N`` consecutive tokens (a "virtual
page"). This module is the token axis beside the head axis of ``head_mapping``: for a pairing
of a prefill DCP group with a decode DCP group it says, for each (prefill rank, decode rank)
pair, which tokens move from which source slot to which destination slot.

Pairings served (those SGLang's mooncake backend serves, ``requires_dcp_relayout``):
- ``SPLIT``: prefill DCP 1 -> decode DCP N (N >= 1). The one prefill rank holds the request's
  tokens in order; every decode rank d receives the tokens ``t % N == d``.
- ``EQUAL``: prefill DCP N -> decode DCP N (N > 1). Both sides split the same way; prefill rank
  r writes decode rank r, local slot for local slot (the identity per rank, no relayout).

Every other pairing raises ValueError naming both layouts (DCP on the prefill side only,
N -> M with M != N): ``describe_pairing`` gives the same reason without raising, for a
request to fail on both sides with it.

Inputs are per request: its token count L, the decode prefix (tokens [0, prefix) already on
the decode side; a multiple of ``page_size * N_decode``, so each decode rank's prefix is whole
pages) and the page lists that hold tokens [prefix, L): one list per prefill DCP rank and one
per decode DCP rank. Each rank's list holds that rank's local slots from ``prefix // N`` on,
``page_size`` slots a page, and is ``ceil((L - prefix) / (page_size * N))`` pages long (SGLang
allocates every DCP rank the request's virtual pages; a rank may leave the tail of its last
page, or its whole last page, unwritten). Slot s of page p is pool slot ``p * page_size + s``:
the runs below merge across a page boundary only where the page ids are consecutive.

Invariants (tested in ``tests/unit/test_token_mapping.py``):
- every token of [prefix, L) is moved exactly once, to decode rank ``t % N`` at local slot
  ``t // N``, from the prefill slot that holds it; nothing outside [prefix, L) is touched
  (the final partial page is exact);
- each decode rank has exactly one writer; runs never overlap on either side;
- runs are maximal: two adjacent runs of a pair are never contiguous on both sides;
- the staged piece of a decode rank is its tokens in increasing position, which is also
  increasing local slot, so the piece lands by ``piece_runs`` in page runs; the direct runs'
  sources, read in order, are exactly the piece.

A prefill rank with staging buffers writes a split this way (``PairTokens.relayout``,
``worth_relayout``): it gathers the piece into a buffer and writes it as the piece runs, a few
ranges per layer, instead of one range per token and layer.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np


class DCPPairing(enum.Enum):
    """How a prefill DCP group pairs with a decode DCP group."""

    SPLIT = "split"  # prefill DCP 1 -> decode DCP N: the prefill's tokens dealt round-robin
    EQUAL = "equal"  # prefill DCP N -> decode DCP N (N > 1): rank r -> rank r, slot for slot


@dataclass(frozen=True, slots=True, kw_only=True)
class DCPLayout:
    """One side's token-axis geometry: its DCP group size, page size, and whether it is MLA."""

    dcp_size: int
    page_size: int
    mla: bool

    def describe(self, side: str) -> str:
        kind = "MLA" if self.mla else "GQA/MHA"
        return f"{side} DCP {self.dcp_size} (page_size {self.page_size}, {kind})"


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenRun:
    """Tokens [first_token, first_token + length) of one pair: pool slots
    ``src_page * page_size + src_offset ...`` on the prefill rank go to
    ``dst_page * page_size + dst_offset ...`` on the decode rank (consecutive slots; a run that
    crosses a page boundary continues in the next page id)."""

    first_token: int
    src_page: int
    src_offset: int
    dst_page: int
    dst_offset: int
    length: int


@dataclass(frozen=True, slots=True, kw_only=True)
class PieceRun:
    """Piece bytes of tokens [piece_offset, piece_offset + length) of a staged piece land at
    decode pool slots ``dst_page * page_size + dst_offset ...`` (consecutive slots)."""

    piece_offset: int
    dst_page: int
    dst_offset: int
    length: int


@dataclass(frozen=True, eq=False, kw_only=True)
class PairTokens:
    """One (prefill rank -> decode rank) flow on the token axis.

    Direct path: the runs as arrays (one entry per run, in token order), what backend
    descriptors are built from (times layers and the per-token bytes). Staged path: ``piece``
    is the order of the tokens in the decode rank's piece (global positions), gathered from the
    runs' sources in order and scattered by ``piece_runs``.
    """

    prefill_rank: int
    decode_rank: int
    page_size: int
    first_token: np.ndarray  # int64, global position of each run's first token
    src_slot: np.ndarray  # int64, prefill pool slot (page * page_size + offset)
    dst_slot: np.ndarray  # int64, decode pool slot
    length: np.ndarray  # int64, tokens per run (>= 1)
    piece: range  # global positions, in piece order
    piece_runs: tuple[PieceRun, ...]

    @property
    def num_tokens(self) -> int:
        return len(self.piece)

    def runs(self) -> tuple[TokenRun, ...]:
        """The runs as page + offset on both sides (for reading and tests; build descriptors
        from the arrays)."""
        ps = self.page_size
        return tuple(
            TokenRun(
                first_token=int(t),
                src_page=int(s) // ps,
                src_offset=int(s) % ps,
                dst_page=int(d) // ps,
                dst_offset=int(d) % ps,
                length=int(n),
            )
            for t, s, d, n in zip(self.first_token, self.src_slot, self.dst_slot, self.length, strict=True)
        )


    def relayout(self) -> Relayout:
        """The flow as a relayout: its tokens gathered on the prefill rank into one buffer, in
        piece order, and written from there as the decode rank's runs of consecutive slots."""
        runs = self.piece_runs
        return Relayout(src_slots=run_slots(self.src_slot, self.length),
                        dst_slot=np.asarray([r.dst_page * self.page_size + r.dst_offset for r in runs], dtype=np.int64),
                        length=np.asarray([r.length for r in runs], dtype=np.int64))


@dataclass(frozen=True, eq=False, kw_only=True)
class Relayout:
    """One pair's tokens moved through a staging buffer (decode context parallel, the prefill
    rank's side): `src_slots` are the prefill pool slots of the pair's tokens in piece order,
    gathered per tensor one token after the other; the gathered tokens land as the runs
    (`dst_slot`, `length`) of consecutive decode slots, in the same order. A write then needs
    one range per destination run and tensor instead of one per source run and tensor
    (`PairTokens.src_slot`), where a split of the tokens over N decode ranks leaves source runs
    of one token each."""

    src_slots: np.ndarray   # int64, one per token, in piece order
    dst_slot: np.ndarray    # int64, each destination run's first decode pool slot
    length: np.ndarray      # int64, tokens per destination run; sums to len(src_slots)

    @property
    def num_tokens(self) -> int:
        return int(self.src_slots.size)


def run_slots(slot: np.ndarray, length: np.ndarray) -> np.ndarray:
    """Every slot of runs of consecutive slots (`length[i]` from `slot[i]` on), in order."""
    slot, length = np.asarray(slot, dtype=np.int64), np.asarray(length, dtype=np.int64)
    starts = np.cumsum(length) - length
    offsets = np.arange(int(length.sum()), dtype=np.int64) - np.repeat(starts, length)
    out: np.ndarray = np.repeat(slot, length) + offsets
    return out


def first_slots(pages: np.ndarray, count: int, page_size: int) -> np.ndarray:
    """The first `count` pool slots of a page list, in order (a DCP rank's local slots)."""
    index = np.arange(count, dtype=np.int64)
    out: np.ndarray = np.asarray(pages, dtype=np.int64)[index // page_size] * page_size + index % page_size
    return out


def worth_relayout(pair: PairTokens) -> Relayout | None:
    """The pair's relayout where it pays: where its source runs are shorter than a page on
    average (a DCP split: runs of one token) and its destination runs fewer. The gather copies
    every byte once more, which only replacing many short ranges by fewer long ones is worth;
    where both sides already move runs of pages (DCP N -> N), None: the direct runs."""
    runs = int(pair.length.size)
    if not runs or pair.num_tokens >= runs * pair.page_size:
        return None
    moves = pair.relayout()
    return moves if moves.length.size < runs else None


@dataclass(frozen=True, eq=False, kw_only=True)
class TokenMapping:
    """Every token-axis flow of one request between a prefill and a decode DCP group."""

    pairing: DCPPairing
    prefill: DCPLayout
    decode: DCPLayout
    num_tokens: int
    prefix: int
    window: tuple[int, int]  # the tokens [start, stop) these flows move
    pairs: tuple[PairTokens, ...]  # one per decode rank, in decode rank order

    def for_decode(self, decode_rank: int) -> PairTokens:
        """The one flow writing a decode rank."""
        return self.pairs[decode_rank]

    def for_prefill(self, prefill_rank: int) -> list[PairTokens]:
        """Flows a prefill rank writes: every decode rank for SPLIT, its own rank for EQUAL."""
        return [p for p in self.pairs if p.prefill_rank == prefill_rank]


def describe_pairing(prefill: DCPLayout, decode: DCPLayout) -> DCPPairing | str:
    """The pairing of two DCP groups, or the reason kvstage cannot serve it (naming both
    layouts; a request between them fails on both sides with this reason)."""
    both = f"{prefill.describe('prefill')} -> {decode.describe('decode')}"
    for side, lay in (("prefill", prefill), ("decode", decode)):
        if lay.dcp_size < 1 or lay.page_size < 1:
            return f"{both}: {side} dcp_size and page_size must be >= 1"
    if prefill.page_size != decode.page_size:
        return f"{both}: page sizes differ (DCP moves tokens between pages of the same size)"
    if prefill.dcp_size == 1 and decode.dcp_size == 1:
        return DCPPairing.SPLIT  # no DCP on either side: the token axis is the identity
    if not (prefill.mla and decode.mla):
        return f"{both}: decode context parallel is served for MLA only (as SGLang's)"
    if prefill.dcp_size == decode.dcp_size:
        return DCPPairing.EQUAL
    if prefill.dcp_size == 1:
        return DCPPairing.SPLIT
    if decode.dcp_size == 1:
        return f"{both}: DCP on the prefill side only is not served (prefill DCP must be 1 or equal the decode's)"
    return f"{both}: DCP {prefill.dcp_size} -> {decode.dcp_size} is not served (prefill DCP must be 1 or equal the decode's)"


def engine_refusal(prefill: DCPLayout, decode: DCPLayout) -> str | None:
    """Why kvstage's engine cannot move a request between these two DCP groups (None: it can).

    Every pairing `describe_pairing` refuses, with its reason (naming both layouts). The engine
    moves the served ones (1 -> N, N -> N, MLA) on the direct path, which is the only path of an
    MLA model (docs/protocol.md, "Decode context parallel"). The prefill rank fails a refused
    request on both sides with this reason when the decode rank's metadata arrives
    (prefill/room.py, PrefillRoom.add_meta)."""
    pairing = describe_pairing(prefill, decode)
    return pairing if isinstance(pairing, str) else None


def check_dcp_rank(dcp_size: int, dcp_rank: int, tp_size: int, tp_rank: int) -> str | None:
    """What is wrong with a rank's declared DCP size and rank (None: nothing): the size must
    divide the TP size and the rank be ``tp_rank % dcp_size`` (KVLayout.dcp_rank)."""
    if dcp_size < 1 or tp_size % dcp_size:
        return f"dcp_size {dcp_size} must be >= 1 and divide tp_size {tp_size}"
    if dcp_rank != tp_rank % dcp_size:
        return f"dcp_rank {dcp_rank} of TP rank {tp_rank} must be tp_rank % dcp_size = {tp_rank % dcp_size}"
    return None


def _slots(pages: tuple[int, ...], index: np.ndarray, page_size: int) -> np.ndarray:
    """Pool slots of local indices `index` into a rank's page list."""
    arr = np.asarray(pages, dtype=np.int64)
    slots: np.ndarray = arr[index // page_size] * page_size + index % page_size
    return slots


def _check_pages(both: str, side: str, lists: tuple[tuple[int, ...], ...], ranks: int, need: int) -> None:
    if len(lists) != ranks:
        raise ValueError(f"{both}: {len(lists)} {side} page lists for {ranks} {side} DCP ranks")
    for r, pages in enumerate(lists):
        if len(pages) != need:
            raise ValueError(f"{both}: {side} DCP rank {r} has {len(pages)} pages, the request needs {need}")
        if any(p < 0 for p in pages) or len(set(pages)) != len(pages):
            raise ValueError(f"{both}: {side} DCP rank {r} page list has a negative or repeated page: {pages}")


def build_token_mapping(
    *,
    prefill: DCPLayout,
    decode: DCPLayout,
    num_tokens: int,
    prefix: int,
    prefill_pages: tuple[tuple[int, ...], ...],
    decode_pages: tuple[tuple[int, ...], ...],
    window: tuple[int, int] | None = None,
) -> TokenMapping:
    """Every (prefill rank, decode rank) flow of one request, tokens [prefix, num_tokens).

    `window` = (start, stop), prefix <= start <= stop <= num_tokens, keeps only the tokens of
    [start, stop): one chunk of a chunked send (the page lists stay the whole request's). The
    windows of a partition of [prefix, num_tokens) together move what the whole request moves,
    each decode rank's tokens in the same order.

    `prefill_pages[r]` / `decode_pages[d]`: the page list of prefill DCP rank r / decode DCP
    rank d holding its local slots from ``prefix // dcp_size`` on (see the module docstring
    for their lengths). Raises ValueError, naming both layouts, for a pairing kvstage cannot
    serve, a prefix not aligned to ``page_size * N_decode``, or page lists of the wrong count,
    length, or with a repeated page.
    """
    pairing = describe_pairing(prefill, decode)
    both = f"{prefill.describe('prefill')} -> {decode.describe('decode')}"
    if isinstance(pairing, str):
        raise ValueError(pairing)
    ps, n = decode.page_size, decode.dcp_size
    virtual = ps * n
    if not 0 <= prefix <= num_tokens:
        raise ValueError(f"{both}: prefix {prefix} outside the request's {num_tokens} tokens")
    if prefix % virtual:
        raise ValueError(f"{both}: decode prefix {prefix} is not a multiple of page_size x decode DCP = {virtual}")
    new = num_tokens - prefix
    _check_pages(both, "prefill", prefill_pages, prefill.dcp_size, -(-new // (ps * prefill.dcp_size)))
    _check_pages(both, "decode", decode_pages, n, -(-new // virtual))
    start, stop = (prefix, num_tokens) if window is None else window
    if not prefix <= start <= stop <= num_tokens:
        raise ValueError(f"{both}: window [{start}, {stop}) outside the tokens [{prefix}, {num_tokens}) to move")

    pairs = tuple(_pair(pairing, prefill, decode, prefix, start, stop, prefill_pages, decode_pages, d)
                  for d in range(n))
    return TokenMapping(
        pairing=pairing,
        prefill=prefill,
        decode=decode,
        num_tokens=num_tokens,
        prefix=prefix,
        window=(start, stop),
        pairs=pairs,
    )


def _pair(pairing: DCPPairing, prefill: DCPLayout, decode: DCPLayout, prefix: int, start: int, stop: int,
          prefill_pages: tuple[tuple[int, ...], ...], decode_pages: tuple[tuple[int, ...], ...], d: int) -> PairTokens:
    """The flow writing decode rank `d`: tokens [start, stop) of it (page lists already checked)."""
    ps, n = decode.page_size, decode.dcp_size
    piece = range(start + (d - start) % n, stop, n)
    p = d if pairing is DCPPairing.EQUAL else 0
    tokens = np.arange(piece.start, piece.stop, n, dtype=np.int64)
    src_index = tokens // prefill.dcp_size - prefix // prefill.dcp_size
    dst_index = tokens // n - prefix // n
    src = _slots(prefill_pages[p], src_index, ps)
    dst = _slots(decode_pages[d], dst_index, ps)
    if tokens.size:
        breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
        starts = np.concatenate(([0], breaks))
        lengths = np.diff(np.concatenate((starts, [tokens.size])))
    else:
        starts = lengths = np.empty(0, dtype=np.int64)
    # the piece lands slot after slot: runs of consecutive destination slots
    if dst.size:
        pbreaks = np.flatnonzero(np.diff(dst) != 1) + 1
        pstarts = np.concatenate(([0], pbreaks))
        plens = np.diff(np.concatenate((pstarts, [dst.size])))
    else:
        pstarts = plens = np.empty(0, dtype=np.int64)
    piece_runs = tuple(
        PieceRun(piece_offset=int(k), dst_page=int(dst[k]) // ps, dst_offset=int(dst[k]) % ps, length=int(m))
        for k, m in zip(pstarts, plens, strict=True)
    )
    return PairTokens(
        prefill_rank=p,
        decode_rank=d,
        page_size=ps,
        first_token=tokens[starts],
        src_slot=src[starts],
        dst_slot=dst[starts],
        length=lengths.astype(np.int64),
        piece=piece,
        piece_runs=piece_runs,
    )


def build_pair(
    *,
    prefill: DCPLayout,
    decode: DCPLayout,
    num_tokens: int,
    prefix: int,
    src_pages: tuple[int, ...],
    dst_pages: tuple[int, ...],
    decode_rank: int,
) -> PairTokens:
    """The one flow writing `decode_rank`, from the page lists of its two ends only: what a
    prefill rank needs for one decode rank (it knows no other rank's pages). Equal to
    ``build_token_mapping(...).for_decode(decode_rank)`` for any page lists of the other ranks;
    raises ValueError as it does (the other ranks' lists are checked as if of the right length)."""
    pairing = describe_pairing(prefill, decode)
    if isinstance(pairing, str):
        raise ValueError(pairing)
    if not 0 <= decode_rank < decode.dcp_size:
        raise ValueError(f"decode DCP rank {decode_rank} outside the decode DCP group of {decode.dcp_size}")
    p = decode_rank if pairing is DCPPairing.EQUAL else 0
    new = num_tokens - prefix
    src_need, dst_need = -(-new // (prefill.page_size * prefill.dcp_size)), -(-new // (decode.page_size * decode.dcp_size))
    filler_src, filler_dst = tuple(range(max(src_need, 0))), tuple(range(max(dst_need, 0)))
    mapping = build_token_mapping(
        prefill=prefill, decode=decode, num_tokens=num_tokens, prefix=prefix,
        prefill_pages=tuple(src_pages if r == p else filler_src for r in range(prefill.dcp_size)),
        decode_pages=tuple(dst_pages if r == decode_rank else filler_dst for r in range(decode.dcp_size)),
    )
    return mapping.for_decode(decode_rank)


def local_tokens(decode: DCPLayout, decode_rank: int, num_tokens: int, prefix: int) -> int:
    """How many of the tokens [prefix, num_tokens) decode DCP rank `decode_rank` holds: those
    with ``t % dcp_size == decode_rank``."""
    n = decode.dcp_size
    return len(range(prefix + (decode_rank - prefix) % n, num_tokens, n))


def local_pages(layout: DCPLayout, num_tokens: int) -> int:
    """Pages every rank of a DCP group holds for `num_tokens` tokens (its share of the request's
    virtual pages of ``page_size * dcp_size`` tokens)."""
    return -(-num_tokens // (layout.page_size * layout.dcp_size))
