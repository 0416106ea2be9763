"""The KV-cache geometry of one rank (`KVLayout`) and the summary two peers compare before any
byte moves. Pure: validation and arithmetic only, no torch import (a dtype is read from the
torch object it is); the tensors are kv_buffers.py's `KVBuffers`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from ..wire import prebuild_struct_info
from .deprecation import accepts_old_positional
from .draft_kv import DraftKV, DraftShape, draft_mismatch, is_draft_pool
from .page_format import PageFormat, parse_page_format
from .pool_spec import PoolSpec, pool_mismatches
from .protocol.token_mapping import DCPLayout

if TYPE_CHECKING:
    import torch

#: Bumped whenever the wire protocol or the staging region layout changes incompatibly.
PROTOCOL_VERSION = 2
#: Token-major cache layout: per layer [num_pages * page_size, local_heads, head_dim]. Other
#: page formats (page_format.py) are described in these terms and named in the summary.
LAYOUT_FORMAT = PageFormat.NHD.value

#: The KV dtypes kvstage moves, by torch's name (without "torch.").
SUPPORTED_DTYPE_NAMES = ("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "int8", "uint8")


def dtype_name(dtype: object) -> str | None:
    """A torch dtype's name without "torch." (None for anything else): read from the object, so
    the geometry needs no torch import."""
    kind = type(dtype)
    return str(dtype).removeprefix("torch.") if (kind.__module__, kind.__name__) == ("torch", "dtype") else None


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def check_stage(stage: object, num_layers: int, pp_size: int, pp_rank: int) -> range:
    """A PP stage's layer range (None: every layer) as a non-empty step-1 range inside the
    model, the first stage starting at layer 0 and the last ending at its last layer. Raises
    ValueError saying what is wrong."""
    if stage is None:
        stage = range(num_layers)
    if not isinstance(stage, range) or stage.step != 1 or len(stage) == 0:
        raise ValueError(f"stage must be a non-empty range of layers with step 1, got {stage!r}")
    if stage.start < 0 or stage.stop > num_layers:
        raise ValueError(f"stage layers [{stage.start}, {stage.stop}) are outside the model's {num_layers} layers")
    if pp_rank == 0 and stage.start != 0:
        raise ValueError(f"PP stage 0 must start at layer 0, its stage is [{stage.start}, {stage.stop})")
    if pp_rank == pp_size - 1 and stage.stop != num_layers:
        raise ValueError(f"the last PP stage ({pp_rank} of {pp_size}) must end at layer {num_layers}, its stage is "
                         f"[{stage.start}, {stage.stop})")
    return stage


class LayoutSummary(msgspec.Struct, frozen=True, kw_only=True):
    """What two peers must agree on to exchange KV (TP size and rank may differ)."""

    dtype: str
    head_dim: int
    page_size: int
    num_layers: int
    total_kv_heads: int
    mla: bool
    layout_format: str = LAYOUT_FORMAT
    protocol_version: int = PROTOCOL_VERSION
    pools: list[PoolSpec] = []      # state pools (aux rows, Mamba states, ...), by name
    draft_layers: int = 0           # draft KV entries (speculative decoding; 0: none) and their geometry
    draft_kv_heads: int = 0
    draft_head_dim: int = 0

    def mismatches(self, other: LayoutSummary, shared: range | None = None) -> list[str]:
        """Human-readable differences, empty when compatible. `self` is the prefill's summary
        (its rank checks each decode rank's Hello): the draft pairing rule is one-sided.
        `shared`: the model layers both ranks' PP stages hold (None: all), whose pools both
        must register (pool_spec.pool_mismatches); the drafts are compared only where both hold
        the model's last layer (the draft lives on the last PP stage)."""
        out = []
        for name in self.__struct_fields__:
            mine, theirs = getattr(self, name), getattr(other, name)
            if name == "pools":   # a draft's own pools are compared as its draft_* fields
                out += pool_mismatches([p for p in mine if not is_draft_pool(p.name)],
                                       [p for p in theirs if not is_draft_pool(p.name)], shared)
            elif name.startswith("draft_"):
                continue
            elif mine != theirs:
                out.append(f"{name}: {mine!r} here vs {theirs!r} at peer")
        if shared is not None and self.num_layers - 1 not in shared:
            return out
        draft = draft_mismatch(self.draft_shape(), other.draft_shape())
        return out + ([draft] if draft else [])

    def draft_shape(self) -> DraftShape:
        return DraftShape(num_layers=self.draft_layers, total_kv_heads=self.draft_kv_heads,
                          head_dim=self.draft_head_dim)


@accepts_old_positional("num_layers", "total_kv_heads", "head_dim", "dtype", "page_size", "tp_size", "tp_rank", "mla")
@dataclass(frozen=True, kw_only=True)
class KVLayout:
    """Geometry of one rank's paged KV cache.

    Local heads per rank are total_kv_heads // tp_size, or 1 when tp_size > total_kv_heads:
    then copies of a head sit on consecutive ranks and rank r holds head r // (tp_size //
    total_kv_heads). MLA has one replicated latent "head" and no V tensor.

    Decode context parallel (DCP, token_mapping.py): `dcp_size` > 1 splits a request's tokens
    over the ranks of a DCP group (MLA only, as SGLang's): token t lives on DCP rank ``t % dcp_size``
    at local slot ``t // dcp_size``, and this rank's pages hold its local slots only. Its DCP
    rank is ``tp_rank % dcp_size`` (consecutive TP ranks form the group, as in SGLang and vLLM),
    so `dcp_size` must divide `tp_size`; with PP each stage's writes carry its layers of those
    tokens; not with a draft (not served).

    KV page sharding (a prefill rank, protocol/page_shards.py): `page_shards` > 1 splits the
    request's logical pages over the TP group (MLA only, as SGLang's `--enable-kv-cache-sharding`):
    logical page l lives on rank ``l % page_shards`` at local page ``l // page_shards``, so the
    pages given to `send()` are logical ids below ``page_shards`` times this rank's pages.
    `page_shards` is the TP size (each PP stage's TP group shards its own layers' pages); not with
    DCP nor a draft (not served).

    Pipeline parallelism (prefill only): stage `pp_rank` of `pp_size` holds the model's layers
    `stage` (None: all of them) and its buffers hold only those, in order; `num_layers` stays
    the model's. The stages of an engine must tile [0, num_layers), which the decode side
    checks (protocol/peering.py). Elsewhere a rank is `rank` = pp_rank * tp_size + tp_rank of
    the engine's `ranks` (bootstrap registration, peer keys, tag writers).

    `draft` (speculative decoding, draft_kv.py): the draft model's KV entries. With the target's
    geometry they are held after the target's layers (entry indices [num_layers, num_entries))
    and moved like more layers; with their own (`draft_own_geometry`) they are internal heads
    pools moved with the request's last piece. With PP only the last stage holds a draft (SGLang
    runs the draft model there): its entries follow the model's last layer, and any other
    stage given one is a ValueError.
    """

    num_layers: int
    total_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    page_size: int
    tp_size: int
    tp_rank: int
    mla: bool = False
    page_format: PageFormat = PageFormat.NHD
    pp_size: int = 1
    pp_rank: int = 0
    stage: range | None = None
    draft: DraftKV | None = None
    dcp_size: int = 1
    page_shards: int = 1

    def __post_init__(self) -> None:
        for name in ("num_layers", "total_kv_heads", "head_dim", "page_size", "tp_size", "pp_size"):
            _positive_int(name, getattr(self, name))
        for name, size in (("tp_rank", "tp_size"), ("pp_rank", "pp_size")):
            value, bound = getattr(self, name), getattr(self, size)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an int, got {value!r}")
            if not 0 <= value < bound:
                raise ValueError(f"{name} must be in [0, {size}={bound}), got {value}")
        object.__setattr__(self, "stage", check_stage(self.stage, self.num_layers, self.pp_size, self.pp_rank))
        if dtype_name(self.dtype) not in SUPPORTED_DTYPE_NAMES:
            raise ValueError(f"dtype {self.dtype} is not supported; use one of torch's "
                             f"{', '.join(SUPPORTED_DTYPE_NAMES)}")
        if not isinstance(self.mla, bool):
            raise ValueError(f"mla must be a bool, got {self.mla!r}")
        object.__setattr__(self, "page_format", parse_page_format(self.page_format))
        if self.page_format.head_major and self.page_size != 1:
            raise ValueError(f"page_format {self.page_format.value} is described with page_size 1 (one head's page "
                             f"is one row of head_dim elements; see page_layouts.EngineCache), got {self.page_size}")
        if self.mla and self.page_format.kv_fused:
            raise ValueError(f"page_format {self.page_format.value} fuses K and V; an MLA cache has no V")
        if self.mla:
            if self.total_kv_heads != 1:
                raise ValueError(f"total_kv_heads must be 1 for MLA (one latent head), got {self.total_kv_heads}")
        elif self.total_kv_heads % self.tp_size and self.tp_size % self.total_kv_heads:
            raise ValueError(
                f"total_kv_heads={self.total_kv_heads} must be divisible by tp_size={self.tp_size}, "
                f"or tp_size a multiple of total_kv_heads (head replication)")
        if self.draft is not None:
            self._check_draft()
        self._check_dcp()
        self._check_page_shards()

    def _check_page_shards(self) -> None:
        _positive_int("page_shards", self.page_shards)
        if self.page_shards == 1:
            return
        where = f"page_shards={self.page_shards}"
        if not self.mla:
            raise ValueError(f"{where}: KV page sharding is served for MLA only (as SGLang's)")
        if self.page_shards != self.tp_size:
            raise ValueError(f"{where}: the pages are sharded over the whole TP group, tp_size={self.tp_size}")
        if self.dcp_size > 1 or self.draft is not None:
            other = "DCP" if self.dcp_size > 1 else "draft KV"
            raise ValueError(f"{where} with {other} is not served")

    def _check_dcp(self) -> None:
        _positive_int("dcp_size", self.dcp_size)
        if self.dcp_size == 1:
            return
        if not self.mla:
            raise ValueError(f"dcp_size={self.dcp_size}: decode context parallel is served for MLA only (as SGLang's)")
        if self.tp_size % self.dcp_size:
            raise ValueError(f"dcp_size={self.dcp_size} must divide tp_size={self.tp_size} (a DCP group is "
                             f"consecutive TP ranks)")
        if self.draft is not None:
            raise ValueError(f"dcp_size={self.dcp_size} with draft KV is not served")

    def _check_draft(self) -> None:
        d = self.draft
        if not isinstance(d, DraftKV):
            raise ValueError(f"draft must be a DraftKV or None, got {d!r}")
        if self.pp_rank != self.pp_size - 1:
            raise ValueError(f"draft KV on PP stage {self.pp_rank} of {self.pp_size}: the draft model's entries "
                             f"belong to the last stage (SGLang runs the draft there); give DraftKV to the ranks "
                             f"of stage {self.pp_size - 1} only")
        heads = d.total_kv_heads if d.total_kv_heads is not None else self.total_kv_heads
        head_dim = d.head_dim if d.head_dim is not None else self.head_dim
        d = DraftKV(num_layers=d.num_layers, total_kv_heads=heads, head_dim=head_dim)
        object.__setattr__(self, "draft", d)
        if self.mla and heads != 1:
            raise ValueError(f"draft KV of {heads} heads beside an MLA target: an MLA draft has one latent head "
                             f"(DraftKV.total_kv_heads 1), of its own head_dim if it differs")
        if heads % self.tp_size and self.tp_size % heads:
            raise ValueError(f"draft KV of {heads} heads cannot be split over tp_size={self.tp_size}: its heads "
                             f"must divide by the TP size, or the TP size by them (replication)")

    # -- derived geometry ---------------------------------------------------------------
    @property
    def local_heads(self) -> int:
        return max(1, self.total_kv_heads // self.tp_size)

    @property
    def draft_entries(self) -> int:
        """Draft KV entries, of any geometry (0: no draft)."""
        return self.draft.num_layers if self.draft is not None else 0

    @property
    def draft_own_geometry(self) -> bool:
        """Whether the draft's head count or head_dim differs from the target's: its entries are
        then internal heads pools (draft_kv.py), not more layers."""
        d = self.draft
        return d is not None and (d.total_kv_heads, d.head_dim) != (self.total_kv_heads, self.head_dim)

    @property
    def draft_layers(self) -> int:
        """Draft KV entries moved as more layers: a draft of the target's geometry (0: none)."""
        return 0 if self.draft_own_geometry else self.draft_entries

    @property
    def draft_local_heads(self) -> int:
        """Draft heads this rank holds (split over TP like the target's, replicated below 1)."""
        heads = self.draft.total_kv_heads if self.draft is not None else None
        return max(1, (heads or self.total_kv_heads) // self.tp_size)

    @property
    def draft_token_shape(self) -> tuple[int, int]:
        """(draft heads on this rank, draft head_dim): one token of a draft entry's tensors (the
        target's when there is no draft)."""
        head_dim = self.draft.head_dim if self.draft is not None else None
        return self.draft_local_heads, head_dim or self.head_dim

    @property
    def num_entries(self) -> int:
        """KV entries of the whole cache: the model's layers, then the draft's."""
        return self.num_layers + self.draft_layers

    @property
    def layers(self) -> range:
        """The entries this rank holds and sends: its PP stage's layers (all of the model's
        without PP), then the draft's (on the last stage only with PP)."""
        assert self.stage is not None, "set by __post_init__"
        return range(self.stage.start, self.stage.stop + self.draft_layers)

    def local(self, layers: range) -> range:
        """Global `layers` of this rank's stage as indices into its buffers."""
        return range(layers.start - self.layers.start, layers.stop - self.layers.start)

    @property
    def rank(self) -> int:
        """This rank's index in its engine (pp_rank * tp_size + tp_rank): its identity to peers."""
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def ranks(self) -> int:
        """Ranks of the engine (tp_size * pp_size)."""
        return self.tp_size * self.pp_size

    @property
    def dcp_rank(self) -> int:
        """This rank's index in its DCP group: it holds the tokens t with t % dcp_size == dcp_rank."""
        return self.tp_rank % self.dcp_size

    def dcp(self) -> DCPLayout:
        """This rank's token-axis geometry (token_mapping.py)."""
        return DCPLayout(dcp_size=self.dcp_size, page_size=self.page_size, mla=self.mla)

    @property
    def replication(self) -> int:
        """How many consecutive ranks hold a copy of the same head (1: no replication)."""
        return max(1, self.tp_size // self.total_kv_heads)

    @property
    def first_head(self) -> int:
        """Global index of the first KV head this rank holds."""
        return self.tp_rank // self.replication * self.local_heads

    @property
    def has_v(self) -> bool:
        """Whether V is a tensor of its own (not for MLA, nor when fused with K)."""
        return not (self.mla or self.page_format.kv_fused)

    @property
    def num_kv(self) -> int:
        """Tensors per layer: 2 (K and V) or 1 (MLA latent, or K/V fused)."""
        return 2 if self.has_v else 1

    @property
    def elem_size(self) -> int:
        return self.dtype.itemsize

    @property
    def head_bytes(self) -> int:
        return self.head_dim * self.elem_size

    @property
    def token_bytes(self) -> int:
        """Bytes of one token of one layer's K (or V) on this rank."""
        return self.local_heads * self.head_bytes

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of one layer's K (or V) on this rank."""
        return self.page_size * self.token_bytes

    def heads_of(self, rank: int) -> range:
        """Global heads held by `rank` of this layout's TP group."""
        return range(rank // self.replication * self.local_heads,
                     rank // self.replication * self.local_heads + self.local_heads)

    def summary(self, pools: list[PoolSpec] | None = None) -> LayoutSummary:
        return LayoutSummary(
            dtype=dtype_name(self.dtype) or "", head_dim=self.head_dim, page_size=self.page_size,
            num_layers=self.num_layers, total_kv_heads=self.total_kv_heads, mla=self.mla, pools=pools or [],
            layout_format=self.page_format.value, draft_layers=self.draft_entries,
            draft_kv_heads=(self.draft.total_kv_heads or 0) if self.draft is not None else 0,
            draft_head_dim=(self.draft.head_dim or 0) if self.draft is not None else 0)


prebuild_struct_info(globals())  # last: every Struct above is defined (see kvstage.wire)
