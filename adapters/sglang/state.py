"""SGLang's per-request state (KVArgs.state_*, state_indices) as kvstage state pools.

Hybrid models keep state beside the paged KV that decode cannot run without: a Mamba/linear-
attention slot per request, the sliding-window (SWA) pages of the window, DSA indexer pages.
SGLang describes each component by raw pointers (one per layer and state tensor, an item size
per index) and names a request's indices per component, positionally; prefill and decode indices
differ. Each component becomes kvstage pools that move with the request's last page:

- MAMBA. A tensor TP-sharded along one axis (state_dim_per_tensor > 0 units per rank) is a
  `heads` pool whose "heads" are that axis's units (global count = local x attention TP), so
  kvstage splits it across TP sizes like KV heads. Rows before the axis
  (state_slice_outer_counts, e.g. Kimi's [K-1, dim] conv) become separate items: item =
  slot x rows + row. A tensor replicated over TP (dim 0) is a `replicated` pool (one writer per
  decode rank, as SGLang elects). GDN conv state is [q|k|v] with each sub-block sharded on its
  own (state_conv_shard_groups: the global sub-block sizes): a heads pool with those `blocks`, so
  it moves across TP sizes too. A tensor without dim metadata moves between equal attention TP
  sizes only; across sizes the request fails naming it.
- SWA. The window's pages of the SWA sub-pool, sharded like the KV heads: NHD pages
  [page_size, heads, head] become token items of a heads pool (item = page x page_size + token),
  so each item holds whole heads. (SGLang's disaggregation takes NHD sub-pools only.)
- DSA. Indexer pages of an MLA model, replicated over TP: a replicated pool of page items per
  layer (bound to it, `StatePool(layer=...)`), so that under PP each stage moves its own layers'.
- BLOCK_SCALE / BLOCK_SCALE_SWA. MXFP8 per-block scales of the full and the SWA sub-pool, sharded
  over KV heads like the KV they scale: a heads pool, of token items like SWA, or of page items
  in SGLang's interleaved layout at page size 128.
- QSA_PENDING / QSA_COMPRESSED. Qwen4-Exp's QSA index state, replicated over TP: a replicated
  pool of SGLang's items (a request's ring row; a page's compressed keys).
- DSA_TAIL. The DSA indexer's kpool-compress tail: per request a ring row of W token slots (W =
  index_kpool + speculative slots, so it may differ between prefill and decode), of
  `dsa_tail_slot_bytes` each per layer tensor (the model's DSA index_head_dim in bf16; the
  manager reads it from the model config). A replicated pool of slot items (row x W + slot); a
  request's index [row, off1, n1, off2, n2, W] names its live slots in ring order, which pair
  positionally with the decode's as SGLang's mooncake backend pairs them.
- MINIMAX_INDEX_K / MINIMAX_DENSE_KV. MiniMax sparse attention's index keys (one head, the same on
  every rank: a replicated pool of page items) and its dense layers' KV (NHD pages: a heads pool
  of token items, as SWA).

Anything else (DeepSeek V4's swa_ring, c128_state, request_row, which come only with its pool
and its non-NHD KV layout, refused already) makes the manager refuse to start, naming the state
type.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch

from kvstage import StatePool
from kvstage.transfer.protocol.pool_parts import writers_mismatch
from kvstage.transfer.raw_memory import tensor_at


@dataclass(kw_only=True)
class _Group:
    """Tensors of one component that form one kvstage pool."""

    sharding: str
    heads: int | None
    expand: int                     # pool items per SGLang index
    blocks: list | None = None   # heads sub-blocks sharded each on their own (GDN conv)
    layer: int | None = None     # the model layer the pool belongs to (DSA: one pool per layer)
    tensors: list = field(default_factory=list)


@dataclass(kw_only=True)
class Component:
    """One entry of kv_args.state_types: its pools and what limits it."""

    index: int
    kind: str
    pools: dict                     # pool name -> items per SGLang index
    same_tp_only: str | None = None


class StateMap:
    """One rank's state components as kvstage pools; per request, state_indices as pool_items."""

    def __init__(self, args, layout, device: torch.device, tp_size: int, *, dsa_tail_slot_bytes: int | None = None):
        self.components: list[Component] = []
        self.pools: dict[str, StatePool] = {}
        self._layout = layout
        self._verdicts: dict = {}
        types = list(getattr(args, "state_types", None) or [])
        self.num_types = len(types)
        refused = []
        for i, st in enumerate(types):
            kind = str(getattr(st, "value", st))
            build = _BUILDERS.get(kind)
            if kind == "dsa_tail":
                build = partial(_dsa_tail, slot_bytes=dsa_tail_slot_bytes)
            try:
                if build is None:
                    why = " (DeepSeek V4's pool only, whose KV layout kvstage refuses)" if kind in _DSV4_ONLY else ""
                    raise NotImplementedError(f"state type {kind!r}{why}")
                groups, same_tp_only = build(_Entries(args, i, device), layout, args, tp_size)
            except NotImplementedError as exc:
                refused.append(str(exc))
                continue
            comp = Component(index=i, kind=kind, pools={}, same_tp_only=same_tp_only)
            seen: dict = {}
            for (suffix, _), g in groups.items():
                # names must agree between prefill and decode, whose slot and page counts differ:
                # a second item count under one suffix is told apart by its order, not its size
                nth = seen[suffix] = seen.get(suffix, -1) + 1
                name = f"state{i}.{kind}{suffix}" + (f".{nth}" if nth else "")
                self.pools[name] = StatePool(tensors=g.tensors, sharding=g.sharding, heads=g.heads, blocks=g.blocks,
                                             layer=g.layer)
                comp.pools[name] = g.expand
            self.components.append(comp)
        if refused:
            raise NotImplementedError("SGLang state the kvstage backend does not move yet: " + "; ".join(refused))

    def items(self, state_indices) -> dict:
        """A request's pool_items from SGLang's state_indices (one entry per state type; None or
        empty: nothing of that component). ValueError when they do not fit the components."""
        given = list(state_indices or [])
        if any(_indices(x, "extra").size for x in given[self.num_types:]):
            raise ValueError(f"state_indices has {len(given)} entries, this rank has {self.num_types} state types")
        out = {}
        for comp in self.components:
            x = given[comp.index] if comp.index < len(given) else None
            idx = _indices(x, comp.kind)
            if idx.size == 0:
                continue
            for name, expand in comp.pools.items():
                if comp.kind == "dsa_tail":
                    out[name] = _dsa_tail_items(idx, expand)
                    continue
                out[name] = (idx[:, None] * expand + np.arange(expand, dtype=np.int64)).reshape(-1)
        return out

    def past_prefix(self, items: dict, pages: int) -> dict:
        """`items` without the first `pages` pages of page-indexed state (DSA indexer pages, which
        SGLang names from the prefix it popped on, in page order): the pages a decode holds in its
        prefix beyond the one the sender popped (a PP stage told to start before its decode
        stage's metadata came pops 0, and kvstage skips those pages' KV as it learns the prefix)."""
        if pages <= 0:
            return items
        out = dict(items)
        for comp in self.components:
            if comp.kind == "dsa":
                for name, expand in comp.pools.items():
                    if name in out:
                        out[name] = out[name][pages * expand:]
        return out

    def peer_problem(self, prefill_tp: int, decode_tp: int) -> str | None:
        """Why state cannot move between these attention TP sizes (None: it can)."""
        if not self.components or prefill_tp == decode_tp:
            return None
        if (prefill_tp, decode_tp) not in self._verdicts:
            self._verdicts[(prefill_tp, decode_tp)] = self._problem(prefill_tp, decode_tp)
        return self._verdicts[(prefill_tp, decode_tp)]

    def _problem(self, prefill_tp: int, decode_tp: int) -> str | None:
        for comp in self.components:
            if comp.same_tp_only:
                return (f"the kvstage backend moves {comp.same_tp_only} between equal attention TP sizes only "
                        f"(prefill TP {prefill_tp}, decode TP {decode_tp})")
        specs = [p.spec(name, self._layout) for name, p in self.pools.items()]
        why = writers_mismatch(specs, prefill_tp, decode_tp, self._layout.total_kv_heads, self._layout.mla)
        if why:
            return f"the kvstage backend cannot move this model's state between these TP sizes: {why}"
        return None


def _dsa_tail_items(idx: np.ndarray, slots: int) -> np.ndarray:
    """A DSA tail index [row, off1, n1, off2, n2, ring slots] as slot items of this rank's pool
    (row x slots + slot), its live slots in ring order. ValueError when it does not fit."""
    if idx.size != 6:
        raise ValueError(f"a DSA tail index is [row, off1, n1, off2, n2, ring slots], got {idx.tolist()}")
    row, off1, n1, off2, n2, size = (int(v) for v in idx)
    if size != slots:
        raise ValueError(f"DSA tail ring of {size} slots, this rank's tail rows hold {slots}")
    if min(row, off1, n1, off2, n2) < 0 or off1 + n1 > slots or off2 + n2 > slots:
        raise ValueError(f"DSA tail index {idx.tolist()} does not fit a ring of {slots} slots")
    live = np.concatenate([np.arange(off1, off1 + n1), np.arange(off2, off2 + n2)]).astype(np.int64)
    return row * slots + live


def _indices(x, kind: str) -> np.ndarray:
    if x is None:
        return np.zeros(0, dtype=np.int64)
    if isinstance(x, torch.Tensor):
        x = x.cpu().numpy()
    if isinstance(x, (list, tuple)):     # Mamba: [array(slot)]; others: an array or a list of ints
        arr = np.concatenate([np.asarray(v).reshape(-1) for v in x]) if x else np.zeros(0, dtype=np.int64)
    else:
        arr = np.asarray(x).reshape(-1)
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"{kind} state indices must be integers, got {x!r}")
    return arr.astype(np.int64)


class _Entries:
    """The pointer lists of component `i`, as byte views (elided zero-length entries skipped)."""

    def __init__(self, args, i: int, device: torch.device):
        self.args, self.i, self.device = args, i, device

    def field(self, name: str) -> list:
        v = getattr(self.args, name, None) or []
        return list(v[self.i] or []) if self.i < len(v) else []

    def __iter__(self):
        ptrs, lens, items = (self.field(n) for n in ("state_data_ptrs", "state_data_lens", "state_item_lens"))
        if not (len(ptrs) == len(lens) == len(items)):
            raise NotImplementedError(f"state component {self.i}: {len(ptrs)} pointers, {len(lens)} lengths, "
                                      f"{len(items)} item sizes")
        for j, (ptr, nbytes, item) in enumerate(zip(ptrs, lens, items)):
            if nbytes == 0:
                continue
            if item <= 0 or nbytes % item:
                raise NotImplementedError(f"state component {self.i} tensor {j}: {nbytes} bytes are not whole "
                                          f"{item}-byte items")
            yield j, int(ptr), int(nbytes), int(item)

    def view(self, ptr: int, nbytes: int, shape: tuple) -> torch.Tensor:
        return tensor_at(ptr, nbytes, torch.uint8, shape, self.device)


def _add(groups: dict, suffix: str, sharding: str, heads, expand: int, tensor: torch.Tensor,
         blocks: list | None = None, layer: int | None = None) -> None:
    """Tensors of one pool share a suffix (what they are) and their item count."""
    g = groups.setdefault((suffix, tensor.shape[0]),
                          _Group(sharding=sharding, heads=heads, expand=expand, blocks=blocks, layer=layer))
    g.tensors.append(tensor)


def _mamba(entries: _Entries, layout, args, tp: int):
    dims, outers = entries.field("state_dim_per_tensor"), entries.field("state_slice_outer_counts")
    subdims = entries.field("state_conv_shard_groups")
    groups: dict = {}
    same_tp_only = None
    for j, ptr, nbytes, item in entries:
        slots = nbytes // item
        if not dims:
            same_tp_only = "Mamba state without per-tensor TP dims (state_dim_per_tensor)"
            _add(groups, ".whole", "replicated", None, 1, entries.view(ptr, nbytes, (slots, item)))
            continue
        dim, outer = int(dims[j]), int(outers[j]) if j < len(outers) and outers[j] else 1
        if dim == 0:            # replicated over attention TP: one writer per decode rank
            _add(groups, ".rep", "replicated", None, 1, entries.view(ptr, nbytes, (slots, item)))
            continue
        if item % (outer * dim):
            raise NotImplementedError(f"Mamba state tensor {j}: item of {item} bytes is not {outer} rows x {dim} units")
        sub = subdims[j] if j < len(subdims) else None
        blocks = [int(b) for b in sub] if sub and len(sub) > 1 else None
        if blocks and sum(blocks) != dim * tp:
            raise NotImplementedError(f"Mamba state tensor {j}: conv sub-blocks {blocks} do not add up to its "
                                      f"{dim} units x attention TP {tp}")
        suffix = f".h{dim * tp}x{outer}" + ("b" + "-".join(map(str, blocks)) if blocks else "")
        _add(groups, suffix, "heads", dim * tp, outer,
             entries.view(ptr, nbytes, (slots * outer, dim, item // (outer * dim))), blocks)
    return groups, same_tp_only


def _swa(entries: _Entries, layout, args, tp: int):
    if layout.mla:
        raise NotImplementedError("SWA state beside an MLA KV cache")
    kv_layout = getattr(args, "swa_kv_cache_layout", None)
    if kv_layout != "nhd":
        raise NotImplementedError(f"SWA state in a {kv_layout!r} sub-pool (kvstage moves NHD pages)")
    page, heads = int(args.page_size), layout.local_heads
    groups: dict = {}
    for j, ptr, nbytes, item in entries:
        if item % (page * heads):
            raise NotImplementedError(f"SWA state tensor {j}: a {item}-byte page is not {page} tokens x {heads} heads")
        pages, head = nbytes // item, item // (page * heads)
        _add(groups, "", "heads", layout.total_kv_heads, page,
             entries.view(ptr, nbytes, (pages * page, heads, head)))
    return groups, None


# SGLang's MHATokenToKVPoolMXFP8 keeps its scales in the FA4 interleaved atom layout at this page size
MXFP8_INTERLEAVED_PAGE = 128


def _block_scale(entries: _Entries, layout, args, tp: int):
    """MXFP8 per-32-element UE8M0 scales (SGLang's MHATokenToKVPoolMXFP8.get_kv_scale_buf_infos:
    one tensor per layer, K then V, an item per page), sharded over the KV heads like the KV they
    scale. At page size 128 SGLang interleaves them per page, [pages, heads, 32, 4, sf]: page items
    of a heads pool; otherwise they are per token, [tokens, heads, sf]: token items, as SWA pages."""
    if layout.mla:
        raise NotImplementedError("MXFP8 block scales beside an MLA KV cache")
    page, heads = int(args.page_size), layout.local_heads
    expand = 1 if page == MXFP8_INTERLEAVED_PAGE else page
    groups: dict = {}
    for j, ptr, nbytes, item in entries:
        if item % (page * heads):
            raise NotImplementedError(f"MXFP8 block scale tensor {j}: a {item}-byte page is not {page} tokens x "
                                      f"{heads} heads")
        rows = nbytes // item * expand
        _add(groups, "", "heads", layout.total_kv_heads, expand,
             entries.view(ptr, nbytes, (rows, heads, item // (expand * heads))))
    return groups, None


def _dsa_tail(entries: _Entries, layout, args, tp: int, *, slot_bytes: int | None):
    """The DSA kpool-compress tail rings (module docstring): a replicated pool of `slot_bytes`
    slots, W = a ring row's bytes / slot_bytes per SGLang index (Component.pools keeps W)."""
    if not layout.mla:
        raise NotImplementedError("DSA tail state beside a non-MLA KV cache")
    if not slot_bytes:
        raise NotImplementedError("DSA tail state without the bytes of one tail slot (the model's DSA index_head_dim)")
    groups: dict = {}
    slots = None
    for j, ptr, nbytes, item in entries:
        if item % slot_bytes or slots not in (None, item // slot_bytes):
            raise NotImplementedError(f"DSA tail tensor {j}: a {item}-byte ring row is not whole {slot_bytes}-byte "
                                      f"slots" + (f" ({slots} per row in the tensors before it)" if slots else ""))
        slots = item // slot_bytes
        _add(groups, "", "replicated", None, slots, entries.view(ptr, nbytes, (nbytes // slot_bytes, slot_bytes)))
    return groups, None


def _dsa(entries: _Entries, layout, args, tp: int):
    """One pool per MLA layer (`StatePool(layer=...)`): SGLang lists a DSA pool's indexer buffers
    one per layer of the rank's PP stage, so under PP each stage registers and writes its own
    layers' (an elided layer, a buffer of no rows, has no pool). A list of another length than
    the stage's layers moves as one pool of no layer, without PP only."""
    if not layout.mla:
        raise NotImplementedError("DSA indexer state beside a non-MLA KV cache")
    stage = range(layout.layers.start, min(layout.layers.stop, layout.num_layers))
    count = len(entries.field("state_data_ptrs"))
    if count != len(stage) and layout.pp_size > 1:
        raise NotImplementedError(f"DSA state of {count} buffers beside PP stage [{stage.start}, {stage.stop}) of "
                                  f"{len(stage)} layers")
    groups: dict = {}
    for j, ptr, nbytes, item in entries:
        layer = stage.start + j if count == len(stage) else None
        _add(groups, "" if layer is None else f".L{layer}", "replicated", None, 1,
             entries.view(ptr, nbytes, (nbytes // item, item)), layer=layer)
    return groups, None


def _qsa(entries: _Entries, layout, args, tp: int):
    """QSA (Qwen4-Exp) index state, the same on every attention TP rank (SGLang's mooncake backend
    sends it from one prefill rank per decode rank at any TP sizes): `qsa_pending`, a per-request
    ring row per index (the key-state rings per layer and the RoPE position ring), and
    `qsa_compressed`, the compressed keys of a full KV page per index. A replicated pool of those
    items; both sides must name as many (SGLang's mooncake backend requires it too)."""
    groups: dict = {}
    for _, ptr, nbytes, item in entries:
        _add(groups, "", "replicated", None, 1, entries.view(ptr, nbytes, (nbytes // item, item)))
    return groups, None


def _minimax_index_k(entries: _Entries, layout, args, tp: int):
    """MiniMax sparse attention's index keys (one K-only head per layer, the same on every rank):
    a replicated pool of page items."""
    groups: dict = {}
    for _, ptr, nbytes, item in entries:
        _add(groups, "", "replicated", None, 1, entries.view(ptr, nbytes, (nbytes // item, item)))
    return groups, None


def _minimax_dense_kv(entries: _Entries, layout, args, tp: int):
    """MiniMax's dense layers' KV (K layers then V layers of SGLang's MHA pool, NHD pages, a page
    per index): a heads pool over the KV heads of token items, as SWA pages."""
    if layout.mla:
        raise NotImplementedError("MiniMax dense KV state beside an MLA KV cache")
    page, heads = int(args.page_size), layout.local_heads
    groups: dict = {}
    for j, ptr, nbytes, item in entries:
        if item % (page * heads):
            raise NotImplementedError(f"MiniMax dense KV tensor {j}: a {item}-byte page is not {page} tokens x "
                                      f"{heads} heads")
        _add(groups, "", "heads", layout.total_kv_heads, page,
             entries.view(ptr, nbytes, (nbytes // item * page, heads, item // (page * heads))))
    return groups, None


# registered only by SGLang's DeepSeekV4TokenToKVPool (setup_state_kv_args), whose compressed,
# non-NHD KV layout the manager refuses at start (geometry.unsupported_features)
_DSV4_ONLY = ("swa_ring", "c128_state", "request_row")

_BUILDERS = {"mamba": _mamba, "swa": _swa, "dsa": _dsa, "block_scale": _block_scale, "block_scale_swa": _block_scale,
             "qsa_pending": _qsa, "qsa_compressed": _qsa,
             "minimax_index_k": _minimax_index_k, "minimax_dense_kv": _minimax_dense_kv}
