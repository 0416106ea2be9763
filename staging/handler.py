"""THE staging handler: one rank's staging memory, its registration, and its watermark state.

Both backends go through it. A backend supplies only `register` and `deregister` callbacks
(and its way of writing with a tag, used by the engine); the handler allocates the prefill
workers' buffers or the decode ring, registers them on entry and deregisters them on exit,
also when anything fails half-way, so nothing is ever left registered or leaked.

Prefill side: one buffer per transfer worker (a buffer is never shared between workers),
and the last watermark each decode peer published. Decode side: the ring, its allocator
(the epoch is the rank's incarnation) and the region views scatter reads from.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ..transfer.protocol.kinds import Role
from ..transfer.protocol.ring import RemoteWatermark, RingAllocator, Watermark
from .buffers import StagingBuffer

if TYPE_CHECKING:  # staging stays importable without the transfer package
    from ..transfer.backends.base import MemRegion, Registration

log = logging.getLogger(__name__)

RING_ALIGN = 256  # region starts stay aligned for wide copies


class StagingHandler:
    def __init__(self, role: str, register: Callable[[list[MemRegion]], Registration],
                 deregister: Callable[[Registration], None], *, epoch: int, device: torch.device,
                 workers: int = 0, buffer_bytes: int = 0, ring_bytes: int = 0):
        if role not in tuple(Role):
            raise ValueError(f"role must be prefill or decode, got {role!r}")
        self.role = role
        self.epoch = epoch
        self.device = device
        self._register, self._deregister = register, deregister
        self._want_workers, self._want_buffer = workers, buffer_bytes
        self._want_ring = ring_bytes // RING_ALIGN * RING_ALIGN
        self.buffers: list[StagingBuffer] = []
        self.ring: StagingBuffer | None = None
        self.allocator: RingAllocator | None = None
        self._remote: dict[int, RemoteWatermark] = {}
        self._stack: contextlib.ExitStack | None = None

    # -- life cycle -------------------------------------------------------------------------------
    def open(self) -> StagingHandler:
        """Allocate and register; on any error everything done so far is undone."""
        if self._stack is not None:
            return self
        try:
            self._allocate_and_register()
        except BaseException:
            self.buffers, self.ring, self.allocator = [], None, None
            raise
        return self

    def _allocate_and_register(self) -> None:
        with contextlib.ExitStack() as stack:
            if self.role == Role.PREFILL:
                for _ in range(self._want_workers):
                    buf = self._allocate(self._want_buffer)
                    stack.callback(buf.close)
                    self.buffers.append(buf)
            elif self._want_ring:
                self.ring = self._allocate(self._want_ring)
                stack.callback(self.ring.close)
                self.allocator = RingAllocator(self.ring.nbytes, RING_ALIGN)
            mine = ([b.mem_region() for b in self.buffers]
                    + ([self.ring.mem_region()] if self.ring is not None else []))
            if mine:
                reg = self._register(mine)
                stack.callback(self._deregister, reg)
            self._stack = stack.pop_all()

    def close(self) -> None:
        """Deregister, then free (idempotent)."""
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()
        self.buffers = []
        self.ring = None
        self.allocator = None

    def __enter__(self) -> StagingHandler:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _allocate(self, nbytes: int) -> StagingBuffer:
        if nbytes <= 0:
            raise ValueError("staging memory must have a positive size")
        if self.device.type == "cuda":
            # "cuda" without an index means the current device, as for torch tensors (not 0)
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            return StagingBuffer.cuda(nbytes, index)
        return StagingBuffer.host(nbytes)

    # -- prefill: decode peers' watermarks ----------------------------------------------------------
    @property
    def buffer_bytes(self) -> int:
        return min((b.nbytes for b in self.buffers), default=0)

    def subscribe(self, peer: int, epoch: int, ring_size: int) -> None:
        """Start tracking the ring of a decode peer (by its incarnation)."""
        self._remote[peer] = RemoteWatermark(epoch, ring_size)

    def unsubscribe(self, peer: int) -> None:
        self._remote.pop(peer, None)

    def on_watermark(self, peer: int, epoch: int, wm: Watermark) -> bool:
        """Apply a published watermark; True when it advanced (waiting writes may proceed)."""
        view = self._remote.get(peer)
        return view is not None and view.update(epoch, wm)

    def region_free(self, peer: int, start: int, nbytes: int) -> bool:
        view = self._remote.get(peer)
        return view is not None and view.allows(start, nbytes)

    # -- decode: the ring -------------------------------------------------------------------------
    def ring_view(self, offset: int, nbytes: int) -> torch.Tensor:
        if self.ring is None:
            raise ValueError("StagingHandler has no ring (closed, or a handler without one)")
        return self.ring.region(offset, nbytes)
