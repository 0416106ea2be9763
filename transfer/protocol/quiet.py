"""When the control thread may sleep, and for how long: the pure half of a quiet engine.

kvstage runs inside the serving engine's scheduler process, where every wake-up of one of its
threads takes the GIL and a core from the scheduler. So a rank polls its backend only while a
write is known to be in flight towards or from it:

- a prefill rank while it has writes posted or queued (NIXL sends a write's notification only
  once the writer sees it complete, so the writer must look); a backend that says when a write
  completes (Mooncake: its submit thread wakes the loop) needs no polling for its posted writes;
- a decode rank while writes were announced to it (`WritePosted`, sent by the writer just
  before the backend takes the write) and their tags are not in yet.

Otherwise the thread blocks until a message, an event or the next tick. Tags that land without
an announcement (the message was lost) are still read by the backend step that runs on every
tick: a missed wake-up costs at most one tick, and is counted (`tags_by_arrival`, unannounced).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

MIN_EAGER_WAIT = 20e-6     # polling interval right after progress while a write is in flight,
MAX_EAGER_WAIT = 200e-6    # doubling up to this while nothing happens
DRAIN_WAIT = 0.01          # writes given up on: only their memory's release is awaited, no latency


class Activity(enum.Enum):
    """What the rank is waiting for, from the most to the least urgent."""

    WRITES = "writes"          # own writes posted or queued: poll their handles
    EXPECTED = "expected"      # writes announced towards this rank: poll for their tags
    DRAINING = "draining"      # given-up writes the library may still touch: poll now and then
    QUIET = "quiet"            # nothing due: block until a message, an event or the tick


@dataclass(frozen=True, kw_only=True)
class InFlight:
    writes: int = 0            # posted and not complete, plus queued for posting
    expected: int = 0          # announced towards this rank, tag not in
    draining: int = 0
    postable: int = 0          # of the queued: those whose peer has no write in flight (posted next round)
    signalled: int = 0         # posted, on a backend that wakes the loop when they complete: not polled


def activity(f: InFlight) -> Activity:
    if f.writes:
        return Activity.WRITES
    if f.expected:
        return Activity.EXPECTED
    if f.draining:
        return Activity.DRAINING
    return Activity.QUIET


def next_wait(act: Activity, *, last: float, progressed: bool, now: float, next_tick: float,
              postable: bool = False) -> float:
    """Seconds to block before the next backend step. `last` is the previous wait, `progressed`
    whether the last round did anything (then the next poll comes soon again), `postable`
    whether a queued write can be posted now: then none (a write queued by a completion the
    round's step found is posted by the next round at once, not after a timer's sleep: a
    sleep of 20 µs takes about 70 µs on Linux, timer slack included)."""
    until_tick = max(0.0, next_tick - now)
    if postable:
        return 0.0
    if act is Activity.QUIET:
        return until_tick
    if act is Activity.DRAINING:
        return min(DRAIN_WAIT, until_tick)
    wait = MIN_EAGER_WAIT if progressed else min(max(last, MIN_EAGER_WAIT) * 2, MAX_EAGER_WAIT)
    return min(wait, until_tick)


class Arrival(enum.Enum):
    EXPECTED = "expected"          # announced before it landed
    UNANNOUNCED = "unannounced"    # no announcement (yet): found by a tick's step, or the message lost
    REPEATED = "repeated"          # the same write's tag again


class Announcement(enum.Enum):
    ACCEPTED = "accepted"          # before its tag: the write is now outstanding
    AFTER_TAG = "after_tag"        # its tag was read first (by a tick's or another write's step)
    REPEATED = "repeated"          # the same write announced again


class ExpectedWrites:
    """Decode side: the writes announced towards this rank whose tags are not in, per room.

    A write is named by (writer incarnation, chunk, piece, group). Announcements are idempotent and may
    come before or after their tag (the message and the notification travel separately)."""

    def __init__(self) -> None:
        self._announced: dict[int, set[tuple[int, ...]]] = {}
        self._landed: dict[int, set[tuple[int, ...]]] = {}
        self._outstanding = 0

    @property
    def outstanding(self) -> int:
        return self._outstanding

    def rooms(self) -> int:
        return len(self._announced.keys() | self._landed.keys())

    def announce(self, room: int, write: tuple[int, ...]) -> Announcement:
        """ACCEPTED when this makes the write outstanding (its tag will then land as EXPECTED)."""
        if write in self._landed.get(room, ()):
            return Announcement.AFTER_TAG
        if write in self._announced.get(room, ()):
            return Announcement.REPEATED
        self._announced.setdefault(room, set()).add(write)
        self._outstanding += 1
        return Announcement.ACCEPTED

    def landed(self, room: int, write: tuple[int, ...]) -> Arrival:
        landed = self._landed.setdefault(room, set())
        if write in landed:
            return Arrival.REPEATED
        landed.add(write)
        announced = self._announced.get(room)
        if announced is not None and write in announced:
            announced.discard(write)
            self._outstanding -= 1
            return Arrival.EXPECTED
        return Arrival.UNANNOUNCED

    def forget(self, room: int) -> None:
        """The room stopped waiting for writes (succeeded, failed or released)."""
        self._outstanding -= len(self._announced.pop(room, ()))
        self._landed.pop(room, None)
