"""Adaptive splitting of a chunk into page-aligned pieces that fit the ring and the buffers. Pure."""

from __future__ import annotations

from collections.abc import Sequence


def max_piece_pages(writer_page_bytes: Sequence[int], buffer_bytes: int, ring_bytes: int,
                    align: int = 1) -> int:
    """The most pages one piece may hold: every writer's part must fit its staging buffer and
    the whole region (all writers' parts, rounded up to `align`) must fit the ring.
    `writer_page_bytes`: bytes per page of each writer. 0: not even one page fits."""
    if not writer_page_bytes or min(writer_page_bytes) <= 0:
        raise ValueError("a piece has writers, each writing a positive number of bytes per page")
    total = sum(writer_page_bytes)
    pages = min(buffer_bytes // max(writer_page_bytes), ring_bytes // total)
    while pages and -(-pages * total // align) * align > ring_bytes:
        pages -= 1
    return max(pages, 0)


def plan_pieces(page_start: int, num_pages: int, max_pages: int, fit_now: int) -> list[tuple[int, int]]:
    """Split pages [page_start, page_start + num_pages) into (start, count) pieces.

    The first piece takes what fits the ring right now (when at least a page does), so it can be
    written at once; the others take `max_pages` each and wait for the ring to drain.
    """
    if num_pages <= 0:
        raise ValueError("a chunk has at least one page")
    if max_pages <= 0:
        raise ValueError("not even one page fits a piece")
    first = min(num_pages, max_pages, fit_now) if fit_now > 0 else min(num_pages, max_pages)
    pieces = [(page_start, first)]
    pos, left = page_start + first, num_pages - first
    while left:
        n = min(left, max_pages)
        pieces.append((pos, n))
        pos, left = pos + n, left - n
    return pieces
