"""Decode side: what a room expects, what has landed, and when it is complete. Pure.

A room is a grid of (page, layer) cells: a chunk covers a page range of a layer range (all
layers unless the prefill sends layer-wise, layer_sends.py).

Staged path: the decode rank allocates every piece of a chunk itself, so each arrival must
match its allocation exactly (page range, layer range, byte length, ring position, an expected
writer); a piece is ready to scatter once all its writers have landed, and the room is complete
once pieces covering every cell have been scattered.

Direct path: writes land in the KV pages themselves; each writer must cover every cell of the
room exactly once with the expected number of bytes. From a prefill that shards its pages
(page_shards.py) the writers share the cells instead (`shared`): each write names the positions
it holds with a page mask, and every cell must come exactly once from any writer.

Arrivals may come in any order; exact duplicates are ignored; anything else that disagrees
is rejected with a reason, and the caller fails the room.

Memory: a decode rank holds one tracker per room in flight (thousands), so it keeps only what
its path needs and makes it when first needed: the staged bookkeeping (pieces, planned cells)
on the first piece, the direct one (one coverage array for all writers, the writes seen, split
writes) on the first direct arrival; a room without PP or state pools shares empty maps.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from ..page_shards import decode_mask

MAX_GROUPS = 16   # pairs of memory kinds, plus pools with writes of their own: a few at most
_NONE: Mapping[int, int] = MappingProxyType({})   # no state pool bytes: shared by every tracker
_NO_STAGES: Mapping[int, range] = MappingProxyType({})   # no PP: every writer holds every layer
SHARED_EMPTY = (_NONE, _NO_STAGES)   # what every tracker may share (memory measurements leave them out)


class Outcome(enum.Enum):
    ACCEPTED = "accepted"          # recorded; more writers still expected for this piece
    PARTIAL = "partial"            # direct: one backend write of a logical write split by memory
                                   # kind landed; the others are still due (nothing counts yet)
    PIECE_LANDED = "piece_landed"  # staged: every writer of the piece landed, scatter it
    DUPLICATE = "duplicate"        # already seen; ignore
    REJECTED = "rejected"          # disagrees with what is expected; fail the room


@dataclass(frozen=True)
class Arrival:
    outcome: Outcome
    reason: str = ""
    piece: ExpectedPiece | None = None


@dataclass(kw_only=True, slots=True)
class ExpectedPiece:
    chunk: int
    index: int
    page_start: int
    num_pages: int
    layers: range
    ring_start: int
    writers: tuple[int, ...]
    landed_mask: int = 0           # bit w: writer w landed (writers 0 to 7 in a cached small int, no bytes of
                                   # its own; a tuple of 8 took 120 bytes, a set 728)
    scattered: bool = False
    region_nbytes: int = 0         # staged: its ring region's bytes (its grant says them again, AllocGrant)

    @property
    def key(self) -> tuple[int, int]:
        return (self.chunk, self.index)

    def has_landed(self, writer: int) -> bool:
        return bool(self.landed_mask >> writer & 1)

    @property
    def all_landed(self) -> bool:
        """Every writer of the piece landed (only its writers are ever marked)."""
        return self.landed_mask.bit_count() == len(self.writers)


class RoomTracker:
    """Arrival bookkeeping of one room on one decode rank."""

    __slots__ = ("num_pages", "num_layers", "writer_page_bytes", "final_extra", "_all_layers", "_stage_layers",
                 "_held", "_writers", "_covered", "_covered_count", "_pieces", "_planned", "_scattered_cells",
                 "_direct_seen", "_groups", "token_bytes", "shared")

    def __init__(self, num_pages: int, writer_page_bytes: Mapping[int, int], final_extra: Mapping[int, int] = {},
                 num_layers: int = 1, writer_layers: Mapping[int, range] = {}, held: range | None = None,
                 writers: tuple[int, ...] | None = None, token_bytes: Mapping[int, int] | None = None,
                 shared: bool = False):
        """`writer_page_bytes`: expected writer rank -> bytes it writes per page of the room
        (every layer; a read-only map, MappingProxyType, is kept as given: the rooms of one
        plan share it, RoomPlan.writer_bytes; any other is copied); `final_extra`: writer rank
        -> state pool bytes its write of the last page of the last layer also carries;
        `writer_layers`: writer rank -> the layers it writes, its PP stage's (absent: every
        layer); `held`: the layers this decode rank holds, its own PP stage's (None: every
        layer), the ones the room must cover; `writers`: the ranks of `writer_page_bytes` in
        its order, when the caller shares one tuple among rooms (RoomPlan.writer_ranks).
        `token_bytes` (decode context parallel, direct): writer rank -> the exact bytes it writes
        over every layer (this rank's tokens of the request, a last page partly filled:
        token_mapping.local_tokens), in writes of every page and a range of layers each, their
        bytes in proportion, the write of the last layer also carrying `final_extra` (a rank
        owning no token gets its pool items in a write of every layer and no token bytes);
        None: whole pages. `shared` (a prefill sharding its pages, direct): the writers share the
        cells, each write naming its positions with a page mask (`arrive_direct`), every cell
        taken once from any writer; the write holding the last page of the last layer carries
        that writer's `final_extra`."""
        if num_pages <= 0:
            raise ValueError("a room has at least one page")
        if not writer_page_bytes:
            raise ValueError("a room has at least one writer")
        if num_layers <= 0 or any(b % num_layers for b in writer_page_bytes.values()):
            raise ValueError(f"a writer's bytes per page are not split evenly over {num_layers} layers")
        self.num_pages = num_pages
        self.num_layers = num_layers
        self.token_bytes = token_bytes
        self.shared = shared
        self.writer_page_bytes: Mapping[int, int] = (writer_page_bytes if type(writer_page_bytes) is MappingProxyType
                                                     else dict(writer_page_bytes))
        self.final_extra: Mapping[int, int] = dict(final_extra) if final_extra else _NONE
        self._all_layers = range(num_layers)
        self._held = held if held is not None else self._all_layers
        if self._held.start < 0 or self._held.stop > num_layers or not len(self._held):
            raise ValueError(f"held layers {self._held} outside the room's {num_layers} layers")
        self._stage_layers = {w: held for w, held in writer_layers.items()   # PP only: a writer absent holds all
                              if w in self.writer_page_bytes and held != self._all_layers} or _NO_STAGES
        if writers is not None and writers != tuple(self.writer_page_bytes):
            raise ValueError(f"writers {writers} are not the writers {tuple(self.writer_page_bytes)} in their order")
        self._writers = writers if writers is not None else tuple(self.writer_page_bytes)   # a writer's index in
                                                                                           # the direct path's arrays
        # direct path, made on its first arrival: cells covered (writer index, page, layer), and per writer
        self._covered: np.ndarray | None = None
        self._covered_count: list[int] | None = None
        self._direct_seen: set[tuple[int, int, int, int]] | None = None
        self._groups: dict[tuple[int, int, int, int], tuple[int, set[int]]] | None = None   # split writes
        # staged path, made on its first piece
        self._pieces: dict[tuple[int, int], ExpectedPiece] | None = None
        self._planned: np.ndarray | None = None   # cells already given a piece
        self._scattered_cells = 0

    @property
    def writer_layers(self) -> dict[int, range]:
        """Writer rank -> the layers it writes (its PP stage's)."""
        return {w: self.layers_of(w) for w in self.writer_page_bytes}

    @property
    def all_layers(self) -> range:
        """range(num_layers), one object per tracker (its pieces of every layer share it)."""
        return self._all_layers

    def layers_of(self, writer: int) -> range:
        return self._stage_layers.get(writer, self._all_layers)

    # -- staged path ----------------------------------------------------------------------
    def overlaps_plan(self, page_start: int, num_pages: int, layers: range | None = None) -> bool:
        """Would a new chunk over these cells collide with pieces already planned?"""
        if self._planned is None:
            return False
        lay = self._layers(layers)
        return bool(self._planned[page_start:page_start + num_pages, lay.start:lay.stop].any())

    def bytes_of(self, writer: int, num_pages: int, layers: range | None = None) -> int:
        """What `writer` writes for `num_pages` pages of `layers` (None: all), pools aside."""
        return num_pages * self.writer_page_bytes[writer] * len(self._layers(layers)) // self.num_layers

    def final(self, page_start: int, num_pages: int, layers: range | None = None,
              mask: np.ndarray | None = None, writer: int | None = None) -> bool:
        """Whether these cells hold the room's last page of its last layer, or of the last layer
        `writer` writes here (PP: its stage's overlap with this rank's): the write that carries
        that writer's pools; `mask`: the positions of the range a sharded writer's write holds
        (None: all)."""
        end = self._held.stop if writer is None else min(self.layers_of(writer).stop, self._held.stop)
        return (page_start + num_pages == self.num_pages and self._layers(layers).stop == end
                and (mask is None or bool(mask[-1])))

    def page_mask(self, pages_mask: bytes, num_pages: int) -> np.ndarray | None | str:
        """A direct write's page mask (Tag.pages_mask): None when it has none (every position of
        its range), the mask, or why it cannot be one of this room's."""
        if not pages_mask:
            return None
        if not self.shared:
            return "a page mask in a room whose prefill does not shard its pages"
        mask = decode_mask(pages_mask, num_pages)
        if mask is None or not mask.any():
            return f"a page mask of {len(pages_mask)} bytes that names no page, or a page outside its {num_pages}"
        return mask

    def layers_ok(self, layers: range) -> bool:
        return len(layers) > 0 and 0 <= layers.start and layers.stop <= self.num_layers

    def writers_of(self, layers: range) -> list[int]:
        """The writers that hold `layers` (PP: one stage's writers), in rank order."""
        return sorted(w for w in self.writer_page_bytes
                      if (held := self.layers_of(w)).start <= layers.start and layers.stop <= held.stop)

    def _layers(self, layers: range | None) -> range:
        return self._all_layers if layers is None else layers

    def expect_piece(self, chunk: int, index: int, page_start: int, num_pages: int,
                     ring_start: int, writers: Sequence[int], layers: range | None = None,
                     region_nbytes: int = 0) -> ExpectedPiece:
        """Record an allocated piece (`region_nbytes`: its ring region's bytes, kept for the
        room's grants). Raises ValueError if it cannot belong to this room."""
        lay = self._layers(layers)
        self._check_range(page_start, num_pages)
        if not self.layers_ok(lay):
            raise ValueError(f"layers [{lay.start}, {lay.stop}) outside the room's {self.num_layers} layers")
        if self.overlaps_plan(page_start, num_pages, lay):
            raise ValueError(f"pages [{page_start}, {page_start + num_pages}) of layers [{lay.start}, {lay.stop}) "
                             f"are already planned")
        unknown = set(writers) - set(self.writer_page_bytes)
        if unknown or not writers:
            raise ValueError(f"piece writers {sorted(writers)} are not this room's writers")
        named = tuple(writers)
        piece = ExpectedPiece(chunk=chunk, index=index, page_start=page_start, num_pages=num_pages, layers=lay,
                              ring_start=ring_start, writers=self._writers if named == self._writers else named,
                              region_nbytes=region_nbytes)
        if self._pieces is None or self._planned is None:
            self._pieces, self._planned = {}, np.zeros((self.num_pages, self.num_layers), dtype=bool)
        if piece.key in self._pieces:
            raise ValueError(f"piece {piece.key} is already expected")
        self._pieces[piece.key] = piece
        self._planned[page_start:page_start + num_pages, lay.start:lay.stop] = True
        return piece

    def arrive_staged(self, writer: int, chunk: int, index: int, page_start: int, num_pages: int,
                      nbytes: int, ring_start: int, layers: range | None = None) -> Arrival:
        piece = self._pieces.get((chunk, index)) if self._pieces is not None else None
        if piece is None:
            return Arrival(Outcome.REJECTED, f"no allocation for chunk {chunk} piece {index}")
        if writer not in piece.writers:
            return Arrival(Outcome.REJECTED, f"writer {writer} is not a writer of chunk {chunk} piece {index}")
        lay = self._layers(layers)
        got = (page_start, num_pages, lay.start, len(lay), nbytes, ring_start)
        want = (piece.page_start, piece.num_pages, piece.layers.start, len(piece.layers),
                self.bytes_of(writer, piece.num_pages, piece.layers)
                + self._extra(writer, piece.page_start, piece.num_pages, piece.layers), piece.ring_start)
        if got != want:
            return Arrival(Outcome.REJECTED,
                           f"chunk {chunk} piece {index} from writer {writer}: (pages start, count, layers "
                           f"start, count, bytes, ring) {got} does not match the allocation {want}")
        if piece.has_landed(writer):
            return Arrival(Outcome.DUPLICATE, piece=piece)
        piece.landed_mask |= 1 << writer
        if piece.all_landed:
            return Arrival(Outcome.PIECE_LANDED, piece=piece)
        return Arrival(Outcome.ACCEPTED, piece=piece)

    def mark_scattered(self, piece: ExpectedPiece) -> None:
        if piece.scattered:
            return
        if not piece.all_landed:
            raise ValueError(f"piece {piece.key} scattered before all writers landed")
        piece.scattered = True
        self._scattered_cells += piece.num_pages * len(piece.layers)

    def pieces(self) -> list[ExpectedPiece]:
        return list(self._pieces.values()) if self._pieces is not None else []

    # -- direct path ----------------------------------------------------------------------
    def arrive_direct(self, writer: int, chunk: int, page_start: int, num_pages: int, nbytes: int,
                      group: int = 0, groups: int = 1, layers: range | None = None,
                      pages_mask: bytes = b"") -> Arrival:
        """One tagged backend write. A logical write whose memory spans several pairs of kinds
        comes as `groups` backend writes with the same tag but for `group`: it counts (and its
        pages are covered) only once every group landed; until then PARTIAL. `pages_mask`: the
        positions of the range a sharded writer's write holds (`shared` rooms only)."""
        if writer not in self.writer_page_bytes:
            return Arrival(Outcome.REJECTED, f"writer {writer} is not expected in this room")
        key = (writer, chunk, page_start, num_pages)
        if self._direct_seen is not None and key in self._direct_seen:
            return Arrival(Outcome.DUPLICATE)
        if groups != 1:
            split = self._arrive_group(key, group, groups)
            if split is not None:
                return split
        lay = self._layers(layers)
        if not self._in_range(page_start, num_pages) or not self.layers_ok(lay):
            return Arrival(Outcome.REJECTED, f"pages [{page_start}, {page_start + num_pages}) of layers "
                                             f"[{lay.start}, {lay.stop}) outside the room's {self.num_pages} "
                                             f"pages and {self.num_layers} layers")
        if writer not in self.writers_of(lay):
            held = self.layers_of(writer)
            return Arrival(Outcome.REJECTED, f"writer {writer} wrote layers [{lay.start}, {lay.stop}), its PP stage "
                                             f"holds [{held.start}, {held.stop})")
        mask = self.page_mask(pages_mask, num_pages)
        if isinstance(mask, str):
            return Arrival(Outcome.REJECTED, f"writer {writer} sent {mask}")
        count = num_pages if mask is None else int(mask.sum())
        want = self.bytes_of(writer, count, lay) + (self.final_extra.get(writer, 0)
                                                   if self.final(page_start, num_pages, lay, mask, writer) else 0)
        if self.token_bytes is not None:   # DCP: writes of every page and some layers, of this rank's tokens
            if page_start != 0 or num_pages != self.num_pages:
                return Arrival(Outcome.REJECTED, f"writer {writer} wrote pages [{page_start}, {page_start + num_pages}): "
                                                 f"a decode context parallel room takes writes of all of its "
                                                 f"{self.num_pages} pages")
            want = self.token_bytes.get(writer, -1) * len(lay) // self.num_layers + self._extra(writer, 0, num_pages, lay)
        if nbytes != want:
            return Arrival(Outcome.REJECTED, f"writer {writer} sent {nbytes} bytes for {num_pages} pages of "
                                             f"{len(lay)} layers, expected {want}")
        if self._covered is None or self._covered_count is None or self._direct_seen is None:
            rows = 1 if self.shared else len(self._writers)   # shared: one grid for every writer
            self._covered = np.zeros((rows, self.num_pages, self.num_layers), dtype=bool)
            self._covered_count, self._direct_seen = [0] * rows, set()
        i = 0 if self.shared else self._writers.index(writer)
        cells = self._covered[i, page_start:page_start + num_pages, lay.start:lay.stop]
        if mask is not None:
            cells = cells[mask]   # a copy: written back below
        if cells.any():
            return Arrival(Outcome.REJECTED, f"writer {writer} wrote pages [{page_start}, "
                                             f"{page_start + num_pages}) of layers [{lay.start}, {lay.stop}) twice"
                                             + (" (a page another writer wrote)" if self.shared else ""))
        if mask is None:
            self._covered[i, page_start:page_start + num_pages, lay.start:lay.stop] = True
        else:
            self._covered[i, page_start + np.flatnonzero(mask), lay.start:lay.stop] = True
        self._covered_count[i] += count * len(lay)
        self._direct_seen.add(key)
        if self._groups is not None:
            self._groups.pop(key, None)
        return Arrival(Outcome.ACCEPTED)

    def group_completes(self, key: tuple[int, int, int, int], group: int, groups: int) -> bool:
        """Whether group `group` would be the last of its write to land (nothing recorded)."""
        seen = self._groups.get(key) if self._groups is not None else None
        return len((seen[1] if seen is not None else set()) | {group}) == groups

    def _arrive_group(self, key: tuple[int, int, int, int], group: int, groups: int) -> Arrival | None:
        """None once this group completes its write (the caller then checks the whole write)."""
        if not 1 < groups <= MAX_GROUPS or not 0 <= group < groups:
            return Arrival(Outcome.REJECTED, f"group {group} of {groups} is not a group of a write")
        if self._groups is None:
            self._groups = {}
        seen = self._groups.setdefault(key, (groups, set()))
        if seen[0] != groups:
            return Arrival(Outcome.REJECTED, f"a write of writer {key[0]} came as {seen[0]} and as {groups} groups")
        if group in seen[1]:
            return Arrival(Outcome.DUPLICATE)
        seen[1].add(group)
        return None if len(seen[1]) == groups else Arrival(Outcome.PARTIAL)

    # -- completion -----------------------------------------------------------------------
    @property
    def complete(self) -> bool:
        """Every byte of the room is in place (staged: scattered; direct: landed)."""
        if self._pieces or self._scattered_cells:
            return self._scattered_cells == self.num_pages * len(self._held)
        if self.token_bytes is not None and not any(self.token_bytes.values()) and not self.final_extra:
            return True   # decode context parallel: a rank owning none of the request's tokens (nor pool items) gets no write
        if self.shared:
            return self._counts()[0] == self.num_pages * len(self._held)
        return all(n == self.num_pages * len(self.layers_of(w)) or self._writes_nothing(w)
                   for w, n in zip(self._writers, self._counts()))

    def _writes_nothing(self, writer: int) -> bool:
        """Decode context parallel: a writer owning none of this rank's tokens and carrying no
        pool items (a PP stage whose layers hold none of them) sends no write."""
        return self.token_bytes is not None and not self.token_bytes.get(writer) and not self.final_extra.get(writer)

    @property
    def pages_done(self) -> int:
        """Pages' worth of cells in place (a page counts once every layer of it is)."""
        if self._pieces:
            return self._scattered_cells // len(self._held)
        if self.shared:
            grid = self._covered
            return 0 if grid is None else int(grid[0][:, self._held.start:self._held.stop].all(axis=1).sum())
        return min(n // len(self.layers_of(w)) for w, n in zip(self._writers, self._counts()))

    def _counts(self) -> list[int]:
        """Direct path: cells covered per writer, in `_writers` order (shared: one count)."""
        rows = 1 if self.shared else len(self._writers)
        return self._covered_count if self._covered_count is not None else [0] * rows

    def _extra(self, writer: int, page_start: int, num_pages: int, layers: range | None = None) -> int:
        return self.final_extra.get(writer, 0) if self.final(page_start, num_pages, layers, writer=writer) else 0

    def _in_range(self, page_start: int, num_pages: int) -> bool:
        return num_pages > 0 and page_start >= 0 and page_start + num_pages <= self.num_pages

    def _check_range(self, page_start: int, num_pages: int) -> None:
        if not self._in_range(page_start, num_pages):
            raise ValueError(f"pages [{page_start}, {page_start + num_pages}) outside the room's "
                             f"{self.num_pages} pages")
