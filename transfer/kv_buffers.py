"""One rank's KV cache as tensors (`KVBuffers`): the K and V tensors of every layer, the state
pools and the draft KV's, checked against the rank's geometry (layout.py's `KVLayout`): dtype,
shape, device, contiguity, and no two tensors sharing bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .draft_kv import is_draft_pool
from .layout import SUPPORTED_DTYPE_NAMES, KVLayout
from .pool_spec import PoolSpec
from .state_pools import StatePool, draft_pools, memory_kind

#: The KV dtypes kvstage moves, torch's objects by name (layout.SUPPORTED_DTYPE_NAMES).
SUPPORTED_DTYPES: dict[torch.dtype, str] = {getattr(torch, name): name for name in SUPPORTED_DTYPE_NAMES}


@dataclass
class KVBuffers:
    """One rank's KV cache: per layer a tensor [num_pages * page_size, local_heads, head_dim].

    `v` is None for MLA. All tensors share dtype, device and token count, and are contiguous.
    `pools`: named state pools moved with each request's last page (see state_pools.py).
    `draft_k`/`draft_v`: per draft KV entry (KVLayout.draft), like `k`/`v` with the draft's local
    heads and head_dim; the engine handles them as entries after the target's layers
    (`entry_k`, `entry_v`), or, for a draft of its own geometry, as internal pools (draft_kv.py)
    that `validate` adds to `pools`.
    """

    k: Sequence[torch.Tensor]
    v: Sequence[torch.Tensor] | None = None
    pools: dict[str, StatePool] = field(default_factory=dict)
    draft_k: Sequence[torch.Tensor] = ()
    draft_v: Sequence[torch.Tensor] | None = None
    num_pages: int = field(default=0, init=False)
    pool_specs: list[PoolSpec] = field(default_factory=list, init=False)
    first_layer: int = field(default=0, init=False)   # the model layer of k[0] (a PP stage's first)
    draft_as_pools: bool = field(default=False, init=False)   # a draft of its own geometry (draft_kv.py)

    def _groups(self, layout: KVLayout) -> list[tuple[str, Sequence[torch.Tensor], int]]:
        """(name, tensors, layers expected) of every KV tensor list, checking which exist."""
        if layout.mla and self.v is not None:
            raise ValueError("v must be None for an MLA layout (the latent lives in k)")
        if not layout.has_v and self.v is not None:
            raise ValueError(f"v must be None for page_format {layout.page_format.value} (K and V fused in k)")
        if layout.has_v and self.v is None:
            raise ValueError("v is None but the layout is not MLA: pass one V tensor per layer")
        stage = len(layout.layers) - layout.draft_layers
        groups = [("k", self.k, stage)] + ([("v", self.v, stage)] if self.v is not None else [])
        if layout.draft is None:
            if self.draft_k or self.draft_v is not None:
                raise ValueError("draft_k/draft_v given but the layout has no draft (KVLayout(draft=DraftKV(...)))")
            return groups
        if layout.has_v != (self.draft_v is not None):
            raise ValueError("draft_v must be None for an MLA or K/V-fused layout" if self.draft_v is not None else
                             "draft_v is None but the layout is not MLA: pass one V tensor per draft entry")
        groups.append(("draft_k", self.draft_k or (), layout.draft_entries))
        if self.draft_v is not None:
            groups.append(("draft_v", self.draft_v, layout.draft_entries))
        return groups

    def validate(self, layout: KVLayout) -> KVBuffers:
        """Check the tensors against `layout`; set num_pages. Raises ValueError naming the layer."""
        groups = self._groups(layout)
        target_tail = (layout.local_heads, layout.head_dim)
        draft = layout.draft
        draft_tail = layout.draft_token_shape
        tokens = device = None
        for name, tensors, want in groups:
            expected_tail = draft_tail if name.startswith("draft") else target_tail
            if len(tensors) != want:
                layers = layout.stage
                assert layers is not None, "set by KVLayout.__post_init__"
                stage = "" if want == layout.num_layers or name.startswith("draft") else \
                    f" (PP stage {layout.pp_rank}: layers [{layers.start}, {layers.stop}))"
                what = "DraftKV.num_layers is" if name.startswith("draft") else "layout has"
                raise ValueError(f"{name} has {len(tensors)} layers, {what} {want}{stage}")
            for i, t in enumerate(tensors):
                where = f"{name}[{i}]"
                if not isinstance(t, torch.Tensor):
                    raise ValueError(f"{where} is {type(t).__name__}, expected a torch.Tensor")
                if t.dim() != 3 or tuple(t.shape[1:]) != expected_tail:
                    raise ValueError(f"{where} has shape {tuple(t.shape)}, expected "
                                     f"[num_pages * {layout.page_size}, {expected_tail[0]}, {expected_tail[1]}]")
                if t.dtype != layout.dtype:
                    raise ValueError(f"{where} has dtype {t.dtype}, layout says {layout.dtype}")
                if not t.is_contiguous():
                    raise ValueError(f"{where} is not contiguous")
                if t.shape[0] % layout.page_size:
                    raise ValueError(f"{where} has {t.shape[0]} tokens, not a multiple of page_size={layout.page_size}")
                check_memory_device(where, t.device)
                if tokens is None:
                    tokens, device = t.shape[0], t.device
                elif t.shape[0] != tokens:
                    raise ValueError(f"{where} has {t.shape[0]} tokens, layer k[0] has {tokens}")
                elif t.device != device:
                    raise ValueError(f"{where} is on {t.device}, k[0] is on {device}")
        if not tokens:
            raise ValueError("the KV cache holds no pages")
        if not isinstance(self.pools, dict) or not all(isinstance(p, StatePool) for p in self.pools.values()):
            raise ValueError(f"pools must be a dict of StatePool by name, got {self.pools!r}")
        user = {n: p for n, p in self.pools.items() if not (self.draft_as_pools and is_draft_pool(n))}
        for n in user:
            if isinstance(n, str) and is_draft_pool(n):
                raise ValueError(f"pool name {n!r} is reserved: kvstage names a draft KV of its own geometry so")
        self.draft_as_pools = layout.draft_own_geometry
        assert draft is None or draft.total_kv_heads is not None, "KVLayout resolves the draft's heads"
        own = draft_pools(draft.total_kv_heads, self.draft_k, self.draft_v, layout.num_layers - 1) \
            if self.draft_as_pools and draft is not None and draft.total_kv_heads else {}
        self.pools = {**user, **own}
        self.pool_specs = [self.pools[n].spec(n, layout) for n in sorted(self.pools)]
        heads = [s.name for s in self.pool_specs if s.sharding == "heads"]
        if layout.page_shards > 1 and heads:   # the pools ride with whichever rank owns the last page
            raise ValueError(f"pools {heads} are split by heads, which KV page sharding (page_shards="
                             f"{layout.page_shards}) does not serve: only replicated pools move beside it")
        named = [(f"{name}[{i}]", t) for name, tensors, _ in groups for i, t in enumerate(tensors)]
        for n in sorted(user):
            for i, t in enumerate(self.pools[n].tensors):
                check_memory_device(f"pool {n!r} tensor {i}", t.device)
                named.append((f"pool {n!r}[{i}]", t))
        _check_disjoint(named)
        self.num_pages = tokens // layout.page_size
        self.first_layer = layout.layers.start
        return self

    @classmethod
    def from_pointers(cls, layout: KVLayout, data_ptrs: Sequence[int], data_lens: Sequence[int],
                      item_lens: Sequence[int], device: str | torch.device = "cpu") -> KVBuffers:
        """Buffers over memory the serving engine owns, as SGLang's KVArgs gives it: per layer
        an address, a byte length and the bytes of one page (K layers, then V layers; MLA: K
        only). No copy; kvstage never frees this memory. Validated against `layout`."""
        from .raw_memory import check_pointers, tensor_at
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"from_pointers(device={device!r}) is not a torch device: {exc}") from None
        check_memory_device(f"from_pointers(device={device!r})", dev)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"from_pointers(device={device!r}): CUDA is not available in this process, so the "
                             f"pointers cannot be device memory (host memory is device='cpu')")
        pages = check_pointers(layout, data_ptrs, data_lens, item_lens)
        n, d = len(layout.layers) - layout.draft_layers, layout.draft_entries
        target = (pages * layout.page_size, layout.local_heads, layout.head_dim)
        draft = (pages * layout.page_size, *layout.draft_token_shape)
        views = [tensor_at(p, b, layout.dtype, target if i < n * layout.num_kv else draft, dev)
                 for i, (p, b) in enumerate(zip(data_ptrs, data_lens))]
        if layout.num_kv == 1:   # target entries, then the draft's
            return cls(views[:n], None, draft_k=views[n:]).validate(layout)
        # K then V of the target, then K then V of the draft (SGLang appends the draft's buffers)
        return cls(views[:n], views[n:2 * n], draft_k=views[2 * n:2 * n + d],
                   draft_v=views[2 * n + d:] if d else None).validate(layout)

    @property
    def device(self) -> torch.device:
        """The KV cache's device (each state pool has its own: `StatePool.device`)."""
        return self.k[0].device

    @property
    def kind(self) -> str:
        """The KV cache's memory kind, "VRAM" or "DRAM"."""
        return memory_kind(self.device)

    @property
    def entry_k(self) -> list[torch.Tensor]:
        """K tensor of every KV entry: the target's layers, then the draft's entries (not those
        of a draft of its own geometry: they are pools)."""
        return list(self.k) + ([] if self.draft_as_pools else list(self.draft_k or ()))

    @property
    def entry_v(self) -> list[torch.Tensor] | None:
        """V tensor of every KV entry, like entry_k (None without V)."""
        if self.v is None:
            return None
        return list(self.v) + ([] if self.draft_as_pools else list(self.draft_v or ()))

    def layer_views(self, layers: range) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """The K (and V) tensors of model `layers` (draft entries after the model's layers): what a
        layer-wise write reads or fills."""
        lo, hi = layers.start - self.first_layer, layers.stop - self.first_layer
        v = self.entry_v
        return self.entry_k[lo:hi], (v[lo:hi] if v is not None else None)

    def tensors(self) -> list[torch.Tensor]:
        """K tensors then V tensors, in entry order (the target's layers, then the draft's)."""
        return self.entry_k + (self.entry_v or [])

    def pool_tensors(self) -> list[torch.Tensor]:
        """Every state pool tensor, pools by name."""
        return [t for n in sorted(self.pools) for t in self.pools[n].tensors]



MEMORY_DEVICES = ("cpu", "cuda")   # what the backends can register and write


def check_memory_device(where: str, device: torch.device) -> None:
    """Only memory a backend can register: a `meta` tensor has no bytes at all, and other
    devices (mps, xpu, ...) are not memory NIXL or Mooncake write. ValueError naming `where`."""
    if device.type == "meta":
        raise ValueError(f"{where} is on the meta device: it has no memory to send or receive (allocate it on "
                         f"{' or '.join(MEMORY_DEVICES)})")
    if device.type not in MEMORY_DEVICES:
        raise ValueError(f"{where} is on {device}: kvstage moves KV caches in {' or '.join(MEMORY_DEVICES)} "
                         f"memory only")


def _check_disjoint(named: list[tuple[str, torch.Tensor]]) -> None:
    """Refuse tensors whose bytes overlap (K aliasing V, a layer reused, overlapping views): a
    write into one would silently land in the other, and backends disagree on accepting it."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), name) for name, t in named)
    reach, owner = 0, ""
    for start, end, name in spans:
        if start < reach:
            first, second = sorted((owner, name), key=_tensor_order)
            raise ValueError(f"{first} and {second} overlap in memory: each K, V and pool tensor needs its own "
                             f"bytes")
        if end > reach:
            reach, owner = end, name


def _tensor_order(name: str) -> tuple[str, int]:
    kind, _, index = name.rpartition("[")
    return kind, int(index.rstrip("]"))
