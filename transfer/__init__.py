"""kvstage's data plane and public API.

    from kvstage import KVLayout, KVBuffers, DraftKV, EngineConfig, KVManager, KVSender, KVReceiver, KVPoll

The public names are loaded on first use (PEP 562); the package root uses this module's hooks
(``kvstage.KVManager`` is this module's). Importing a pure
part (``kvstage.transfer.protocol``, the geometry) loads neither the engine nor the staging
data plane, and the staging modules may use the protocol's names without an import cycle.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_PUBLIC = {
    "KVLayout": ".layout", "KVBuffers": ".kv_buffers", "DraftKV": ".draft_kv",
    "EngineConfig": ".config", "Timeouts": ".timeouts",
    "KVManager": ".engine.manager", "KVSender": ".engine.handles", "KVReceiver": ".engine.handles",
    "KVPoll": ".poll", "KVTransferError": ".outcome", "TransferMetrics": ".outcome", "StatePool": ".state_pools",
}

__all__ = list(_PUBLIC)

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from .config import EngineConfig
    from .draft_kv import DraftKV
    from .engine.handles import KVReceiver, KVSender
    from .engine.manager import KVManager
    from .kv_buffers import KVBuffers
    from .layout import KVLayout
    from .outcome import KVTransferError, TransferMetrics
    from .poll import KVPoll
    from .state_pools import StatePool
    from .timeouts import Timeouts


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"kvstage has no public name {name!r} (it has {', '.join(__all__)})")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
