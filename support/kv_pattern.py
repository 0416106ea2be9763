"""A deterministic KV pattern that proves a transfer bit-exact, cheaply.

The bytes of (room, request page i, tensor t, global head h) are a fixed random block for (t, h)
XORed, 8 bytes at a time, with a 64-bit key derived from (room, i). The prefill side writes them
into whatever cache pages it picked for the request; the decode side recomputes them for its
own heads and compares them with its destination pages. A page in the wrong place or room
passes only if two 64-bit keys collide; a wrong head, layer, token or byte, or any flipped bit,
differs from the random block.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import numpy as np
import torch

from kvstage.transfer.layout import KVLayout


class KVPattern:
    def __init__(self, layout: KVLayout, seed: int = 0):
        self.layout = layout
        self.draft: Any = None   # a draft of its own geometry: its pattern (draft_pattern.py), set by its user
        ps, hb = layout.page_size, layout.head_bytes
        # the widest unit that never straddles two heads: keys are applied unit by unit
        self.unit, self.udtype = next((u, d) for u, d in ((8, torch.int64), (4, torch.int32), (2, torch.int16),
                                                          (1, torch.uint8)) if hb % u == 0)
        g = torch.Generator().manual_seed(seed)
        n_tensors = layout.num_kv * layout.num_layers
        every = torch.randint(0, 256, (n_tensors, layout.total_kv_heads, ps, hb), generator=g, dtype=torch.uint8)
        heads = list(layout.heads_of(layout.tp_rank))

        def block(kv: int, entry: int) -> torch.Tensor:
            """(tensor kv of) one entry's random block; a draft entry's does not depend on how
            many draft entries a side holds (a decode may hold more than the prefill)."""
            if entry < layout.num_layers:
                return every[kv * layout.num_layers + entry]
            d = torch.Generator().manual_seed(seed * 7919 + 1 + entry - layout.num_layers)
            return torch.randint(0, 256, (layout.num_kv, layout.total_kv_heads, ps, hb), generator=d,
                                 dtype=torch.uint8)[kv]

        # this rank's tensors (a PP stage's layers only; draft entries after the layers: K of
        # each, then V) and heads side by side, as one page of one tensor is laid out: [ps, heads, hb]
        mine = torch.stack([block(kv, i) for kv in range(layout.num_kv) for i in layout.layers])
        self.base = mine[:, heads].permute(0, 2, 1, 3).contiguous().view(self.udtype).view(len(mine), -1)

    def _keys(self, room: int, n: int, first: int = 0, positions: np.ndarray | None = None) -> torch.Tensor:
        i = np.arange(first, first + n, dtype=np.uint64) if positions is None else np.asarray(positions, dtype=np.uint64)
        x = np.uint64(room * 0x9E3779B97F4A7C15 % 2**64) + i * np.uint64(0xBF58476D1CE4E5B9)  # wraps mod 2**64
        x ^= x >> np.uint64(31)
        x = x * np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(29)
        keys = torch.from_numpy(x.view(np.int64).copy())
        return keys if self.unit == 8 else keys.to(self.udtype)

    def _expected(self, t: int, keys: torch.Tensor) -> torch.Tensor:
        return (self.base[t][None, :] ^ keys[:, None]).view(torch.uint8)

    def fill(self, tensors: list[torch.Tensor], room: int, pages: np.ndarray, first: int = 0,
             only: Collection[int] | None = None, positions: np.ndarray | None = None) -> None:
        """Write the request's pattern into cache `pages` (request order, from request page
        `first`; or the request pages `positions`, one for each cache page) of every tensor, or of
        tensors whose index is in `only`."""
        pages_t = torch.as_tensor(np.asarray(pages, dtype=np.int64))
        keys = self._keys(room, len(pages), first, positions)
        for t, tensor in enumerate(tensors):
            if only is not None and t not in only:
                continue
            view = _paged(tensor, self.layout)
            view[pages_t.to(tensor.device)] = self._expected(t, keys).view(len(pages), *view.shape[1:]).to(tensor.device)

    def check(self, tensors: list[torch.Tensor], room: int, pages: np.ndarray, first: int = 0,
              only: Collection[int] | None = None) -> str | None:
        """None when cache `pages` hold exactly the pattern of the request's pages `first`,
        `first` + 1, ..., in every tensor or those whose index is in `only`, else what differs."""
        pages_t = torch.as_tensor(np.asarray(pages, dtype=np.int64))
        keys = self._keys(room, len(pages), first)
        for t, tensor in enumerate(tensors):
            if only is not None and t not in only:
                continue
            view = _paged(tensor, self.layout)
            got = view[pages_t.to(tensor.device)].cpu()   # a CUDA cache (examples/gpu_check.py) is read back
            want = self._expected(t, keys).view(got.shape)
            if not torch.equal(got, want):
                bad = (got != want).nonzero()[0].tolist()
                return (f"room {room}: tensor {t} differs first at request page {first + bad[0]}, token {bad[1]}, "
                        f"local head {bad[2]}, byte {bad[3]} ({int((got != want).sum())} bytes wrong)")
        return None

    def fill_tokens(self, tensors: list[torch.Tensor], room: int, slots: np.ndarray, tokens: np.ndarray) -> None:
        """Write the pattern of the request's token `tokens[i]` into cache slot `slots[i]` of every
        tensor (a prefill rank of a DCP group holds its tokens at its local slots)."""
        for tensor, where, want in self._token_rows(tensors, room, slots, tokens):
            tensor.view(torch.uint8).view(-1, self.layout.token_bytes)[where.to(tensor.device)] = want.to(tensor.device)

    def _token_rows(self, tensors: list[torch.Tensor], room: int, slots: np.ndarray, tokens: np.ndarray):
        """For each tensor: (the tensor, its cache slots `slots`, the pattern bytes of the request's
        tokens `tokens` there, one row a token); nothing for no token."""
        ps = self.layout.page_size
        tok = np.asarray(tokens, dtype=np.int64)
        if tok.size == 0:
            return
        first, last = int(tok.min()) // ps, int(tok.max()) // ps
        keys = self._keys(room, last - first + 1, first)
        rows, offs = torch.as_tensor(tok // ps - first), torch.as_tensor(tok % ps)
        where = torch.as_tensor(np.asarray(slots, dtype=np.int64))
        for t, tensor in enumerate(tensors):
            yield tensor, where, self._expected(t, keys).reshape(last - first + 1, ps, -1)[rows, offs]

    def check_tokens(self, tensors: list[torch.Tensor], room: int, slots: np.ndarray, tokens: np.ndarray) -> str | None:
        """None when cache slot `slots[i]` holds exactly the pattern of the request's token
        `tokens[i]` (its page tokens[i] // page_size, offset tokens[i] % page_size), in every
        tensor, else what differs: the bytes a decode context parallel rank holds, each token
        at its own local slot (token_mapping.py)."""
        tok = np.asarray(tokens, dtype=np.int64)
        for t, (tensor, where, want) in enumerate(self._token_rows(tensors, room, slots, tokens)):
            got = tensor.view(torch.uint8).view(-1, self.layout.token_bytes)[where.to(tensor.device)].cpu()
            if not torch.equal(got, want):
                bad = int((got != want).any(dim=1).nonzero()[0])
                return (f"room {room}: tensor {t} differs first at token {int(tok[bad])} (slot {int(where[bad])}); "
                        f"{int((got != want).any(dim=1).sum())} tokens wrong")
        return None


def _paged(t: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """A [num_pages, page_size, local_heads, head_bytes] uint8 view of one cache tensor."""
    return t.view(torch.uint8).view(-1, layout.page_size, layout.local_heads, layout.head_bytes)
