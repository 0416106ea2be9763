"""Memory a serving engine owns, handed over as raw addresses, seen as tensors without a copy.

Serving engines give a transfer backend their KV cache as per-layer addresses, byte lengths and
per-page item sizes (SGLang's KVArgs: kv_data_ptrs, kv_data_lens, kv_item_lens). kvstage works on
tensors; these views share the engine's memory and never free it: the engine keeps it alive for
as long as the KVManager runs. Host memory is wrapped through ctypes; device memory through the
CUDA array interface (no CuPy needed).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .layout import KVLayout


class _CudaArray:
    """The smallest object torch.as_tensor accepts for a raw device address."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


def tensor_at(ptr: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """A tensor of `dtype` and `shape` over `nbytes` at `ptr`, sharing that memory."""
    if device.type == "cpu":
        raw = torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=torch.uint8)
    elif device.type == "cuda":
        raw = torch.as_tensor(_CudaArray(ptr, nbytes), device=device)
    else:
        raise ValueError(f"raw pointers on {device.type} are not supported (cpu or cuda)")
    return raw.view(dtype).view(shape)


def check_pointers(layout: KVLayout, data_ptrs: Sequence[int], data_lens: Sequence[int],
                   item_lens: Sequence[int]) -> int:
    """Validate SGLang-style pointer lists against the layout; return the page count. Raises
    ValueError naming the first entry that is wrong."""
    target = len(layout.layers) - layout.draft_layers
    want = (target + layout.draft_entries) * layout.num_kv
    kinds = "K then V" if layout.num_kv == 2 else "K (MLA latent)"
    if layout.draft_entries:
        kinds += f", the target's {layout.num_layers} then the draft's {layout.draft_entries}"
    heads, head_dim = layout.draft_token_shape
    draft_page = layout.page_size * heads * head_dim * layout.elem_size
    for name, seq in (("data_ptrs", data_ptrs), ("data_lens", data_lens), ("item_lens", item_lens)):
        if not isinstance(seq, (list, tuple)) or len(seq) != want:
            raise ValueError(f"{name} must list {want} entries ({want // layout.num_kv} entries, {kinds}), got "
                             f"{len(seq) if isinstance(seq, (list, tuple)) else type(seq).__name__}")
        for i, x in enumerate(seq):
            if isinstance(x, bool) or not isinstance(x, int) or x <= 0:
                raise ValueError(f"{name}[{i}] must be a positive int, got {x!r}")
    pages = 0
    for i, (ptr, nbytes, item) in enumerate(zip(data_ptrs, data_lens, item_lens)):
        if i >= target * layout.num_kv and item != draft_page:
            raise ValueError(f"item_lens[{i}]={item}: one page of one draft entry is {draft_page} bytes on this rank "
                             f"(page_size {layout.page_size} x {layout.draft_local_heads} draft heads x head_dim)")
        if i < target * layout.num_kv and item != layout.page_bytes:
            raise ValueError(f"item_lens[{i}]={item}: one page of one layer is {layout.page_bytes} bytes on this "
                             f"rank (page_size {layout.page_size} x {layout.local_heads} heads x {layout.head_bytes} B)")
        if nbytes % item:
            raise ValueError(f"data_lens[{i}]={nbytes} is not a whole number of {item}-byte pages")
        if ptr % layout.elem_size:
            raise ValueError(f"data_ptrs[{i}]={ptr:#x} is not aligned to the {layout.elem_size}-byte dtype")
        if i == 0:
            pages = nbytes // item
        elif nbytes // item != pages:
            raise ValueError(f"data_lens[{i}] holds {nbytes // item} pages, data_lens[0] holds {pages}")
    return pages
