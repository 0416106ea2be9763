"""A rank's SGLang state components for rank.py: Mamba slots and SWA window pages, (MLA) DSA
indexer pages, or (MLA, "mamba_only") Mamba slots alone: the hybrid MLA pool of a Kimi Linear
model, full-attention MLA layers beside linear-attention state.

Real torch tensors whose pointers go into KVArgs exactly as SGLang's setup_state_kv_args lays
them out (per component: tensor-major x layer pointer lists, item sizes, TP dims per tensor, rows
before the TP axis, GDN conv sub-blocks, layer ids; SWA: K layers then V layers, NHD pages).
Each element's value is a pattern of (room, tensor, layer, row, GLOBAL unit or head, position),
so a decode rank of any TP size knows what every byte of its share must be. Every item no
successful request owns must still hold the sentinel.

Mamba tensors per layer, per slot (global shapes, int16):
  conv      [units 8, 3]     sharded on units; GDN: [q 2 | k 2 | v 4], each sub-block on its own
  temporal  [heads 4, 6]     sharded on heads
  kimi      [rows 3, 4, 2]   sharded on its second axis (3 rows before it)
  whole     [5]              replicated over TP (dim 0)
SWA per layer, K then V: [tokens, local KV heads, head_dim] (NHD pages). DSA per layer: [pages,
page_size x 3] int16, the same on every rank (MLA replicates it). A PP stage holds the tensors of
its own layers only (`layers`).

The tensors live on the rank's KV device (`device`: cpu or cuda), where the expected values are
compared; a fill is synchronised before it returns (on CUDA), as the KV's is.
"""

from __future__ import annotations

import numpy as np
import torch

SENTINEL = -12345
LAYERS = 2
MAMBA = [("conv", 1, 8, 3), ("temporal", 1, 4, 6), ("kimi", 3, 4, 2), ("whole", 1, 0, 5)]  # name, rows, units, inner
GDN = [2, 2, 4]


def value(room: int, tensor: int, layer: int, row, unit, pos) -> torch.Tensor:
    x = (room % 9973) * 7919 + tensor * 1009 + layer * 613 + row * 211 + unit * 101 + pos * 13
    return (x % 65521 - 32760).to(torch.int16)


class StateSide:
    def __init__(self, cfg: dict, tp: int, rank: int, kv_heads: int, head_dim: int, page: int, num_pages: int,
                 decode: bool, device: torch.device | None = None, layers: range | None = None):
        """`layers`: the model layers this rank holds (a PP stage's; default the first LAYERS),
        each DSA or Mamba tensor's pattern keyed by its global layer."""
        device = device or torch.device("cpu")
        self.cfg, self.tp, self.rank, self.page, self.device = cfg, tp, rank, page, device
        self.layers = layers if layers is not None else range(LAYERS)
        # decode holds more slots and state pages than prefill, as real servers' sizes differ
        self.slots, self.num_pages = cfg["slots"] + 4 * decode, num_pages + 8 * decode
        self.gdn, self.dsa, self.mamba_only = bool(cfg.get("gdn")), bool(cfg.get("dsa")), bool(cfg.get("mamba_only"))
        self.mamba = []          # (tensor id, layer, tensor [slots, rows, local units | whole, inner], global units)
        for tid, (name, rows, units, inner) in enumerate([] if self.dsa else MAMBA):
            for layer in self.layers:
                if units == 0:
                    t = torch.empty(self.slots, inner, dtype=torch.int16, device=device)
                    self.mamba.append((tid, layer, t, None))
                    continue
                t = torch.empty(self.slots, rows, units // tp, inner, dtype=torch.int16, device=device)
                self.mamba.append((tid, layer, t, self._units(name, units)))
        self.local_heads = kv_heads // tp
        self.heads = torch.arange(rank * self.local_heads, (rank + 1) * self.local_heads)
        if self.mamba_only:
            self.swa = []
        elif self.dsa:          # paged state: SWA (K layers, then V layers) or DSA
            self.swa = [torch.empty(self.num_pages * page, 3, dtype=torch.int16, device=device) for _ in self.layers]
        else:
            self.swa = [torch.empty(self.num_pages * page, self.local_heads, head_dim, dtype=torch.int16, device=device)
                        for _ in range(2 * len(self.layers))]
        for t in self.tensors():
            t.fill_(SENTINEL)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def _units(self, name: str, units: int) -> torch.Tensor:
        """Global unit of each local unit of this rank (GDN conv: per sub-block)."""
        if name == "conv" and self.gdn:
            out, base = [], 0
            for g in GDN:
                n = g // self.tp
                out += range(base + self.rank * n, base + (self.rank + 1) * n)
                base += g
            return torch.tensor(out)
        n = units // self.tp
        return torch.arange(self.rank * n, (self.rank + 1) * n)

    def tensors(self) -> list:
        return [t for _, _, t, _ in self.mamba] + self.swa

    def kv_args(self, args) -> None:
        from sglang.srt.disaggregation.base.conn import StateType
        if self.dsa:
            args.state_types = [StateType.DSA]
            args.state_data_ptrs, args.state_data_lens = [[t.data_ptr() for t in self.swa]], [[t.nbytes for t in self.swa]]
            args.state_item_lens = [[t[: self.page].nbytes for t in self.swa]]
            args.state_dim_per_tensor = args.state_slice_outer_counts = args.state_layer_ids = [[]]
            args.state_conv_shard_groups = [[]]
            return
        m = [t for _, _, t, _ in self.mamba]
        if self.mamba_only:
            args.state_types = [StateType.MAMBA]
            args.state_data_ptrs, args.state_data_lens = [[t.data_ptr() for t in m]], [[t.nbytes for t in m]]
            args.state_item_lens = [[t[0].nbytes for t in m]]
            args.state_dim_per_tensor = [[0 if u is None else t.shape[2] for _, _, t, u in self.mamba]]
            args.state_slice_outer_counts = [[1 if u is None else t.shape[1] for _, _, t, u in self.mamba]]
            args.state_conv_shard_groups = [[None for _ in self.mamba]]
            args.state_layer_ids = [[layer for _, layer, _, _ in self.mamba]]
            return
        args.state_types = [StateType.MAMBA, StateType.SWA]
        args.state_data_ptrs = [[t.data_ptr() for t in m], [t.data_ptr() for t in self.swa]]
        args.state_data_lens = [[t.nbytes for t in m], [t.nbytes for t in self.swa]]
        args.state_item_lens = [[t[0].nbytes for t in m], [t[: self.page].nbytes for t in self.swa]]
        args.state_dim_per_tensor = [[0 if u is None else t.shape[2] for _, _, t, u in self.mamba], []]
        args.state_slice_outer_counts = [[1 if u is None else t.shape[1] for _, _, t, u in self.mamba], []]
        args.state_conv_shard_groups = [[list(GDN) if self.gdn and tid == 0 else None for tid, *_ in self.mamba], []]
        args.state_layer_ids = [[layer for _, layer, _, _ in self.mamba], []]
        args.swa_kv_cache_layout = "nhd"

    def expected(self, room: int, tid: int, layer: int, t: torch.Tensor, units) -> torch.Tensor:
        if units is None:
            return value(room, tid, layer, 0, 0, torch.arange(t.shape[1])).to(self.device)
        rows, inner = t.shape[1], t.shape[3]
        return value(room, tid, layer, torch.arange(rows)[:, None, None], units[None, :, None],
                     torch.arange(inner)[None, None, :]).to(self.device)

    def swa_expected(self, room: int, i: int, first_token: int) -> torch.Tensor:
        if self.dsa:   # tensor i is layer layers[i]
            tokens = torch.arange(first_token, first_token + self.page)[:, None]
            return value(room, 200 + self.layers[i], 0, 0, 0, tokens * 64 + torch.arange(3)).to(self.device)
        tokens = torch.arange(first_token, first_token + self.page)[:, None, None]
        return value(room, 100 + i, 0, 0, self.heads[None, :, None],
                     tokens * 64 + torch.arange(self.swa[0].shape[2])).to(self.device)

    def fill(self, room: int, slot: int, swa_pages, first_page: int) -> None:
        for tid, layer, t, units in self.mamba:
            t[slot] = self.expected(room, tid, layer, t, units)
        for i, t in enumerate(self.swa):
            for k, p in enumerate(swa_pages):
                t[p * self.page:(p + 1) * self.page] = self.swa_expected(room, i, (first_page + k) * self.page)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def check(self, room: int, slot: int, swa_pages, first_page: int) -> list[str]:
        bad = []
        for tid, layer, t, units in self.mamba:
            if not torch.equal(t[slot], self.expected(room, tid, layer, t, units)):
                bad.append(f"room {room} Mamba tensor {MAMBA[tid][0]} layer {layer} slot {slot} differs")
        for i, t in enumerate(self.swa):
            for k, p in enumerate(swa_pages):
                got = t[p * self.page:(p + 1) * self.page]
                if not torch.equal(got, self.swa_expected(room, i, (first_page + k) * self.page)):
                    bad.append(f"room {room} {'DSA' if self.dsa else 'SWA'} tensor {i} page {p} (window page {k}) differs")
        return bad

    def untouched(self, slots: set, pages: set) -> list[str]:
        bad = []
        for tid, layer, t, _ in self.mamba:
            for s in range(self.slots):
                if s not in slots and not bool((t[s] == SENTINEL).all()):
                    bad.append(f"Mamba tensor {MAMBA[tid][0]} layer {layer} slot {s} written, no successful room owns it")
        for i, t in enumerate(self.swa):
            for p in range(self.num_pages):
                if p not in pages and not bool((t[p * self.page:(p + 1) * self.page] == SENTINEL).all()):
                    bad.append(f"{'DSA' if self.dsa else 'SWA'} tensor {i} page {p} written, no successful room owns it")
        return bad

    def indices(self, slot: int, pages) -> list:
        """state_indices as SGLang's schedulers build them: Mamba [array(slot)], SWA/DSA page array
        (mamba_only: the Mamba entry alone)."""
        if self.dsa:
            return [np.asarray(pages, dtype=np.int32)]
        if self.mamba_only:
            return [[np.array(slot, dtype=np.int64)]]
        return [[np.array(slot, dtype=np.int64)], np.asarray(pages, dtype=np.int32)]
