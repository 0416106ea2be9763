"""Direct path: one logical write as backend writes that never mix memory kinds. Pure.

A backend write is described by one local and one remote descriptor list, each of ONE memory
kind (NIXL's lists are typed; Mooncake resolves each address in its own registrations, but the
rule is the same for both). The write carrying a request's last page also carries its state pool
items, and a pool may sit in another kind of memory than the KV (host aux rows beside a device
cache), on either side. So the write's descriptors are grouped by (source kind, destination
kind); a pool with `own_writes` gets a group of its own whatever its kinds. Each group is one
backend write with the logical write's tag, numbered `group` of `groups`; the decode rank counts
the logical write once every group landed (protocol/decode/tracker.py, docs/protocol.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DescriptorPart:
    """Descriptors of one region of a logical write: the KV, or one pool copy."""

    label: str           # "kv", or the pool's name
    src_kind: str        # this rank's memory kind for the region
    dst_kind: str        # the decode rank's
    own: bool            # a backend write of its own, whatever the kinds (StatePool.own_writes)
    src: np.ndarray      # N x 3 uint64 rows: address, length, device
    dst: np.ndarray


@dataclass(frozen=True)
class WriteGroup:
    """One backend write: every row of one source kind into one destination kind."""

    src_kind: str
    dst_kind: str
    labels: tuple[str, ...]
    src: np.ndarray
    dst: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.src[:, 1].sum()) if len(self.src) else 0


def group_parts(parts: Sequence[DescriptorPart]) -> list[WriteGroup]:
    """The backend writes of one logical write, in the order their first part comes (the KV
    first); parts without rows make no write. Every row of `parts` is in exactly one group."""
    order: list[tuple[str, str, str]] = []
    members: dict[tuple[str, str, str], list[DescriptorPart]] = {}
    for p in parts:
        if len(p.src) != len(p.dst):
            raise ValueError(f"{p.label}: {len(p.src)} source rows for {len(p.dst)} destination rows")
        if not len(p.src):
            continue
        key = (p.src_kind, p.dst_kind, p.label if p.own else "")
        if key not in members:
            order.append(key)
            members[key] = []
        members[key].append(p)
    return [WriteGroup(key[0], key[1], tuple(p.label for p in members[key]),
                       *_joined([p.src for p in members[key]], [p.dst for p in members[key]]))
            for key in order]


def _joined(src: list[np.ndarray], dst: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """One group's rows; a single part's arrays as they are (most writes: the KV alone)."""
    if len(src) == 1:
        return src[0], dst[0]
    return np.concatenate(src), np.concatenate(dst)
