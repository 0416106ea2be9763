"""Deliberate misbehaviour around a real backend and the control plane, for tests and drills.

`FaultyBackend` wraps a real NIXL or Mooncake backend: the bytes still move for real, but the
notifications that arrive can be dropped, duplicated, reordered, delayed or corrupted, chosen
writes can be reported failed, and the tags of chosen rooms can be rewritten so they disagree
with their ring allocation. `ControlFaults` does the same to control-plane messages. Enable
through `EngineConfig.faults` (a dict; see docs/operations.md); never in production.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np

from .base import ArrivedTag, Backend, MemRegion, Registration, WriteHandle, WriteState


@dataclass(kw_only=True)
class FaultPlan:
    drop_tags: float = 0.0          # probability an arrived notification is lost
    drop_every_tag: int = 0         # every Nth arrived notification is lost (1: all of them)
    dup_tags: float = 0.0           # probability it is delivered twice
    reorder_tags: float = 0.0       # probability it is held back and delivered later, shuffled
    corrupt_tags: float = 0.0       # probability a byte of it is flipped
    fail_writes: float = 0.0        # probability a completed write is reported failed
    corrupt_rooms: list[int] = field(default_factory=list)  # rooms whose tags lie about their ring offset
    corrupt_data: float = 0.0       # receiving rank: probability a landed write gets a byte flipped
    hold_write_rooms: list[int] = field(default_factory=list)  # rooms whose writes stay in flight ...
    hold_write_s: float = 0.0       # ... this long before they reach the backend (then they land)
    drop_msgs: float = 0.0          # control plane: probability a message is not sent
    dup_msgs: float = 0.0           # ... sent twice
    reorder_msgs: float = 0.0       # ... held back and sent later
    corrupt_msgs: float = 0.0       # ... a byte flipped
    drop_msg_types: list[str] = field(default_factory=list)  # control plane: message types never sent ("WritePosted")
    hold_s: float = 0.05            # how long held items wait at most
    seed: int = 0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FaultPlan:
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown fault settings: {sorted(unknown)}")
        return cls(**d)


T = TypeVar("T")


class _Holder(Generic[T]):
    """Items held back for a random while, released shuffled."""

    def __init__(self, rng: random.Random, hold_s: float) -> None:
        self.rng, self.hold_s = rng, hold_s
        self.items: list[tuple[float, T]] = []

    def hold(self, item: T) -> None:
        self.items.append((time.monotonic() + self.rng.uniform(0, self.hold_s), item))

    def due(self, force: bool = False) -> list[T]:
        now = time.monotonic()
        ready = [x for x in self.items if force or x[0] <= now]
        self.items = [x for x in self.items if not (force or x[0] <= now)]
        self.rng.shuffle(ready)
        return [item for _, item in ready]


def _flip(rng: random.Random, data: bytes) -> bytes:
    if not data:
        return data
    b = bytearray(data)
    i = rng.randrange(len(b))
    b[i] ^= 1 << rng.randrange(8)
    return bytes(b)


class FaultyBackend(Backend):
    def __init__(self, inner: Backend, plan: FaultPlan, retag: Callable[[bytes], bytes | None] | None = None,
                 room_of: Callable[[bytes], int] | None = None) -> None:
        """`retag(tag) -> tag` rewrites a tag of a room in plan.corrupt_rooms (None: leave it);
        `room_of(tag)` names the room of a write (for plan.hold_write_rooms)."""
        self.inner, self.plan, self._retag, self._room_of = inner, plan, retag, room_of
        self.kind = inner.kind
        self.memory_kinds = inner.memory_kinds
        self._rng = random.Random(plan.seed)
        self._held: _Holder[ArrivedTag] = _Holder(self._rng, plan.hold_s)
        self._arrived = 0   # notifications drained from the real backend, for drop_every_tag
        self._failed: set[int] = set()
        self.injected: dict[str, int] = {}

    def _count(self, what: str) -> None:
        self.injected[what] = self.injected.get(what, 0) + 1

    @property
    def name(self) -> str:
        return self.inner.name

    def identity(self) -> bytes:
        return self.inner.identity()

    def register(self, regions: Sequence[MemRegion]) -> Registration:
        return self.inner.register(regions)

    def deregister(self, registration: Registration) -> None:
        self.inner.deregister(registration)

    def connect(self, peer_identity: bytes) -> str:
        return self.inner.connect(peer_identity)

    def disconnect(self, peer: str) -> None:
        self.inner.disconnect(peer)

    def post_write(
        self, peer: str, src: np.ndarray, dst: np.ndarray, tag: bytes, *, dst_kind: str | None = None,
        on_complete: Callable[[], None] | None = None,
    ) -> WriteHandle:
        # signals_completion stays False here: the faults act in poll_write, so the owner polls
        if self._retag is not None and self.plan.corrupt_rooms:
            new = self._retag(tag)
            if new is not None:
                tag = new
                self._count("corrupted_room_tag")
        if (
            self.plan.hold_write_rooms
            and self._room_of is not None
            and self._room_of(tag) in self.plan.hold_write_rooms
        ):
            # in flight from the caller's view, posted for real only once the hold is over: a
            # write that lands late (a slow link, a stalled NIC), whatever happened to its room
            self._count("held_write")
            held = WriteHandle(peer=peer, nbytes=int(np.asarray(src)[:, 1].sum()), ndesc=len(src))
            held.extra["held"] = (time.monotonic() + self.plan.hold_write_s, peer, src, dst, tag, dst_kind)
            return held
        return self.inner.post_write(peer, src, dst, tag, dst_kind=dst_kind)

    def _unheld(self, handle: WriteHandle) -> WriteHandle | None:
        """The real write behind a held one once its hold is over (None while held)."""
        if "inner" in handle.extra:
            posted: WriteHandle = handle.extra["inner"]
            return posted
        until, peer, src, dst, tag, dst_kind = handle.extra["held"]
        if time.monotonic() < until:
            return None
        inner = self.inner.post_write(peer, src, dst, tag, dst_kind=dst_kind)
        handle.extra["inner"] = inner
        return inner

    def poll_write(self, handle: WriteHandle) -> WriteState:
        if "held" in handle.extra:
            inner = self._unheld(handle)
            if inner is None:
                return WriteState.PENDING
            state = self.inner.poll_write(inner)
            handle.state, handle.reason = state, inner.reason
            for key in ("may_touch_memory", "returned"):
                if key in inner.extra:
                    handle.extra[key] = inner.extra[key]
            return state
        state = self.inner.poll_write(handle)
        if state is WriteState.DONE and self.plan.fail_writes and self._rng.random() < self.plan.fail_writes:
            handle.state, handle.reason = WriteState.FAILED, "injected write failure"
            self._count("failed_write")
            return WriteState.FAILED
        return state

    def release_write(self, handle: WriteHandle) -> None:
        if "held" not in handle.extra:
            self.inner.release_write(handle)
        elif "inner" in handle.extra:  # (a write released while still held never lands)
            self.inner.release_write(handle.extra["inner"])
            for key in ("may_touch_memory", "returned"):
                if key in handle.extra["inner"].extra:
                    handle.extra[key] = handle.extra["inner"].extra[key]

    def progress(self) -> None:
        self.inner.progress()

    def drain_tags(self) -> list[ArrivedTag]:
        p, rng = self.plan, self._rng
        out: list[ArrivedTag] = []
        for t in self.inner.drain_tags():
            self._arrived += 1
            if rng.random() < p.drop_tags or (p.drop_every_tag > 0 and self._arrived % p.drop_every_tag == 0):
                self._count("dropped_tag")
                continue
            if rng.random() < p.corrupt_tags:
                t = ArrivedTag(t.peer, _flip(rng, t.tag))
                self._count("corrupted_tag")
            copies = 2 if rng.random() < p.dup_tags else 1
            if copies == 2:
                self._count("duplicated_tag")
            for _ in range(copies):
                if rng.random() < p.reorder_tags:
                    self._held.hold(t)
                    self._count("reordered_tag")
                else:
                    out.append(t)
        return out + self._held.due()

    def close(self) -> None:
        self.inner.close()


class ControlFaults:
    """The control-plane half: applied by ControlSocket to every frame it sends."""

    def __init__(self, plan: FaultPlan) -> None:
        self.plan = plan
        self._rng = random.Random(plan.seed + 1)
        self._held: _Holder[tuple[str, list[bytes]]] = _Holder(self._rng, plan.hold_s)

    def outgoing(self, endpoint: str, frames: list[bytes], kind: str = "") -> list[tuple[str, list[bytes]]]:
        """What to actually send now for one frame of message type `kind` (possibly nothing, or
        several)."""
        p, rng = self.plan, self._rng
        out = [(e, f) for e, f in self._held.due()]
        if kind in p.drop_msg_types or rng.random() < p.drop_msgs:
            return out
        if rng.random() < p.corrupt_msgs:
            frames = [_flip(rng, frames[0]), frames[1]]
        copies = 2 if rng.random() < p.dup_msgs else 1
        for _ in range(copies):
            if rng.random() < p.reorder_msgs:
                self._held.hold((endpoint, frames))
            else:
                out.append((endpoint, frames))
        return out

    def due(self) -> list[tuple[str, list[bytes]]]:
        return self._held.due()
