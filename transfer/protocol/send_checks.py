"""The rules of a sender's input, written once: the caller's handle (KVSender) checks them to
raise in the caller's thread, and the prefill room checks them again on the control thread,
with the same words.

A sender gets its page count once (at creation or with init()), then chunks in request order;
the last chunk is the one that reaches the count, or one marked last that must reach it.
"""

from __future__ import annotations


def check_page_count(room: int, current: int | None, num_pages: object) -> int:
    """init(): the page count of a sender created without one. Raises ValueError."""
    if current is not None:
        raise ValueError(f"room {room}: init() called twice, or on a sender created with num_pages")
    if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages <= 0:
        raise ValueError(f"room {room}: num_pages must be a positive int, got {num_pages!r}")
    return num_pages


def check_chunk(room: int, num_pages: int | None, sent: int, ended: bool, size: int, last: bool | None) -> bool:
    """send(): `size` more pages after `sent`, of `num_pages`; `ended`: the last chunk was
    sent. Returns whether this chunk is the last (`last` None: when it reaches the count).
    Raises ValueError."""
    if num_pages is None:
        raise ValueError(f"room {room}: send() before init(): the page count is not known yet")
    if ended:
        raise ValueError(f"room {room}: send() after the last chunk")
    if sent + size > num_pages:
        raise ValueError(f"room {room}: {sent + size} pages sent, the sender was created for {num_pages}")
    if last and sent + size != num_pages:
        raise ValueError(f"room {room}: the last chunk ends at page {sent + size} of {num_pages}")
    return sent + size == num_pages if last is None else bool(last)
