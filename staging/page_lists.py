"""The one validator of page lists: what `send()`/`init()` accept from the caller
(transfer/engine/handles.py) and what a gather or scatter accepts (staging/copy_plan.py, for
both staging/gather_scatter.py and staging/triton_kernels.py).

A page list is a 1-D list of indices into a rank's paged KV cache, in request order: an int
sequence, a numpy integer array or an integer torch tensor. Every failure is a ValueError that
starts with `what` (the call it came from) and names the bad value.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeAlias

import numpy as np
import torch

__all__ = ["PageList", "check_pages"]

#: what a caller may give as a page list (checked by `check_pages`)
PageList: TypeAlias = Sequence[int] | np.ndarray | torch.Tensor


def check_pages(pages: object, limit: int, what: str, *, unique: bool, host_only: bool = False,
                copy: bool = False) -> np.ndarray:
    """`pages` as a 1-D int64 numpy array, every index in [0, `limit`).

    `unique`: the pages are written to (a destination list), so a repeat is refused: the result
    would depend on copy order. `host_only`: refuse a tensor that is not on the CPU (the caller's
    thread must not wait on a device). `copy`: the result never shares memory with `pages`
    (it is kept after the call returns); otherwise it may.
    """
    if isinstance(pages, torch.Tensor):
        if host_only and pages.device.type != "cpu":
            raise ValueError(f"{what}: page indices must be a CPU tensor, got one on {pages.device}")
        if pages.dtype.is_floating_point or pages.dtype.is_complex or pages.dtype == torch.bool:
            raise ValueError(f"{what}: page indices must be integers, got {pages.dtype}")
        arr = pages.detach().to("cpu", torch.int64).numpy()
    else:
        arr = np.asarray(pages)
        if arr.size == 0:
            arr = arr.astype(np.int64)
        if arr.dtype.kind not in "iu":
            raise ValueError(f"{what}: page indices must be integers, got {arr.dtype}")
    arr = arr.astype(np.int64, copy=copy)
    if arr.ndim != 1:
        raise ValueError(f"{what}: page indices must be 1-D, got shape {tuple(arr.shape)}")
    if arr.size and (arr.min() < 0 or arr.max() >= limit):
        bad = int(arr[(arr < 0) | (arr >= limit)][0])
        raise ValueError(f"{what}: page index {bad} is out of range for a cache of {limit} pages")
    if unique and np.unique(arr).size != arr.size:
        s = np.sort(arr)
        raise ValueError(f"{what}: destination pages must be distinct (the list repeats page "
                         f"{int(s[1:][s[1:] == s[:-1]][0])})")
    return arr
