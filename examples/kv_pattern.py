"""A deterministic KV pattern that proves a transfer bit-exact.

The bytes of (room, request page i, tensor t, global head h) are a fixed random block rolled by
an offset and XORed with a key, both derived from (room, i). The prefill side writes them into
whatever cache pages it picked for the request; the decode side recomputes them for its own
heads and compares with its destination pages. A page landing in the wrong place, the wrong
room, the wrong head or the wrong layer is caught, as is any flipped byte.
"""

from __future__ import annotations

import numpy as np
import torch

from transfer.layout import KVLayout


class KVPattern:
    def __init__(self, layout: KVLayout, seed: int = 0):
        self.layout = layout
        g = torch.Generator().manual_seed(seed)
        self.block = layout.page_size * layout.head_bytes          # bytes of one head of one page
        n_tensors = layout.num_kv * layout.num_layers
        self.base = torch.randint(0, 256, (n_tensors, layout.total_kv_heads, self.block), generator=g,
                                  dtype=torch.uint8)
        self.heads = list(layout.heads_of(layout.tp_rank))

    def _keys(self, room: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = np.arange(n, dtype=np.uint64)
        r = np.uint64(room * 0x9E3779B97F4A7C15 % 2**64)
        x = r + i * np.uint64(0xBF58476D1CE4E5B9)          # arrays wrap modulo 2**64 silently
        x ^= x >> np.uint64(31)
        x = x * np.uint64(0x94D049BB133111EB)
        off = torch.from_numpy((x % np.uint64(self.block)).astype(np.int64))
        key = torch.from_numpy(((x >> np.uint64(20)) & np.uint64(0xFF)).astype(np.uint8))
        return off, key

    def pages_for(self, room: int, n: int) -> list[torch.Tensor]:
        """Per tensor, the expected bytes [n, page_size, local_heads, head_bytes] of the request."""
        off, key = self._keys(room, n)
        idx = (torch.arange(self.block)[None, :] - off[:, None]) % self.block   # [n, block]
        out = []
        for t in range(self.base.shape[0]):
            per_head = [(self.base[t, h][idx] ^ key[:, None]).view(n, self.layout.page_size, self.layout.head_bytes)
                        for h in self.heads]
            out.append(torch.stack(per_head, dim=2))
        return out

    def fill(self, tensors: list[torch.Tensor], room: int, pages: np.ndarray) -> None:
        """Write the request's pattern into cache `pages` (request order) of every tensor."""
        pages_t = torch.as_tensor(np.asarray(pages, dtype=np.int64))
        for t, data in zip(tensors, self.pages_for(room, len(pages))):
            _paged(t, self.layout)[pages_t] = data

    def check(self, tensors: list[torch.Tensor], room: int, pages: np.ndarray) -> str | None:
        """None when cache `pages` hold exactly the request's pattern, else what differs."""
        pages_t = torch.as_tensor(np.asarray(pages, dtype=np.int64))
        for ti, (t, want) in enumerate(zip(tensors, self.pages_for(room, len(pages)))):
            got = _paged(t, self.layout)[pages_t]
            if not torch.equal(got, want):
                bad = (got != want).nonzero()[0].tolist()
                return (f"room {room}: tensor {ti} differs first at request page {bad[0]}, token {bad[1]}, "
                        f"local head {bad[2]}, byte {bad[3]} ({int((got != want).sum())} bytes wrong)")
        return None


def _paged(t: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """A [num_pages, page_size, local_heads, head_bytes] uint8 view of one cache tensor."""
    return t.view(torch.uint8).view(-1, layout.page_size, layout.local_heads, layout.head_bytes)
