"""How one page of a rank's KV cache is laid out in memory (`PageFormat`), as data.

kvstage's own format is token-major (NHD). Serving engines also use head-major pages (HND:
within a page, all tokens of head 0, then head 1, ...) and K and V fused in one tensor (vLLM's
CPU backend: per head, each token's K then its V). A head-major page holds each head's bytes as
one contiguous run, so kvstage describes it by an equivalent token-major geometry in which a
page is ONE "token" and a head's "row" is the whole page of that head (page_size tokens x
head_dim, x2 when K/V are fused). Every part that moves bytes (direct descriptors, staged
gather/scatter, the ring) then works unchanged, and a head split across TP sizes moves one
contiguous run per page and tensor instead of one per token. The translation from an engine's
geometry lives in page_layouts.py.
"""

from __future__ import annotations

import enum


class PageFormat(enum.Enum):
    """Per-layer tensor shapes, with B pages of S tokens, H local heads of D elements."""

    #: K and V tensors [B * S, H, D] (kvstage's own; also FlashAttention's [2, B, S, H, D])
    NHD = "NHD"
    #: K and V tensors [B, H, S, D] (head-major pages)
    HND = "HND"
    #: one tensor [B, H, S, 2 * D]: per head and token, K then V (vLLM's CPU attention backend)
    HND_KV_FUSED = "HND_KV_FUSED"

    @property
    def head_major(self) -> bool:
        return self is not PageFormat.NHD

    @property
    def kv_fused(self) -> bool:
        return self is PageFormat.HND_KV_FUSED


def parse_page_format(value: object) -> PageFormat:
    """A PageFormat from itself or its name; ValueError listing the supported ones."""
    if isinstance(value, PageFormat):
        return value
    try:
        return PageFormat(value)
    except ValueError:
        raise ValueError(f"page format {value!r} is not supported; use one of "
                         f"{', '.join(f.value for f in PageFormat)}") from None
