"""Decode side: where a receiver's KV comes from, and finding those prefill ranks.

Serving engines run one rendezvous server per prefill instance, and with data-parallel
attention an instance has one prefill engine per DP rank. A receiver names its prefill either by
engine id (at this rank's own rendezvous server, as before) or by the instance's rendezvous
address plus a DP rank. Clients of other servers are opened on first use, cached, and closed with
the manager; a server that cannot be reached fails the requests that name it, with the reason,
and nothing else.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ...bootstrap import BootstrapError, RankGone, RankRecord, Rendezvous, open_rendezvous
from ...bootstrap.rendezvous import check_address, rendezvous_key
from ..protocol.peering import DpEngine, DpMatch, engine_for_dp


@dataclass(frozen=True)
class PrefillSource:
    engine_id: str = ""       # "": the engine of `dp_rank` at `bootstrap`
    bootstrap: str = ""       # the prefill instance's rendezvous ("host:port" or etcd://); "": this rank's own
    dp_rank: int = 0

    @property
    def key(self) -> str:
        """One name per source: rooms from the same source share one lookup and one view."""
        if not self.bootstrap:
            return self.engine_id
        return f"{self.bootstrap}/{self.engine_id}" if self.engine_id else f"{self.bootstrap}#dp{self.dp_rank}"


def make_source(prefill_engine: str | None, bootstrap: str | None, dp_rank: int | None) -> PrefillSource:
    """Validate what a receiver names (in the caller's thread): ValueError saying what is wrong."""
    if prefill_engine is not None and (not isinstance(prefill_engine, str) or not prefill_engine):
        raise ValueError("prefill_engine must be a non-empty string")
    if bootstrap is not None:
        if not isinstance(bootstrap, str):
            raise ValueError(f"bootstrap must be 'host:port' or an etcd:// address, got {bootstrap!r}")
        check_address("bootstrap", bootstrap)  # raises ValueError naming the address
    if dp_rank is not None and (isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or dp_rank < 0):
        raise ValueError(f"prefill_dp_rank must be an int >= 0, got {dp_rank!r}")
    if prefill_engine is None and bootstrap is None:
        raise ValueError("name the prefill: prefill_engine, or bootstrap='host:port' (with prefill_dp_rank)")
    if prefill_engine is not None and dp_rank is not None:
        raise ValueError("give prefill_engine or prefill_dp_rank, not both")
    return PrefillSource(prefill_engine or "", bootstrap or "", dp_rank or 0)


class SourceResolver:
    """Lookups for the decode side's planner (called on its lookup threads)."""

    def __init__(self, own: Rendezvous, token: bytes | None, poll_s: float = 0.2,
                 on_gone: Callable[[RankGone], None] | None = None):
        self._own, self._token, self._poll_s = own, token, poll_s
        self._on_gone = on_gone   # told of looked-up ranks a rendezvous no longer holds (etcd's watch)
        self._clients: dict[str, Rendezvous] = {}
        if on_gone is not None and own is not None:
            own.on_gone(on_gone)
        self._lock = threading.Lock()
        self._closed = False

    def lookup(self, source: PrefillSource, timeout: float) -> list[RankRecord]:
        client = self._client(source.bootstrap)
        engine = source.engine_id or self._engine_of_dp(client, source, timeout)
        return client.lookup(engine, timeout_s=timeout)

    def _client(self, addr: str) -> Rendezvous:
        if not addr:
            return self._own
        endpoint = rendezvous_key(addr)
        with self._lock:
            if self._closed:
                raise BootstrapError("the KVManager is closing")
            client = self._clients.get(endpoint)
            if client is None:  # connects lazily: an unreachable server only fails its requests
                client = self._clients[endpoint] = open_rendezvous(addr, token=self._token)
                if self._on_gone is not None:
                    client.on_gone(self._on_gone)
            return client

    def _engine_of_dp(self, client: Rendezvous, source: PrefillSource, timeout: float) -> str:
        """Poll the server's status until one prefill engine serves the DP rank (or time is up)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                found = engine_for_dp(client.status()["ranks"], source.dp_rank)
            except BootstrapError as exc:
                if exc.permanent or time.monotonic() >= deadline:
                    raise BootstrapError(f"rendezvous server {source.bootstrap}: {exc}", exc.kind) from exc
                found = DpEngine(DpMatch.NONE, reason=str(exc))
            if found.match is DpMatch.FOUND:
                return found.engine_id
            if found.match is DpMatch.AMBIGUOUS or time.monotonic() >= deadline:
                raise BootstrapError(f"rendezvous server {source.bootstrap}: {found.reason}", "lookup")
            time.sleep(self._poll_s)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            c.close()
