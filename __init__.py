"""kvstage: KV-cache transfer for disaggregated prefill/decode LLM serving.

    from kvstage import KVLayout, KVBuffers, EngineConfig, KVManager, KVSender, KVReceiver, KVPoll

The public names are loaded on first use (PEP 562), so ``python -m kvstage.bootstrap`` runs the
rendezvous server without importing torch or the data plane.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_PUBLIC = {
    "KVLayout": ".transfer.layout", "KVBuffers": ".transfer.kv_buffers", "DraftKV": ".transfer.draft_kv",
    "EngineConfig": ".transfer.config", "Timeouts": ".transfer.timeouts",
    "KVManager": ".transfer.engine.manager",
    "KVSender": ".transfer.engine.handles", "KVReceiver": ".transfer.engine.handles",
    "KVPoll": ".transfer.poll",
    "KVTransferError": ".transfer.outcome", "TransferMetrics": ".transfer.outcome",
    "StatePool": ".transfer.state_pools",
}

__all__ = list(_PUBLIC)

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from .transfer import (
        DraftKV,
        EngineConfig,
        KVBuffers,
        KVLayout,
        KVManager,
        KVPoll,
        KVReceiver,
        KVSender,
        KVTransferError,
        StatePool,
        Timeouts,
        TransferMetrics,
    )


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'kvstage' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
