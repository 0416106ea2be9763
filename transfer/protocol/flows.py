"""What a prefill room keeps per chunk and per decode rank, and which pages it sends.

The decode side may already hold the first pages of a request (its prefix cache): the chunks
the caller gives are the whole request's, and only their pages past the prefix are sent,
numbered as the decode side numbers its destination pages (from the prefix on).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from .actions import PeerKey
from .head_mapping import Assignment
from .messages import RoomMeta


@dataclass(frozen=True, kw_only=True, slots=True)
class Chunk:
    """One write unit: request positions from `page_start` (its `pages` there) x `layers`, and
    what to wait on before its layers are read (layer_sends.py)."""

    index: int
    page_start: int
    pages: np.ndarray
    layers: range
    ready: tuple[object, ...] = ()


@dataclass(kw_only=True, slots=True)
class Flow:
    """This prefill rank -> one decode rank, for this room."""

    peer: PeerKey
    session: int
    assignment: Assignment | None       # None: a notice only, nothing to write
    staged: bool
    dst_pages: np.ndarray | None = None
    meta: RoomMeta | None = None        # kept until init() gives the page count to check it against
    pool_dst: dict[str, np.ndarray] | None = None        # the decode rank's state pool items of this request
    issued: int = 0                     # chunks issued (direct) or requested (staged)
    requested_at: dict[int, float] = field(default_factory=dict)  # staged: chunk -> when first asked
    asked_again: dict[int, float] = field(default_factory=dict)   # staged: chunk -> when last asked
    done_again_at: float | None = None                            # WriterDone last re-sent
    granted: set[int] = field(default_factory=set)
    inflight: set[int] = field(default_factory=set)               # op ids
    writes: int = 0
    nbytes: int = 0
    landed_tags: list[bytes] = field(default_factory=list)       # the signed tags of the writes completed
    active_at: float = 0.0                                        # when a write of it was last posted or completed
    tags_again_at: float = 0.0                                    # TagsAgain last sent
    done_sent_at: float | None = None
    confirmed: bool = False
    layers: range | None = None         # decode PP: the layers this rank writes there (its stage's overlap
                                        # with the decode rank's); None: every layer of this rank
    stage_stop: int = 0                 # decode PP: the decode rank's stage's end, whose write carries
                                        # the pools (0: the model's last entry)


def past_prefix(chunks: list[Chunk], prefix: int, first_index: int) -> list[Chunk]:
    """The sendable chunks of `chunks` (request page numbers): each one's pages past the first
    `prefix` pages of the request, numbered from the prefix, indexed from `first_index` on."""
    out: list[Chunk] = []
    for chunk in chunks:
        end = chunk.page_start + chunk.pages.size
        if end > prefix:
            skip = max(0, prefix - chunk.page_start)
            out.append(replace(chunk, index=first_index + len(out), page_start=chunk.page_start + skip - prefix,
                               pages=chunk.pages[skip:]))
    return out
