"""Draft KV of speculative decoding (EAGLE, MTP): the draft model's KV entries, which SGLang
keeps after the target's under the same page indices, and the rule pairing a prefill's draft
with a decode's. Pure.

A draft of the target's geometry moves exactly like more target layers: entry indices
[num_layers, num_layers + draft.num_layers) follow the target's layers in the buffers, the
sends and the writes. A draft of another geometry (its own head count or head_dim) is a second
KV set with its own head mapping: each entry becomes an engine-internal "heads" state pool
(`draft_pools`, a reserved name) whose items are the token slots of the pages the request
moves (`draft_items`), so it rides with the request's last piece like any pool. A decode rank
may hold more draft entries than the prefill (decode-only speculation): the prefill writes the
entries it has and the decode's extra ones stay untouched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .pool_spec import DRAFT_POOL_PREFIX


def _positive_or_none(name: str, value: object) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"DraftKV.{name} must be a positive int (or None: the target's), got {value!r}")


@dataclass(frozen=True, kw_only=True)
class DraftKV:
    """The draft model's KV entries of one rank's cache: `num_layers` of them (EAGLE: usually 1;
    MTP: one per MTP layer), with the target's dtype, page size, page format and MLA-ness.
    `total_kv_heads`/`head_dim` None: the target's (KVLayout resolves them)."""

    num_layers: int
    total_kv_heads: int | None = None
    head_dim: int | None = None

    def __post_init__(self) -> None:
        n = self.num_layers
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ValueError(f"DraftKV.num_layers must be a positive int (draft KV entries), got {n!r}")
        _positive_or_none("total_kv_heads", self.total_kv_heads)
        _positive_or_none("head_dim", self.head_dim)


@dataclass(frozen=True, kw_only=True)
class DraftShape:
    """A side's draft as its layout summary states it (num_layers 0: no draft)."""

    num_layers: int
    total_kv_heads: int
    head_dim: int

    def describe(self) -> str:
        if not self.num_layers:
            return "no draft KV"
        return (f"{self.num_layers} draft KV entr{'y' if self.num_layers == 1 else 'ies'} of "
                f"{self.total_kv_heads} heads x head_dim {self.head_dim}")


def draft_mismatch(prefill: DraftShape, decode: DraftShape) -> str:
    """Why a prefill's draft entries cannot be written into a decode's ("" when they can).

    The decode must hold every entry the prefill writes, with the same geometry; it may hold
    more (decode-only speculation: the extra ones stay unwritten), and a prefill without a
    draft pairs with any decode."""
    if not prefill.num_layers:
        return ""
    if prefill.num_layers > decode.num_layers:
        return (f"draft KV: the prefill has {prefill.describe()}, the decode {decode.describe()}; a decode rank must "
                f"hold at least as many draft entries as the prefill writes (DraftKV.num_layers)")
    if (prefill.total_kv_heads, prefill.head_dim) != (decode.total_kv_heads, decode.head_dim):
        return (f"draft KV geometry: the prefill has {prefill.describe()}, the decode {decode.describe()}; the draft's "
                f"total_kv_heads and head_dim must be equal on both sides")
    return ""


def draft_pool_name(entry: int) -> str:
    """The internal pool of draft entry `entry` (a draft of its own geometry)."""
    return f"{DRAFT_POOL_PREFIX}{entry}"


def is_draft_pool(name: str) -> bool:
    return name.startswith(DRAFT_POOL_PREFIX)


def draft_pool_entry(name: str) -> int:
    """The draft entry an internal pool name stands for."""
    return int(name[len(DRAFT_POOL_PREFIX):])


def draft_items(pages: np.ndarray, page_size: int) -> np.ndarray:
    """A request's items of every draft pool: the token slots of `pages` (in request order),
    page p covering slots [p * page_size, (p + 1) * page_size). Head-major page formats
    describe a page as one token (page_size 1): their items are the pages."""
    pages = np.asarray(pages, dtype=np.int64)
    return (pages[:, None] * page_size + np.arange(page_size, dtype=np.int64)[None, :]).reshape(-1)


def request_draft_items(names: Sequence[str], pages: np.ndarray, page_size: int) -> dict[str, np.ndarray]:
    """{draft pool: items} for the draft pools `names` of one request moving `pages`."""
    items = draft_items(pages, page_size)
    return {n: items for n in names if is_draft_pool(n)}
