"""A watch on a key prefix that survives the loss of the member serving it.

etcd3gw's own Watcher reads the gateway's stream on an executor thread and keeps to itself when
the stream ends or fails, so nobody can resume it elsewhere. This thread reads the same stream
(``POST /v3/watch``) itself: when it ends (the member died, or stayed silent past the read
timeout, which also bounds how long a partitioned member can hide events), it resumes on the
next member from the revision after the last one seen, so no event is lost; when the history
it needs was compacted away it asks its owner to resynchronise (`on_reset`). It blocks in the
socket read, and between failed attempts on an Event with a growing timeout.
"""

from __future__ import annotations

import base64
import json
import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

import requests
from etcd3gw import exceptions as etcd_exc

from .client import BootstrapError
from .etcd_members import API_PATH, Members
from .etcd_records import prefix_end

log = logging.getLogger("kvstage.bootstrap.etcd")


@dataclass(frozen=True)
class WatchEvent:
    kind: str            # "PUT" | "DELETE"
    key: str
    value: bytes
    revision: int        # the key's mod_revision (of the delete, for a DELETE)


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


class PrefixWatch:
    """Calls on_events(list[WatchEvent]) for every change under `prefix` from `start_revision`
    on; on_reset() -> revision when the history was compacted (resume from that revision + 1)."""

    def __init__(self, members: Members, prefix: str, start_revision: int,
                 on_events: Callable[[list[WatchEvent]], None], on_reset: Callable[[], int],
                 read_timeout_s: float = 15.0, connect_timeout_s: float = 2.0):
        self._members, self._prefix = members, prefix
        self._next = start_revision
        self._on_events, self._on_reset = on_events, on_reset
        self._timeouts = (connect_timeout_s, read_timeout_s)
        self._stop = threading.Event()
        self._resp: requests.Response | None = None
        self._lock = threading.Lock()
        self.connected = threading.Event()   # set while a stream is open (tests wait on it)
        self.thread = threading.Thread(target=self._run, name="kvstage-etcd-watch", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        with self._lock:
            resp = self._resp
        if resp is not None:
            _break(resp)
        if self.thread.ident is not None:
            self.thread.join(timeout_s)

    def _run(self) -> None:
        backoff = 0.05
        while not self._stop.is_set():
            for member in self._members.order():
                if self._stop.is_set():
                    return
                try:
                    if self._stream(member):
                        backoff = 0.05       # it ran: try again at once
                except (requests.RequestException, etcd_exc.Etcd3Exception, BootstrapError, ValueError) as exc:
                    log.debug("etcd watch on %s ended: %s", member.url, exc)
                except Exception:  # noqa: BLE001 - a bug here must not end the watch for good
                    if self._stop.is_set():
                        return   # stop() shut the stream under the reading thread: whatever it raised
                    log.exception("etcd watch on %s failed", member.url)
                finally:
                    self.connected.clear()
                    with self._lock:
                        self._resp = None
            if self._stop.wait(backoff):
                return
            backoff = min(backoff * 2, 2.0)

    def _stream(self, member) -> bool:
        """Read one member's stream until it ends; True when events or a clean start came."""
        body = {"create_request": {"key": _b64(self._prefix), "range_end": _b64(prefix_end(self._prefix)),
                                   "start_revision": self._next}}
        resp = member.session.post(member.url + API_PATH + "watch", json=body, stream=True, timeout=self._timeouts)
        with self._lock:
            self._resp = resp
        if self._stop.is_set():
            return False
        if resp.status_code != 200:
            raise BootstrapError(f"etcd watch refused by {member.url}: HTTP {resp.status_code} {resp.text[:200]}")
        started = False
        for line in resp.iter_lines(chunk_size=None):
            if not line.strip():
                continue
            msg = json.loads(line)
            if "error" in msg:
                raise BootstrapError(f"etcd watch on {member.url}: {msg['error']}")
            res = msg.get("result", {})
            if int(res.get("compact_revision", 0) or 0) > 0:
                log.warning("etcd watch: history compacted past revision %d; resynchronising", self._next)
                self._next = self._on_reset() + 1
                return True
            if res.get("canceled"):
                return started
            if res.get("created"):
                started = True
                self._members.answered(member)
                self.connected.set()
            events = [WatchEvent(e.get("type", "PUT"), base64.b64decode(e["kv"]["key"]).decode(),
                                 base64.b64decode(e["kv"].get("value", "")), int(e["kv"]["mod_revision"]))
                      for e in res.get("events", [])]
            if events:
                self._on_events(events)
                self._next = max(self._next, max(e.revision for e in events) + 1)
        return started


def _break(resp: requests.Response) -> None:
    """Wake the thread blocked reading this stream: shut its socket down."""
    try:
        sock = resp.raw.connection.sock
    except AttributeError:
        sock = None
    try:
        if sock is None:
            sock = socket.socket(fileno=resp.raw._fp.fileno())
            sock.shutdown(socket.SHUT_RDWR)
            sock.detach()
        else:
            sock.shutdown(socket.SHUT_RDWR)
    except (OSError, AttributeError, ValueError):
        pass
    try:
        resp.close()
    except Exception:  # noqa: BLE001 - closing a stream another thread reads may race it
        pass
