"""What two ranks agree on about their state pools before any byte moves (`PoolSpec`: a pool's
sharding, dtypes and item shapes, as names and numbers), and a request's pool items checked
against them. Pure: no tensors (the tensors are state_pools.py's `StatePool`), so the protocol
(transfer/protocol/) reads pools without importing torch. What pools are: state_pools.py.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Protocol

import msgspec
import numpy as np

from ..wire import prebuild_struct_info

SHARDINGS = ("heads", "replicated")
#: Pool names kvstage keeps for a draft KV of its own geometry (draft_kv.py): the engine names
#: their items, a caller cannot.
DRAFT_POOL_PREFIX = "kvstage.draft."
#: Bytes of one element of each torch dtype, by the name a PoolSpec carries (torch's, without
#: "torch."); sub-byte and packed dtypes take one byte per element, as torch stores them.
DTYPE_BYTES = {
    "bool": 1, "uint8": 1, "int8": 1, "uint16": 2, "int16": 2, "uint32": 4, "int32": 4, "uint64": 8, "int64": 8,
    "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "complex32": 4, "complex64": 8, "complex128": 16,
    "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1, "bits8": 1, "bits16": 2, "bits1x8": 1, "bits2x4": 1, "bits4x2": 1,
    "qint8": 1, "quint8": 1, "qint32": 4, "quint4x2": 1, "quint2x4": 1,
    **{f"int{n}": 1 for n in range(1, 8)}, **{f"uint{n}": 1 for n in range(1, 8)},
}


def dtype_bytes(name: str) -> int:
    """Bytes of one element of the torch dtype `name` (ValueError for a name torch does not have)."""
    try:
        return DTYPE_BYTES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r} (torch's dtype names: {', '.join(sorted(DTYPE_BYTES))})") from None


class PoolSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What both sides must agree on for one pool (TP sizes may differ): per tensor, its dtype
    and the shape of one item past the head dimension (heads) or of the whole item (replicated).
    `layer` binds the pool to one model layer (a hybrid model's per-layer state): only ranks
    whose PP stage holds that layer register it, and it moves between the stages that hold it;
    -1: the request's pool, written with the model's last layer."""

    name: str
    sharding: str
    heads: int                  # global heads of a heads pool; 0 when replicated
    dtypes: list[str]
    rows: list[list[int]]
    blocks: list[int] = []      # global sizes of a heads pool's sub-blocks; [] means one block of `heads`
    layer: int = -1             # the model layer the pool belongs to; -1: none

    def held_by(self, layers: range) -> bool:
        """Whether a rank whose stage holds `layers` has this pool (every rank: a pool of no layer)."""
        return self.layer < 0 or self.layer in layers

    def head_blocks(self) -> list[int]:
        """The global sizes of the sub-blocks each rank holds its share of (one for most pools)."""
        return list(self.blocks) or [self.heads]

    def row_bytes(self, tensor: int) -> int:
        """Bytes of one head of one item (heads) or of one item (replicated) of a tensor."""
        return math.prod(self.rows[tensor]) * dtype_bytes(self.dtypes[tensor])


def pool_mismatches(mine: Sequence[PoolSpec], theirs: Sequence[PoolSpec], shared: range | None = None) -> list[str]:
    """Readable differences between two ranks' pools; empty when they can exchange items.
    `shared`: the model layers both ranks' PP stages hold (None: every layer); a pool of a layer
    outside them is registered on one side only, as it should be."""
    a, b = {p.name: p for p in mine}, {p.name: p for p in theirs}
    both = shared if shared is not None else range(0, 1 << 30)
    out = [f"pool {n!r}: registered here only" for n in sorted(set(a) - set(b)) if a[n].held_by(both)]
    out += [f"pool {n!r}: registered at the peer only" for n in sorted(set(b) - set(a)) if b[n].held_by(both)]
    for n in sorted(set(a) & set(b)):
        for field in PoolSpec.__struct_fields__[1:]:
            if getattr(a[n], field) != getattr(b[n], field):
                out.append(f"pool {n!r} {field}: {getattr(a[n], field)!r} here vs {getattr(b[n], field)!r} at peer")
    return out


class CountsItems(Protocol):
    """A registered pool as the item checks see it (`state_pools.StatePool`)."""

    @property
    def num_items(self) -> int: ...


def check_items(name: str, items: object, pools: Mapping[str, CountsItems], side: str) -> np.ndarray:
    """One pool's item indices of a request, as int64; ValueError on bad input."""
    if isinstance(name, str) and name.startswith(DRAFT_POOL_PREFIX):
        raise ValueError(f"{side}: pool {name!r} is the draft KV's own: kvstage names its items from the pages sent")
    if name not in pools:
        raise ValueError(f"{side}: unknown pool {name!r} (registered: "
                         f"{sorted(n for n in pools if not n.startswith(DRAFT_POOL_PREFIX)) or 'none'})")
    arr = np.asarray(items)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(f"{side}: items of pool {name!r} must be a 1-D list of ints, got {items!r}")
    arr = arr.astype(np.int64)
    n = pools[name].num_items
    if arr.size and (arr.min() < 0 or arr.max() >= n):
        raise ValueError(f"{side}: an item of pool {name!r} is outside [0, {n}): {arr.tolist()}")
    if np.unique(arr).size != arr.size:
        raise ValueError(f"{side}: pool {name!r} names an item twice: {arr.tolist()}")
    return arr


def check_pool_items(pool_items: object, pools: Mapping[str, CountsItems], side: str) -> dict[str, np.ndarray]:
    """A request's {pool name: item indices}, validated against this rank's pools."""
    if pool_items is None:
        return {}
    if not isinstance(pool_items, dict):
        raise ValueError(f"{side}: pool_items must be a dict {{pool name: [items]}}, got {pool_items!r}")
    return {name: check_items(name, items, pools, side) for name, items in sorted(pool_items.items())}


prebuild_struct_info(globals())  # last: every Struct above is defined (see kvstage.wire)
