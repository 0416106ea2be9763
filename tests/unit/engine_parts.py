"""The engine's control-thread parts built alone for unit tests (no sockets, no backend), each
given only what its constructor asks for (transfer/engine/interfaces.py): fakes stand in for the
socket, the backend and the staging handler where a test needs them, as keyword arguments."""

from types import SimpleNamespace

from kvstage.transfer.config import Timeouts
from kvstage.transfer.engine.peers import PeerTable
from kvstage.transfer.engine.prefill_side import PrefillRank, PrefillSide
from kvstage.transfer.engine.rooms import PrefillBook
from kvstage.transfer.engine.stats import Stats


class NoSubscriptions:
    """The staging handler of a rank without staging buffers (nothing to unsubscribe)."""

    buffers = ()
    buffer_bytes = 0

    def unsubscribe(self, peer):
        pass


class NoObserver:
    def write_done(self, path, seconds):
        pass

    def request_done(self, path, seconds, writes, descriptors):
        pass


def peer_table(*, me=1, sock=None, stats=None, staging=None, links=None, listeners=lambda: []):
    return PeerTable(me=me, sock=sock, stats=stats if stats is not None else Stats(),
                     staging=staging if staging is not None else NoSubscriptions(), links=links, listeners=listeners)


def prefill_rank(**overrides) -> PrefillRank:
    facts = dict(engine_id="pf", backend="nixl", backend_name="me", verify=False, staging=False, costs=None,
                 credits=False, piece_cap=0)
    return PrefillRank(**{**facts, **overrides})


def prefill_parts(*, me=1, stats=None, sock=None, layout=None, timeouts=None, summary=None, backend=None,
                  staging=None, writes=None, links=None, rank=None):
    """A prefill rank's peer table, room book and side, wired as loop.py wires them."""
    stats = stats if stats is not None else Stats()
    staging = staging if staging is not None else NoSubscriptions()
    peers = peer_table(me=me, sock=sock, stats=stats, staging=staging, links=links, listeners=lambda: [side])
    book = PrefillBook(outbox=peers, stats=stats, observer=NoObserver(), hooks=lambda: side, writes=lambda: writes)
    side = PrefillSide(me=me, rank=rank or prefill_rank(), layout=layout, timeouts=timeouts or Timeouts(),
                       summary=summary if summary is not None else SimpleNamespace(pools=[]), stats=stats, sock=sock,
                       backend=backend, staging=staging, peers=peers, book=book, writes=writes)
    return peers, book, side
