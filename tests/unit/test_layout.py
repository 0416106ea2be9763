import pytest
import torch

from kvstage.transfer.kv_buffers import KVBuffers
from kvstage.transfer.layout import KVLayout, LayoutSummary


def layout(**kw):
    base = dict(num_layers=2, total_kv_heads=8, head_dim=16, dtype=torch.bfloat16,
                page_size=4, tp_size=4, tp_rank=1)
    base.update(kw)
    return KVLayout(**base)


def test_local_heads_and_first_head():
    assert layout().local_heads == 2 and layout().first_head == 2
    rep = layout(total_kv_heads=2, tp_size=8, tp_rank=5)
    assert rep.local_heads == 1 and rep.replication == 4 and rep.first_head == 1
    assert list(rep.heads_of(3)) == [0] and list(rep.heads_of(4)) == [1]


@pytest.mark.parametrize("kw, field", [
    (dict(total_kv_heads=6, tp_size=4), "total_kv_heads"),
    (dict(tp_rank=4), "tp_rank"),
    (dict(tp_rank=-1), "tp_rank"),
    (dict(dtype=torch.complex64), "dtype"),
    (dict(mla=True, total_kv_heads=2), "total_kv_heads"),
    (dict(num_layers=0), "num_layers"),
    (dict(head_dim=-3), "head_dim"),
    (dict(page_size=2.5), "page_size"),
    (dict(tp_size=True), "tp_size"),
])
def test_impossible_geometry_names_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        layout(**kw)


def test_byte_geometry():
    lay = layout(dtype=torch.float32)
    assert lay.elem_size == 4 and lay.token_bytes == 2 * 16 * 4
    assert lay.page_bytes == 4 * lay.token_bytes and lay.num_kv == 2
    assert layout(mla=True, total_kv_heads=1, tp_rank=0).num_kv == 1


def test_summary_mismatches():
    a = layout().summary()
    assert a.mismatches(layout(tp_size=2, tp_rank=0).summary()) == []  # TP may differ
    diff = a.mismatches(layout(page_size=16).summary())
    assert len(diff) == 1 and "page_size" in diff[0]
    assert LayoutSummary(**{**{f: getattr(a, f) for f in a.__struct_fields__}, "protocol_version": 99}).mismatches(a)


def make_buffers(lay, pages=3, **kw):
    shape = (pages * lay.page_size, lay.local_heads, lay.head_dim)
    k = [torch.zeros(shape, dtype=lay.dtype) for _ in range(lay.num_layers)]
    v = None if lay.mla else [torch.zeros(shape, dtype=lay.dtype) for _ in range(lay.num_layers)]
    return k, v


def test_buffers_validate_ok():
    lay = layout()
    k, v = make_buffers(lay)
    assert KVBuffers(k, v).validate(lay).num_pages == 3


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda k, v: k.pop(), "k has 1 layers"),
        (lambda k, v: v.__setitem__(1, torch.zeros(12, 2, 8, dtype=torch.bfloat16)), r"v\[1\] has shape"),
        (lambda k, v: k.__setitem__(0, torch.zeros(12, 2, 16, dtype=torch.float16)), r"k\[0\] has dtype"),
        (
            lambda k, v: k.__setitem__(
                1, torch.zeros(16, 2, 12, dtype=torch.bfloat16).transpose(0, 2)[:12].transpose(1, 2)
            ),
            r"k\[1\]",
        ),
        (lambda k, v: k.__setitem__(1, torch.zeros(10, 2, 16, dtype=torch.bfloat16)), r"k\[1\] has 10 tokens"),
        (lambda k, v: k.__setitem__(1, torch.zeros(16, 2, 16, dtype=torch.bfloat16)), r"k\[1\] has 16 tokens"),
        (lambda k, v: k.__setitem__(0, "x"), r"k\[0\] is str"),
    ],
)
def test_buffers_validate_errors(mutate, message):
    lay = layout()
    k, v = make_buffers(lay)
    mutate(k, v)
    with pytest.raises(ValueError, match=message):
        KVBuffers(k, v).validate(lay)


def test_buffers_noncontiguous():
    lay = layout()
    k, v = make_buffers(lay)
    big = torch.zeros(12, 2, 32, dtype=torch.bfloat16)
    v[0] = big[:, :, :16]
    with pytest.raises(ValueError, match=r"v\[0\] is not contiguous"):
        KVBuffers(k, v).validate(lay)


def test_buffers_mla_and_v_presence():
    mla = layout(mla=True, total_kv_heads=1, tp_rank=0)
    k, _ = make_buffers(mla)
    assert KVBuffers(k, None).validate(mla).num_pages == 3
    with pytest.raises(ValueError, match="MLA"):
        KVBuffers(k, k).validate(mla)
    with pytest.raises(ValueError, match="v is None"):
        KVBuffers(*make_buffers(layout())[:1], None).validate(layout())


@pytest.mark.parametrize(
    "alias, pair",
    [
        (lambda k, v: v.__setitem__(0, k[0]), r"k\[0\] and v\[0\]"),  # K and V are one tensor
        (lambda k, v: k.__setitem__(1, k[0]), r"k\[0\] and k\[1\]"),  # two layers share one
        (lambda k, v: v.__setitem__(1, k[0].view(-1).view(k[0].shape)), r"k\[0\] and v\[1\]"),  # a view of it
    ],
)
def test_buffers_refuse_aliased_tensors(alias, pair):
    lay = layout()
    k, v = make_buffers(lay)
    alias(k, v)
    with pytest.raises(ValueError, match=pair + " overlap"):
        KVBuffers(k, v).validate(lay)


def test_buffers_refuse_partly_overlapping_views_of_one_storage():
    lay = layout()
    k, v = make_buffers(lay)
    base = torch.zeros(12 + 4, 2, 16, dtype=torch.bfloat16)
    k[1], v[0] = base[:12], base[4:]  # share tokens 4..11
    with pytest.raises(ValueError, match=r"k\[1\] and v\[0\] overlap"):
        KVBuffers(k, v).validate(lay)


def test_buffers_accept_adjacent_views_of_one_storage():
    lay = layout()
    base = torch.zeros(4 * 12, 2, 16, dtype=torch.bfloat16)
    parts = list(base.split(12))  # one allocation, four disjoint contiguous slices
    buffers = KVBuffers(parts[:2], parts[2:]).validate(lay)
    assert buffers.num_pages == 3


@pytest.mark.parametrize("where", ["k", "v", "pool"])
def test_buffers_name_a_meta_tensor_as_such(where):
    """A meta tensor has no memory: named for what it is, not as an overlap of two tensors."""
    from kvstage.transfer.state_pools import StatePool

    layout = KVLayout(
        num_layers=2, total_kv_heads=1, head_dim=8, dtype=torch.float32, page_size=4, tp_size=1, tp_rank=0
    )
    k = [torch.zeros(16, 1, 8) for _ in range(2)]
    v = [torch.zeros(16, 1, 8) for _ in range(2)]
    pool = [torch.zeros(4, 3)]
    {"k": k, "v": v, "pool": pool}[where][-1] = torch.zeros(*({"pool": (4, 3)}.get(where, (16, 1, 8))), device="meta")
    name = {"k": "k\\[1\\]", "v": "v\\[1\\]", "pool": "pool 'aux' tensor 0"}[where]
    with pytest.raises(ValueError, match=f"{name} is on the meta device: it has no memory"):
        KVBuffers(k, v, pools={"aux": StatePool(tensors=pool)}).validate(layout)


@pytest.mark.parametrize("device, match", [("meta", "is on the meta device"), ("nonsense", "is not a torch device")])
def test_from_pointers_names_the_device_option(device, match):
    layout = KVLayout(
        num_layers=1, total_kv_heads=1, head_dim=8, dtype=torch.float32, page_size=4, tp_size=1, tp_rank=0
    )
    t = [torch.zeros(16, 1, 8), torch.zeros(16, 1, 8)]
    with pytest.raises(ValueError, match=f"from_pointers\\(device='{device}'\\) {match}"):
        KVBuffers.from_pointers(
            layout, [x.data_ptr() for x in t], [x.nbytes for x in t], [x[0:4].nbytes for x in t], device=device
        )


def test_from_pointers_on_cuda_without_cuda_is_named():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the pointers could be device memory")  # CI has none
    layout = KVLayout(
        num_layers=1, total_kv_heads=1, head_dim=8, dtype=torch.float32, page_size=4, tp_size=1, tp_rank=0
    )
    t = [torch.zeros(16, 1, 8), torch.zeros(16, 1, 8)]
    with pytest.raises(ValueError, match=r"from_pointers\(device='cuda:0'\): CUDA is not available"):
        KVBuffers.from_pointers(
            layout, [x.data_ptr() for x in t], [x.nbytes for x in t], [x[0:4].nbytes for x in t], device="cuda:0"
        )


def test_a_pool_is_one_region_but_may_live_beside_the_kv_on_another_device():
    from kvstage.transfer.state_pools import StatePool

    layout = KVLayout(
        num_layers=1, total_kv_heads=1, head_dim=8, dtype=torch.float32, page_size=4, tp_size=1, tp_rank=0
    )
    kv = ([torch.zeros(16, 1, 8)], [torch.zeros(16, 1, 8)])
    split = StatePool(tensors=[torch.zeros(4, 3), torch.zeros(4, 3, device="meta")])
    with pytest.raises(
        ValueError, match="pool 'aux' tensor 1 is on meta, tensor 0 on cpu: a pool is one memory region"
    ):
        KVBuffers(*kv, pools={"aux": split}).validate(layout)
    ok = KVBuffers(*kv, pools={"aux": StatePool(tensors=[torch.zeros(4, 3)], own_writes=True)}).validate(layout)
    assert ok.pools["aux"].kind == "DRAM" and ok.kind == "DRAM" and ok.pools["aux"].own_writes
    with pytest.raises(ValueError, match="own_writes must be a bool"):
        KVBuffers(*kv, pools={"aux": StatePool(tensors=[torch.zeros(4, 3)], own_writes="yes")}).validate(layout)


def stage_layout(pp_rank, stage, pp_size=2, num_layers=6):
    return layout(num_layers=num_layers, pp_size=pp_size, pp_rank=pp_rank, stage=stage)


def test_pp_stage_holds_its_layers_and_is_a_rank_of_the_engine():
    lay = stage_layout(1, range(2, 6))
    assert lay.layers == range(2, 6) and lay.local(range(3, 5)) == range(1, 3)
    assert (lay.rank, lay.ranks) == (1 * 4 + 1, 8)
    assert lay.summary() == layout(num_layers=6).summary()   # peers compare the model, not the stage
    assert layout().layers == range(2) and (layout().rank, layout().ranks) == (1, 4)


@pytest.mark.parametrize("kw, message", [
    (dict(pp_rank=0, stage=range(1, 3)), "stage 0 must start at layer 0"),
    (dict(pp_rank=1, stage=range(2, 5)), "last PP stage .* must end at layer 6"),
    (dict(pp_rank=0, stage=range(0, 7)), "outside the model's 6 layers"),
    (dict(pp_rank=0, stage=range(0, 0)), "non-empty range"),
    (dict(pp_rank=0, stage=range(0, 4, 2)), "step 1"),
    (dict(pp_rank=2, stage=range(2, 6)), "pp_rank must be in"),
    (dict(pp_rank=0, pp_size=1, stage=range(0, 3)), "must end at layer 6"),
])
def test_pp_stage_errors(kw, message):
    with pytest.raises(ValueError, match=message):
        stage_layout(**{"pp_size": 2, **kw})


def test_pp_stage_buffers_hold_only_its_layers():
    lay = stage_layout(1, range(2, 6))
    shape = (3 * lay.page_size, lay.local_heads, lay.head_dim)
    k = [torch.full(shape, i, dtype=lay.dtype) for i in range(4)]
    v = [torch.full(shape, 10 + i, dtype=lay.dtype) for i in range(4)]
    b = KVBuffers(k, v).validate(lay)
    assert b.first_layer == 2
    kk, vv = b.layer_views(range(3, 5))   # model layers 3 and 4: the stage's tensors 1 and 2
    assert [int(t[0, 0, 0]) for t in kk] == [1, 2] and [int(t[0, 0, 0]) for t in vv] == [11, 12]
    with pytest.raises(ValueError, match=r"k has 6 layers, layout has 4 \(PP stage 1: layers \[2, 6\)\)"):
        KVBuffers(k + k[:2], v).validate(lay)
