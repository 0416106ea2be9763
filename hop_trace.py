"""A critical-path trace of requests: every hop of a request between threads and processes,
with its time (docs/trace.md).

Off unless the environment names a directory: `KVSTAGE_TRACE=/some/dir`. Then every process
that imports kvstage records, into a bounded list in memory, one `HopRecord` per hop: when
(`time.monotonic_ns()`), which process (`name_process`) and thread, what kind of hop, the room
and a short detail. `dump()` (called by `KVManager.close()`, and at process exit) writes them as
msgspec JSON lines to `<dir>/<process>-<pid>.jsonl`: a `TraceHeader` line, then one line per
hop. examples/trace_request.py merges the files of several processes into one timeline.

Off, a call site costs one attribute read: each is `if TRACE.on: TRACE.hop(...)`, so not even
its detail string is built.

Clocks: `time.monotonic_ns()` reads CLOCK_MONOTONIC, one clock for every process of a Linux
host, so the records of ranks on one machine merge as they are. Ranks on several hosts would
need each pair's offset estimated from a message's send and receive (the two one-way times of a
round trip, as NTP does); that is not built.

This module imports nothing of kvstage: the staging threads (staging/) and the control plane
(transfer/) both record into it, and staging stays importable on its own.
"""

from __future__ import annotations

import atexit
import enum
import os
import threading
import time
from pathlib import Path

import msgspec

ENV = "KVSTAGE_TRACE"
MAX_ENV = "KVSTAGE_TRACE_MAX"      # records kept per process (default 200,000); later ones are counted
DEFAULT_MAX = 200_000


class Hop(str, enum.Enum):
    """What happened. A hand-off is a pair: something queued (or sent) by one thread and taken
    (or received) by another; `WAKES` are the hops where a thread took what another handed it."""

    HANDLE_CALL = "handle_call"      # the caller's thread entered init()/send() (detail: which)
    EVENT_QUEUED = "event_queued"    # put on a thread's queue (detail: "<queue> <type>")
    EVENT_TAKEN = "event_taken"      # taken off it by its thread (same detail)
    SOCKET_SEND = "socket_send"      # a control message sent (detail: its type)
    SOCKET_RECV = "socket_recv"      # a control message received and decoded (detail: its type)
    BACKEND_POST = "backend_post"    # the writer's backend takes a write (detail: the peer)
    BACKEND_DONE = "backend_done"    # the writer's backend reports it complete (detail: ok or why not)
    BACKEND_TAG = "backend_tag"      # the target reads the write's notification (detail: chunk/piece)
    GATHER_START = "gather_start"    # a transfer worker starts gathering a piece into its buffer
    GATHER_END = "gather_end"
    SCATTER_START = "scatter_start"  # the scatter thread starts copying a landed piece into the cache
    SCATTER_END = "scatter_end"
    WAITER_WOKEN = "waiter_woken"    # a thread blocked on an outcome woke up (detail: what it waited for)
    STATUS = "status"                # the control thread published a room's state (detail: the state)


# the hops where a thread takes what another thread or process handed it: each is a wake-up
WAKES = frozenset({Hop.EVENT_TAKEN, Hop.SOCKET_RECV, Hop.BACKEND_TAG, Hop.WAITER_WOKEN})


class HopRecord(msgspec.Struct, frozen=True):
    t_ns: int                 # time.monotonic_ns()
    process: str              # name_process(), e.g. "prefill0"
    thread: str               # threading.current_thread().name
    kind: Hop
    room: int | None
    detail: str = ""


class TraceHeader(msgspec.Struct, frozen=True):
    process: str
    pid: int
    clock: str                # "CLOCK_MONOTONIC"
    records: int
    dropped: int              # records past the bound, not kept


class HopRecorder:
    """Process-wide; any thread records. `on` is read at every call site: False, nothing runs."""

    def __init__(self, out_dir: str | None = None, limit: int = DEFAULT_MAX):
        self.on = bool(out_dir)
        self.out_dir = out_dir
        self.limit = limit
        self.process = f"pid{os.getpid()}"
        self.dropped = 0
        self._records: list[tuple[int, str, str, Hop, int | None, str]] = []
        self._lock = threading.Lock()   # dump() against name_process(); appends need none (list.append)

    @classmethod
    def from_env(cls) -> HopRecorder:
        out = os.environ.get(ENV) or None
        try:
            limit = int(os.environ.get(MAX_ENV, DEFAULT_MAX))
        except ValueError:
            raise ValueError(f"{MAX_ENV} must be an int, got {os.environ.get(MAX_ENV)!r}") from None
        return cls(out, limit)

    def name_process(self, name: str) -> None:
        """The process's name in the records (the first manager's role and rank). Records made
        before keep the name they were made with."""
        if self.on:
            with self._lock:
                if self.process.startswith("pid"):
                    self.process = name

    def hop(self, kind: Hop, room: int | None, detail: str = "") -> None:
        if not self.on:
            return
        if len(self._records) >= self.limit:
            self.dropped += 1
            return
        self._records.append((time.monotonic_ns(), self.process, threading.current_thread().name, kind,
                              room if isinstance(room, int) else None, detail))

    def records(self) -> list[HopRecord]:
        return [HopRecord(*r) for r in list(self._records)]

    def clear(self) -> None:
        self._records.clear()
        self.dropped = 0

    def dump(self, path: str | None = None) -> str | None:
        """Write every record so far (the file is rewritten each time); returns its path, None
        when off or nothing was recorded."""
        if not self.on or not self._records:
            return None
        with self._lock:
            recs = self.records()
            target = Path(path or os.path.join(self.out_dir or ".", f"{self.process}-{os.getpid()}.jsonl"))
            target.parent.mkdir(parents=True, exist_ok=True)
            enc = msgspec.json.Encoder()
            head = TraceHeader(process=self.process, pid=os.getpid(), clock="CLOCK_MONOTONIC", records=len(recs),
                               dropped=self.dropped)
            tmp = target.with_suffix(".tmp")
            with open(tmp, "wb") as f:
                f.write(enc.encode(head) + b"\n")
                for r in recs:
                    f.write(enc.encode(r) + b"\n")
            os.replace(tmp, target)
            return str(target)


def load(path: str | os.PathLike) -> tuple[TraceHeader, list[HopRecord]]:
    """One process's trace file."""
    lines = Path(path).read_bytes().splitlines()
    head = msgspec.json.decode(lines[0], type=TraceHeader)
    rec = msgspec.json.Decoder(HopRecord)
    return head, [rec.decode(line) for line in lines[1:] if line.strip()]


# the Structs' decoding info built at import, as kvstage.wire.prebuild_struct_info does for the
# messages (two threads building it at once can crash msgspec 0.22; this module imports no kvstage)
for _t in (HopRecord, TraceHeader):
    msgspec.json.Decoder(_t)

TRACE = HopRecorder.from_env()
if TRACE.on:
    atexit.register(TRACE.dump)
