"""A seeded model of the control plane between ranks: delay, reordering and loss. Pure.

Each message gets a delay drawn from `base + exponential(jitter)`; a message may be lost with
probability `loss`. Between one pair of ranks the control plane is one ZMQ connection over TCP,
so messages of a pair keep their order: a message is delivered no earlier than the one sent
before it on the same pair (`fifo=True`, the product's case). With `fifo=False` messages of a
pair may overtake each other too (stricter than the product needs; the rooms must still end
cleanly, but may fail more). Messages of different pairs are reordered freely by their delays.
"""

from __future__ import annotations

import random
from collections.abc import Hashable
from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class NetworkModel:
    base: float = 50e-6        # seconds: the fastest delivery
    jitter: float = 200e-6     # mean of the exponential part
    loss: float = 0.0          # probability a control message is lost
    fifo: bool = True          # messages of one pair keep their order (TCP)

    def __post_init__(self) -> None:
        if self.base < 0 or self.jitter < 0:
            raise ValueError("network delays must be non-negative")
        if not 0.0 <= self.loss < 1.0:
            raise ValueError(f"loss must be in [0, 1), got {self.loss}")


@dataclass
class Network:
    """Decides when (or whether) each message sent on a pair arrives."""

    model: NetworkModel
    rng: random.Random
    _last: dict[Hashable, float] = field(default_factory=dict)
    lost: int = 0

    def arrival(self, pair: Hashable, now: float) -> float | None:
        """When a message sent now on `pair` arrives; None when it is lost."""
        m = self.model
        if m.loss and self.rng.random() < m.loss:
            self.lost += 1
            return None
        at = now + m.base + (self.rng.expovariate(1.0 / m.jitter) if m.jitter else 0.0)
        if m.fifo:
            at = max(at, self._last.get(pair, 0.0))
            self._last[pair] = at
        return at

    def forget(self, pair: Hashable) -> None:
        self._last.pop(pair, None)
