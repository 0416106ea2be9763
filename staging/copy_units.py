"""The machine word a gather/scatter moves head rows in (torch path and Triton kernels alike).

torch's index kernels and the Triton kernels move one element at a time, so a head row
(``head_dim * elem_size`` bytes) is reinterpreted as the widest integer that divides it and that
every tensor involved is aligned to: any dtype (fp8 included) then moves bit-exactly, whole words
at a time (docs/staging_kernels.md, "8-byte units").
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

__all__ = ["UNITS", "Unit", "alignment", "unit_for"]


@dataclass(frozen=True)
class Unit:
    """An integer word: its size in bytes and the torch dtype that views memory as such words."""

    nbytes: int
    dtype: torch.dtype


#: widest first
UNITS = (Unit(8, torch.int64), Unit(4, torch.int32), Unit(2, torch.int16), Unit(1, torch.uint8))


def alignment(t: torch.Tensor) -> int:
    """The largest unit size (8/4/2/1 bytes) that both the storage offset and the address honour."""
    off = t.storage_offset() * t.element_size()
    ptr = t.data_ptr()
    for u in UNITS:
        if off % u.nbytes == 0 and ptr % u.nbytes == 0:
            return u.nbytes
    return 1


def unit_for(row_bytes: int, tensors: Iterable[torch.Tensor]) -> Unit:
    """The widest unit dividing `row_bytes` that every tensor in `tensors` is aligned to."""
    limit = min(alignment(t) for t in tensors)
    for u in UNITS:
        if u.nbytes <= limit and row_bytes % u.nbytes == 0:
            return u
    return UNITS[-1]
