"""Draft KV of speculative decoding (EAGLE, MTP): the draft model's KV entries, which SGLang
keeps after the target's under the same page indices, and the rule pairing a prefill's draft
with a decode's. Pure.

A draft entry moves exactly like one more target layer: entry indices [num_layers,
num_layers + draft.num_layers) follow the target's layers in the buffers, the sends and the
writes. A decode rank may hold more draft entries than the prefill (decode-only speculation):
the prefill writes the entries it has and the decode's extra ones stay untouched.
"""

from __future__ import annotations

from dataclasses import dataclass


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
