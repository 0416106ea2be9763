"""End-to-end digests (EngineConfig(verify=True)): xxh3-64 of the bytes of one write, in the
order the staged path gathers them (KV: [K/V][layer][token][head]; then the state pool block).

The prefill rank digests what it sends; the decode rank digests what landed, before it scatters
(staged: the ring bytes themselves) or before the room may succeed (direct: its pages and items
gathered in the same order). Equal digests mean the same bytes, up to xxh3's collision odds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
import xxhash

from .gather_scatter import GathersKV
from .pool_copies import PoolBytes, gather_pools

if TYPE_CHECKING:  # staging stays importable without the protocol package
    from ..transfer.protocol.pool_parts import PoolCopy
    from ..transfer.state_pools import StatePool


def digest(data: torch.Tensor) -> int:
    """xxh3-64 of a contiguous uint8 tensor (copied to the host first when it is on a GPU)."""
    host = data if data.device.type == "cpu" else data.cpu()
    return xxhash.xxh3_64_intdigest(host.numpy().data)


def gathered_digest(gatherer: GathersKV, k: Sequence[torch.Tensor], v: Sequence[torch.Tensor] | None,
                    pages: np.ndarray, page_size: int, heads: tuple[int, int],
                    pools: PoolBytes | Mapping[str, StatePool], copies: Sequence[PoolCopy], nbytes: int,
                    dst: bool = False) -> int:
    """The digest of `pages` x `heads` of the cache, then the pool copies' items (the decode
    side's with `dst`), laid out as the staged path would gather them: `nbytes` in all."""
    out = torch.empty(nbytes, dtype=torch.uint8, device=k[0].device)
    idx = torch.from_numpy(np.ascontiguousarray(pages, dtype=np.int64))
    n = gatherer.gather(k, v, idx, page_size, heads, out)
    if copies:
        n += gather_pools(pools, copies, out, n, dst=dst)
    if n != nbytes:
        raise ValueError(f"digest over {n} bytes, the write has {nbytes}")
    return digest(out)
