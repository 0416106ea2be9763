"""The rules of a sender's input, written once: the caller's handle (KVSender) checks them to
raise in the caller's thread, and the prefill room checks them again on the control thread,
with the same words.

A sender gets its page count once (at creation or with init()), then sends (SendLedger in
layer_sends.py checks each: pages and layers in request order, the last one the send that
completes every (page, layer)); items of a pool init() did not name may come with the last send.
"""

from __future__ import annotations

from collections.abc import Mapping


def check_page_count(room: int, current: int | None, num_pages: object) -> int:
    """init(): the page count of a sender created without one. Raises ValueError."""
    if current is not None:
        raise ValueError(f"room {room}: init() called twice, or on a sender created with num_pages")
    if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages <= 0:
        raise ValueError(f"room {room}: num_pages must be a positive int, got {num_pages!r}")
    return num_pages


def check_late_items(room: int, given: Mapping[str, object], late: Mapping[str, object] | None, last: bool) -> None:
    """send(pool_items=...): items of pools init() did not name, on the request's last send
    only (the write carrying them is the last). Raises ValueError."""
    if not late:
        return
    if not last:
        raise ValueError(f"room {room}: pool_items come with the last send only (this send leaves pages or layers "
                         f"unsent)")
    twice = sorted(set(late) & set(given))
    if twice:
        raise ValueError(f"room {room}: items of pool(s) {', '.join(twice)} were given at init() and again with the "
                         f"last send")
