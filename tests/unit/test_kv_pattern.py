"""The demo's verification pattern must catch misplaced pages, rooms, heads and flipped bits."""

import numpy as np
import pytest
import torch

from kvstage.support.kv_pattern import KVPattern
from kvstage.transfer.layout import KVLayout


def cache(layout, pages=16):
    shape = (pages * layout.page_size, layout.local_heads, layout.head_dim)
    return [torch.zeros(shape, dtype=layout.dtype) for _ in range(layout.num_kv * layout.num_layers)]


@pytest.mark.parametrize("dtype,head_dim", [(torch.bfloat16, 16), (torch.float8_e4m3fn, 4), (torch.float32, 3)])
def test_prefill_pattern_checks_out_on_decode_ranks_with_other_tp(dtype, head_dim):
    pre = [
        KVLayout(num_layers=2, total_kv_heads=4, head_dim=head_dim, dtype=dtype, page_size=4, tp_size=4, tp_rank=r)
        for r in range(4)
    ]
    dec = [
        KVLayout(num_layers=2, total_kv_heads=4, head_dim=head_dim, dtype=dtype, page_size=4, tp_size=2, tp_rank=r)
        for r in range(2)
    ]
    src_pages, dst_pages = np.array([3, 1, 7]), np.array([9, 2, 5])
    pcaches = [cache(l) for l in pre]
    for l, c in zip(pre, pcaches):
        KVPattern(l).fill(c, room=42, pages=src_pages)
    for d, l in enumerate(dec):
        c = cache(l)
        for t in range(len(c)):  # decode rank d holds the heads of prefill ranks 2d and 2d+1
            for h in range(2):
                src = pcaches[2 * d + h][t].view(-1, 4, 1, head_dim)
                c[t].view(-1, 4, 2, head_dim)[dst_pages, :, h] = src[src_pages, :, 0]
        pat = KVPattern(l)
        assert pat.check(c, 42, dst_pages) is None
        assert pat.check(c, 43, dst_pages) is not None  # other room
        assert pat.check(c, 42, dst_pages[[1, 0, 2]]) is not None  # pages swapped
        hb = head_dim * c[1].element_size()
        c[1].view(torch.uint8).view(-1, 4, 2, hb)[dst_pages[2], 3, 1, hb - 1] ^= 1  # one bit
        assert pat.check(c, 42, dst_pages) is not None


def test_a_flipped_bit_is_caught():
    l = KVLayout(num_layers=1, total_kv_heads=2, head_dim=8, dtype=torch.bfloat16, page_size=2, tp_size=1, tp_rank=0)
    c = cache(l)
    pat = KVPattern(l)
    pages = np.array([4, 5])
    pat.fill(c, 1, pages)
    assert pat.check(c, 1, pages) is None
    c[0].view(torch.uint8).view(-1, 2, 2, 16)[5, 1, 1, 3] ^= 4
    assert "tensor 0" in pat.check(c, 1, pages)
