"""The batch file: many pages written by ONE O_DIRECT write, and the pure planning around it.

Layout of one batch file (all offsets multiples of `ALIGN`, 4096)::

    [slot 0][slot 1] ... [slot n-1][footer, zero padded][trailer: last 16 bytes]

- slot i holds page i's bytes at `Entry.offset`, its length rounded up to `ALIGN`;
- the footer is a msgpack-encoded `BatchFooter` (versioned): the store's namespace and one
  `Entry` (kind, key, offset, nbytes, xxh3-64 digest) per page;
- the trailer is ``MAGIC | version (u32) | footer length (u64)``, the file's last 16 bytes, so
  the footer is found from the file's end without an index file of its own.

Because the footer comes after the slots, the slots' offsets do not depend on the digests: the
pages are gathered into the staging buffer first, digested there, and the footer written behind
them, all in the same buffer and the same write.

Invariants: a file is written whole, under a temporary name, then renamed (a crash leaves no
half file under a batch name); the entries of one footer never overlap; a reader that finds a
wrong magic, version or namespace treats the whole file as absent (a miss), never as data.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

ALIGN = 4096
MAGIC = b"KVSB"
VERSION = 1
_TRAILER = struct.Struct("<4sIQ")
TRAILER_BYTES = _TRAILER.size  # 16

__all__ = ["ALIGN", "BatchFooter", "BatchLayout", "Entry", "FormatError", "ReadItem", "ReadRun", "TRAILER_BYTES",
           "VERSION", "decode_footer", "encode_tail", "plan_batch", "plan_reads", "round_up"]


class FormatError(ValueError):
    """A batch file that is not one this store wrote (magic, version or footer): a miss."""


class Entry(msgspec.Struct, frozen=True, kw_only=True):
    """One page of a batch file: its kind (namespace of state), key, place and digest."""

    kind: str
    key: str
    offset: int
    nbytes: int
    digest: int


class BatchFooter(msgspec.Struct, frozen=True, kw_only=True):
    version: int = VERSION
    namespace: str
    entries: list[Entry]


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(BatchFooter)


def round_up(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class BatchLayout:
    """Where each page of a batch goes: `offsets[i]` for page i, `data_bytes` up to the footer."""

    offsets: tuple[int, ...]
    data_bytes: int


def plan_batch(sizes: Sequence[int]) -> BatchLayout:
    """Slots for pages of these sizes, back to back, each starting on an `ALIGN` boundary."""
    offsets, at = [], 0
    for n in sizes:
        if n <= 0:
            raise ValueError(f"a page must have bytes, got {n}")
        offsets.append(at)
        at += round_up(n)
    return BatchLayout(tuple(offsets), at)


def encode_tail(namespace: str, entries: Sequence[Entry]) -> bytes:
    """The footer and trailer, padded so that data + tail is a multiple of `ALIGN` and the
    trailer is the last 16 bytes."""
    body = _ENCODER.encode(BatchFooter(namespace=namespace, entries=list(entries)))
    total = round_up(len(body) + TRAILER_BYTES)
    pad = total - len(body) - TRAILER_BYTES
    return body + bytes(pad) + _TRAILER.pack(MAGIC, VERSION, len(body))


def decode_footer(tail: bytes | memoryview, file_size: int) -> BatchFooter:
    """The footer of a batch file from its last bytes (`tail`: at least the footer and trailer).

    Raises FormatError for anything this store did not write: the caller counts it as absent."""
    if len(tail) < TRAILER_BYTES:
        raise FormatError("file shorter than its trailer")
    magic, version, body_len = _TRAILER.unpack(bytes(tail[-TRAILER_BYTES:]))
    if magic != MAGIC:
        raise FormatError(f"bad magic {magic!r}")
    if version != VERSION:
        raise FormatError(f"batch file version {version}, this store reads {VERSION}")
    start = len(tail) - round_up(body_len + TRAILER_BYTES)   # the footer opens its padded tail
    if start < 0:
        raise FormatError(f"footer of {body_len} bytes does not fit the {len(tail)}-byte tail")
    try:
        footer = _DECODER.decode(bytes(tail[start:start + body_len]))
    except msgspec.DecodeError as exc:
        raise FormatError(f"undecodable footer: {exc}") from None
    data_end = file_size - round_up(body_len + TRAILER_BYTES)
    for e in footer.entries:
        if e.offset < 0 or e.offset % ALIGN or e.nbytes <= 0 or e.offset + e.nbytes > data_end:
            raise FormatError(f"entry {e.key!r} at {e.offset}+{e.nbytes} outside the data ({data_end} bytes)")
    return footer


@dataclass(frozen=True)
class ReadItem:
    """Request `index` is `nbytes` at `at` bytes into its run's buffer; digest to check."""

    index: int
    at: int
    nbytes: int
    digest: int


@dataclass(frozen=True)
class ReadRun:
    """One read: `length` bytes of file `file_id` from `offset` (both `ALIGN` multiples)."""

    file_id: int
    offset: int
    length: int
    items: tuple[ReadItem, ...]


def plan_reads(wanted: Sequence[tuple[int, int, Entry]], max_bytes: int, max_gap: int = 1 << 20) -> list[ReadRun]:
    """Group the wanted pages (request index, file id, entry) into as few reads as possible.

    Pages of one file are read by one run covering them in file order, as long as the run stays
    within `max_bytes` (the staging buffer) and no hole between two pages exceeds `max_gap`
    (reading a hole costs its bytes). A page larger than `max_bytes` is an error: the staging
    buffer is sized for the largest page."""
    by_file: dict[int, list[tuple[int, Entry]]] = {}
    for index, file_id, entry in wanted:
        if round_up(entry.nbytes) > max_bytes:
            raise ValueError(f"page {entry.key!r} of {entry.nbytes} bytes exceeds the {max_bytes}-byte buffer")
        by_file.setdefault(file_id, []).append((index, entry))
    runs: list[ReadRun] = []
    for file_id, pages in by_file.items():
        pages.sort(key=lambda p: p[1].offset)
        start = end = -1
        items: list[tuple[int, Entry]] = []
        for index, e in pages:
            slot_end = e.offset + round_up(e.nbytes)
            if items and (e.offset - end > max_gap or slot_end - start > max_bytes):
                runs.append(_run(file_id, start, end, items))
                items = []
            if not items:
                start = e.offset
                end = slot_end
            end = max(end, slot_end)
            items.append((index, e))
        if items:
            runs.append(_run(file_id, start, end, items))
    return runs


def _run(file_id: int, start: int, end: int, items: list[tuple[int, Entry]]) -> ReadRun:
    return ReadRun(file_id, start, end - start,
                   tuple(ReadItem(i, e.offset - start, e.nbytes, e.digest) for i, e in items))
