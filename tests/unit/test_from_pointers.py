"""KVBuffers.from_pointers: the KV cache as serving engines hand it over (raw addresses, byte
lengths, per-page item sizes), as views that share the engine's memory and never own it."""

import gc

import pytest
import torch

from kvstage import KVBuffers, KVLayout


def layout(mla=False, dtype=torch.bfloat16):
    return KVLayout(num_layers=3, total_kv_heads=1 if mla else 4, head_dim=8, dtype=dtype, page_size=4, tp_size=2,
                    tp_rank=1, mla=mla)


def engine_cache(lay, pages=5):
    """What a serving engine owns: one tensor per layer and K/V, and its KVArgs-style lists."""
    owned = [torch.randn(pages * lay.page_size, lay.local_heads, lay.head_dim).to(lay.dtype)
             for _ in range(lay.num_layers * lay.num_kv)]
    return owned, [t.data_ptr() for t in owned], [t.numel() * t.element_size() for t in owned], \
        [lay.page_bytes] * len(owned)


@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_views_share_the_engines_memory(mla, dtype):
    lay = layout(mla, dtype)
    owned, ptrs, lens, items = engine_cache(lay)
    buf = KVBuffers.from_pointers(lay, ptrs, lens, items)
    assert buf.num_pages == 5 and (buf.v is None) == mla
    views = buf.tensors()
    assert [v.data_ptr() for v in views] == ptrs
    for v, o in zip(views, owned):
        assert v.shape == o.shape and v.dtype == dtype
        assert torch.equal(v.view(torch.uint8), o.view(torch.uint8))
    views[-1][2, 0, 3] = torch.tensor(1.5).to(dtype)          # a write through a view lands in the engine's
    assert owned[-1][2, 0, 3].float() == 1.5
    snapshot = [o.clone() for o in owned]
    del buf, views
    gc.collect()
    # dropping the views freed nothing: memory they had freed would be handed out again to
    # allocations of the same sizes, and the fill would show in the engine's tensors
    fill = [torch.full((o.numel() * o.element_size(),), 0x5A, dtype=torch.uint8) for o in owned]
    assert [o.data_ptr() for o in owned] == ptrs
    for o, s in zip(owned, snapshot):
        assert torch.equal(o.view(torch.uint8), s.view(torch.uint8))
    del fill


def bad(lay, **change):
    owned, ptrs, lens, items = engine_cache(lay)
    args = {"data_ptrs": ptrs, "data_lens": lens, "item_lens": items, **change}
    return owned, args


@pytest.mark.parametrize("change, match", [
    ({"data_ptrs": [1] * 5}, "data_ptrs must list 6 entries"),
    ({"item_lens": [64] * 6}, r"item_lens\[0\]=64: one page of one layer is 128 bytes"),
    ({"data_lens": [5 * 128 + 8] * 6}, r"data_lens\[0\]=648 is not a whole number"),
    ({"data_lens": [5 * 128] * 5 + [4 * 128]}, r"data_lens\[5\] holds 4 pages, data_lens\[0\] holds 5"),
    ({"data_ptrs": [0x1001] * 6}, "not aligned"),
    ({"data_ptrs": [0] * 6}, r"data_ptrs\[0\] must be a positive int"),
    ({"data_lens": [-1] * 6}, r"data_lens\[0\] must be a positive int"),
    ({"item_lens": "256"}, "item_lens must list 6 entries"),
])
def test_bad_pointer_lists_are_value_errors_naming_the_entry(change, match):
    owned, args = bad(layout(), **change)
    with pytest.raises(ValueError, match=match):
        KVBuffers.from_pointers(layout(), **args)


def test_k_and_v_at_the_same_address_are_refused():
    lay = layout()
    owned, ptrs, lens, items = engine_cache(lay)
    ptrs[3] = ptrs[0]                                          # V of layer 0 aliases K of layer 0
    with pytest.raises(ValueError, match="overlap in memory"):
        KVBuffers.from_pointers(lay, ptrs, lens, items)


def test_an_unsupported_device_is_refused():
    owned, args = bad(layout())
    with pytest.raises(ValueError, match="cpu or cuda"):
        KVBuffers.from_pointers(layout(), device="meta", **args)
