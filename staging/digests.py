"""End-to-end digests (EngineConfig(verify=True)): xxh3-64 of the bytes of one write, in the
order the staged path gathers them (KV: [K/V][layer][token][head]; then the state pool block).

The prefill rank digests what it sends; the decode rank digests what landed, before it scatters
(staged: the ring bytes themselves) or before the room may succeed (direct: its pages and items
gathered in the same order). Equal digests mean the same bytes, up to xxh3's collision odds.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import xxhash

from .pool_copies import gather_pools


def digest(data: torch.Tensor) -> int:
    """xxh3-64 of a contiguous uint8 tensor (copied to the host first when it is on a GPU)."""
    host = data if data.device.type == "cpu" else data.cpu()
    return xxhash.xxh3_64_intdigest(host.numpy())


def gathered_digest(gatherer, k: Sequence[torch.Tensor], v, pages: np.ndarray, page_size: int,
                    heads: tuple[int, int], pools: dict, copies: Sequence, nbytes: int, dst: bool = False) -> int:
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
