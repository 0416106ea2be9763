"""Staging buffers: one contiguous, registrable area of host (DRAM) or device (VRAM) memory.

`StagingBuffer.host(nbytes)` is backed by `staging.host_memory.HostMemory` (page-aligned,
pre-faulted, optionally huge pages); `StagingBuffer.cuda(nbytes, device_index)` by one
``torch.empty(uint8)`` on that GPU. Nothing here touches CUDA unless `cuda()` is called.

Lifetime: deregister the buffer from every backend before `close()`. For a host buffer, `close()`
raises `BufferError` while views of it (e.g. from `region()`) are alive, instead of unmapping
memory still in use; for a device buffer `close()` drops the buffer's own reference and torch's
allocator keeps the memory until the last view is gone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .host_memory import HostMemory

if TYPE_CHECKING:  # staging stays importable on its own
    from ..transfer.backends.base import MemRegion

__all__ = ["StagingBuffer"]


class StagingBuffer:
    """One staging area. Attributes: `tensor` (torch.uint8, 1-D), `addr`, `nbytes`, `kind`
    ("DRAM" or "VRAM"), `device` (0 for host, the CUDA index for VRAM)."""

    def __init__(self, tensor: torch.Tensor, kind: str, device: int, owner: HostMemory | None = None) -> None:
        if kind not in ("DRAM", "VRAM"):
            raise ValueError(f"kind must be 'DRAM' or 'VRAM', got {kind!r}")
        if tensor.dtype != torch.uint8 or tensor.dim() != 1 or not tensor.is_contiguous():
            raise ValueError("tensor must be a contiguous 1-D torch.uint8 tensor")
        self._tensor: torch.Tensor | None = tensor
        self._owner = owner
        self.kind = kind
        self.device = int(device)
        self.addr = tensor.data_ptr()
        self.nbytes = tensor.numel()

    @classmethod
    def host(cls, nbytes: int, *, hugepage_size: str | None = None) -> StagingBuffer:
        """A host buffer of at least `nbytes` (rounded up to the page size; see HostMemory)."""
        mem = HostMemory(nbytes, hugepage_size=hugepage_size)
        return cls(mem.tensor, "DRAM", 0, owner=mem)

    @classmethod
    def cuda(cls, nbytes: int, device_index: int) -> StagingBuffer:
        """A device buffer of exactly `nbytes` on cuda:`device_index` (uninitialised)."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"nbytes must be a positive int, got {nbytes!r}")
        if isinstance(device_index, bool) or not isinstance(device_index, int) or device_index < 0:
            raise ValueError(f"device_index must be a non-negative int, got {device_index!r}")
        t = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{device_index}")
        return cls(t, "VRAM", device_index)

    @property
    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            raise ValueError("StagingBuffer is closed")
        return self._tensor

    @property
    def closed(self) -> bool:
        return self._tensor is None

    def region(self, offset: int, nbytes: int) -> torch.Tensor:
        """A uint8 view of bytes [offset, offset + nbytes) of this buffer (bounds-checked)."""
        for name, val in (("offset", offset), ("nbytes", nbytes)):
            if isinstance(val, bool) or not isinstance(val, int):
                raise TypeError(f"{name} must be an int, got {type(val).__name__}")
            if val < 0:
                raise ValueError(f"{name} must be >= 0, got {val}")
        if offset + nbytes > self.nbytes:
            raise ValueError(
                f"region [offset={offset}, offset+nbytes={offset + nbytes}) exceeds the buffer "
                f"of {self.nbytes} bytes"
            )
        return self.tensor[offset: offset + nbytes]

    def mem_region(self) -> MemRegion:
        """This buffer as a `transfer.backends.base.MemRegion` to register with a backend."""
        from ..transfer.backends.base import MemRegion  # lazy: keeps staging importable on its own

        if self.closed:
            raise ValueError("StagingBuffer is closed")
        return MemRegion(addr=self.addr, length=self.nbytes, device=self.device, kind=self.kind)

    def close(self) -> None:
        """Release the memory; idempotent. A host buffer raises BufferError while views live."""
        if self._tensor is None:
            return
        if self._owner is not None:
            self._tensor = None  # our own reference must not count as a live view
            try:
                self._owner.close()
            except BufferError:
                self._tensor = self._owner.tensor
                raise
            self._owner = None
        else:
            self._tensor = None

    def __enter__(self) -> StagingBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"addr={self.addr:#x}"
        return f"StagingBuffer({self.kind}, device={self.device}, nbytes={self.nbytes}, {state})"
