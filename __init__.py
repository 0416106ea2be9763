"""kvstage: KV-cache transfer for disaggregated prefill/decode LLM serving.

    from kvstage import KVLayout, KVBuffers, EngineConfig, KVManager, KVSender, KVReceiver, KVPoll

The public names are loaded on first use (PEP 562), so ``python -m kvstage.bootstrap`` runs the
rendezvous server without importing torch or the data plane.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

# the public names and their loading on first use are kvstage.transfer's (transfer/__init__.py),
# which imports nothing heavy itself
from .transfer import __all__, __getattr__  # noqa: F401 - the module's own attribute hooks

__version__ = "0.1.0"

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

