"""kvstage rendezvous: the bootstrap server (``python -m kvstage.bootstrap``) and the client ranks
use, or an etcd cluster (``etcd://`` addresses, bootstrap/etcd_client.py) behind the same interface.

Prefill and decode ranks register here and look up each other's ranks; see docs/bootstrap.md.
This package must not import torch: the server runs on machines without it.
"""

from .client import (
                     BootstrapAuthError,
                     BootstrapClient,
                     BootstrapError,
                     BootstrapTimeout,
                     RankInfo,
                     RankRecord,
                     new_incarnation,
)
from .rendezvous import BOOTSTRAP_ENV, RankGone, Rendezvous, open_rendezvous

__all__ = ["BootstrapClient", "RankInfo", "RankRecord", "BootstrapError", "BootstrapTimeout",
           "BootstrapAuthError", "new_incarnation", "Rendezvous", "RankGone", "open_rendezvous",
           "BOOTSTRAP_ENV"]
