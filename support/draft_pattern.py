"""The KV pattern of a draft KV of its own geometry (other heads or head_dim than the target's):
one KVPattern per draft entry, over the draft's own heads and head_dim, so every byte of every
draft head is checked on the decode side, across TP sizes; an entry's pattern does not depend
on how many draft entries a side holds (a decode may hold more than the prefill)."""

from __future__ import annotations

import numpy as np
import torch

from kvstage import KVBuffers, KVLayout
from kvstage.support.kv_pattern import KVPattern


class DraftPattern:
    def __init__(self, layout: KVLayout, seed: int = 0):
        d = layout.draft
        assert d is not None and d.total_kv_heads is not None and d.head_dim is not None
        self.layout = layout
        self.entries = [
            KVPattern(KVLayout(num_layers=1, total_kv_heads=d.total_kv_heads, head_dim=d.head_dim, dtype=layout.dtype,
                               page_size=layout.page_size, tp_size=layout.tp_size, tp_rank=layout.tp_rank,
                               mla=layout.mla), seed=seed * 7919 + 101 + e)
            for e in range(layout.draft_entries)]

    @staticmethod
    def tensors(buffers: KVBuffers, entry: int) -> list[torch.Tensor]:
        """Draft entry `entry`'s K (and V) tensor."""
        return [buffers.draft_k[entry]] + ([buffers.draft_v[entry]] if buffers.draft_v is not None else [])

    def fill(self, buffers: KVBuffers, room: int, pages: np.ndarray, entries: int) -> None:
        for e in range(entries):
            self.entries[e].fill(self.tensors(buffers, e), room, pages)

    def check(self, buffers: KVBuffers, room: int, pages: np.ndarray, first: int, entries: int) -> str | None:
        """None when draft entries [0, entries) hold the request's pattern on `pages`."""
        for e in range(entries):
            err = self.entries[e].check(self.tensors(buffers, e), room, pages, first=first)
            if err is not None:
                return f"draft entry {e}: {err}"
        return None

    def untouched(self, buffers: KVBuffers, pages: np.ndarray, entries: range, byte: int) -> bool:
        """Whether draft `entries` still hold `byte` everywhere on `pages`."""
        rows = torch.as_tensor(np.asarray(pages, dtype=np.int64))
        for e in entries:
            for t in self.tensors(buffers, e):
                paged = t.view(torch.uint8).view(t.shape[0] // self.layout.page_size, -1)
                if not bool((paged[rows.to(t.device)] == byte).all()):
                    return False
        return True

    def outcome(self, buffers: KVBuffers, pages: np.ndarray, prefix: int, byte: int) -> dict:
        """A decode room's draft record, whatever its outcome: whether every draft entry still
        holds `byte` on all of the room's pages (nothing written) and on its prefix pages."""
        out = {"draft_untouched": self.untouched(buffers, pages, range(self.layout.draft_entries), byte)}
        if prefix:
            out["draft_prefix_intact"] = self.untouched(buffers, pages[:prefix], range(self.layout.draft_entries), byte)
        return out
