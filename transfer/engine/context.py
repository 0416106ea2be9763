"""What a rank's control thread is built from, gathered once at start-up.

The control plane is split by job (peers, frame routing, rooms, the write queue, the prefill
and decode sides, liveness). Only the loop (loop.py, which builds the parts) takes this whole
bag: each part receives, in its constructor, the few things it uses, as the small Protocols of
interfaces.py (an Outbox, Counters, a WritePort...) and plain values (`me`, the Timeouts).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...staging.handler import StagingHandler
from ..config import ResolvedConfig, Timeouts
from ..kv_buffers import KVBuffers
from ..layout import KVLayout, LayoutSummary
from ..protocol.direct_ranges import CacheGeometry
from ..protocol.kinds import Role
from ..protocol.tags import TagCodec
from .backend_owner import BackendOwner
from .calibration import Calibration
from .control_socket import ControlSocket
from .integrity import Integrity
from .interfaces import Observer, Post
from .stats import Stats

FINISHED_MEMORY = 65536    # finished rooms and lost peers remembered, for late messages about them


class NoObserver:
    """The Observer (interfaces.py) without metrics: nothing."""

    def write_done(self, path: str, seconds: float) -> None:
        pass

    def request_done(self, path: str, seconds: float | None, writes: int, descriptors: int | None) -> None:
        pass


@dataclass(kw_only=True)
class EngineContext:
    cfg: ResolvedConfig
    layout: KVLayout
    buffers: KVBuffers
    me: int                       # this rank's incarnation
    backend: BackendOwner
    backend_name: str
    identity: bytes
    handler: StagingHandler
    stats: Stats
    sock: ControlSocket
    tags: TagCodec
    summary: LayoutSummary
    geometry: CacheGeometry
    post: Post                    # hand an event to the control thread (any thread may call it)
    integrity: Integrity          # digests (verify) and the corrupt_data fault
    observer: Observer            # histograms of writes and requests (metrics on), else NoObserver
    calibration: Calibration | None = None   # the path costs measured at start (None: not measured)

    @property
    def role(self) -> Role:
        return self.cfg.role

    @property
    def t(self) -> Timeouts:
        return self.cfg.timeouts


def local_geometry(layout: KVLayout, buffers: KVBuffers) -> CacheGeometry:
    device = (buffers.device.index or 0) if buffers.device.type == "cuda" else 0
    return CacheGeometry(tuple(t.data_ptr() for t in buffers.tensors()), layout.page_size, layout.token_bytes,
                         layout.head_bytes, device, num_kv=layout.num_kv)
