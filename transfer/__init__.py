"""kvstage's data plane and public API.

    from kvstage import KVLayout, KVBuffers, DraftKV, EngineConfig, KVManager, KVSender, KVReceiver, KVPoll
"""

from .config import EngineConfig, Timeouts
from .draft_kv import DraftKV
from .engine.handles import KVReceiver, KVSender
from .engine.manager import KVManager
from .layout import KVBuffers, KVLayout
from .outcome import KVTransferError, TransferMetrics
from .poll import KVPoll
from .state_pools import StatePool

__all__ = ["KVLayout", "KVBuffers", "DraftKV", "EngineConfig", "Timeouts", "KVManager", "KVSender", "KVReceiver", "KVPoll",
           "KVTransferError", "TransferMetrics", "StatePool"]
