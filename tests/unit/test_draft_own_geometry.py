"""A draft KV of its own geometry (other heads or head_dim than the target's): its entries become
internal heads pools whose items are the token slots of the pages a request moves. Pure."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvstage.transfer.draft_kv import DraftKV, draft_items, draft_pool_name, request_draft_items
from kvstage.transfer.kv_buffers import KVBuffers
from kvstage.transfer.layout import KVLayout
from kvstage.transfer.pool_spec import check_pool_items
from kvstage.transfer.protocol import peering
from kvstage.transfer.protocol.actions import PeerKey
from kvstage.transfer.protocol.decode.plan import PlanRefused, WriterOffer, plan_room
from kvstage.transfer.protocol.head_mapping import compute_assignments
from kvstage.transfer.protocol.pool_parts import writers_mismatch
from kvstage.transfer.state_pools import StatePool

OWN = dict(total_kv_heads=2, head_dim=16)


def layout(entries=2, tp_size=2, tp_rank=1, **kw):
    base = dict(num_layers=3, total_kv_heads=4, head_dim=8, dtype=torch.bfloat16, page_size=4, tp_size=tp_size,
                tp_rank=tp_rank)
    draft = kw.pop("draft", OWN)
    base.update(kw)
    return KVLayout(**base, draft=DraftKV(num_layers=entries, **draft) if entries else None)


def zeros(n, tokens, heads, dim):
    return [torch.zeros(tokens, heads, dim, dtype=torch.bfloat16) for _ in range(n)]


def buffers(lay, pages=2, **kw):
    tokens = pages * lay.page_size
    d = lay.draft
    args = dict(k=zeros(lay.num_layers, tokens, lay.local_heads, lay.head_dim),
                v=zeros(lay.num_layers, tokens, lay.local_heads, lay.head_dim),
                draft_k=zeros(lay.draft_entries, tokens, lay.draft_local_heads, d.head_dim) if d else (),
                draft_v=zeros(lay.draft_entries, tokens, lay.draft_local_heads, d.head_dim) if d else None)
    args.update(kw)
    return KVBuffers(**args)


def test_a_draft_of_its_own_geometry_is_no_layer():
    lay = layout()
    assert lay.draft_own_geometry and lay.draft == DraftKV(num_layers=2, total_kv_heads=2, head_dim=16)
    assert (lay.draft_entries, lay.draft_layers, lay.num_entries, lay.layers) == (2, 0, 3, range(3))
    assert lay.draft_local_heads == 1
    s = lay.summary()
    assert (s.draft_layers, s.draft_kv_heads, s.draft_head_dim) == (2, 2, 16)   # the pairing sees every entry
    # a draft given with the target's numbers is the target's geometry: layers, as before
    same = layout(draft=dict(total_kv_heads=4, head_dim=8))
    assert not same.draft_own_geometry and same.draft_layers == 2 and same.num_entries == 5
    # replication: 2 draft heads over TP 4, each rank one copy
    assert layout(tp_size=4, tp_rank=3).draft_local_heads == 1


def test_its_entries_are_internal_heads_pools():
    lay = layout()
    user = StatePool(tensors=[torch.zeros(5, 3)])
    b = buffers(lay, pools={"aux": user}).validate(lay)
    names = [draft_pool_name(0), draft_pool_name(1)]
    assert sorted(b.pools) == ["aux"] + names
    assert [t.data_ptr() for t in b.pools[names[1]].tensors] == [b.draft_k[1].data_ptr(), b.draft_v[1].data_ptr()]
    spec = {p.name: p for p in b.pool_specs}[names[0]]
    assert (spec.sharding, spec.heads, spec.rows, spec.dtypes) == ("heads", 2, [[16], [16]], ["bfloat16"] * 2)
    assert b.entry_k == list(b.k) and b.entry_v == list(b.v)      # not among the layers
    assert b.tensors() == list(b.k) + list(b.v)                   # the KV region; the pools are their own
    assert b.pools[names[0]].num_items == 2 * lay.page_size       # token slots
    again = b.validate(lay)                                       # validating twice keeps one pool per entry
    assert sorted(again.pools) == ["aux"] + names and again.pools["aux"] is user
    mla = layout(mla=True, total_kv_heads=1, tp_rank=0, draft=dict(head_dim=24), entries=1)
    mb = KVBuffers(k=zeros(3, 8, 1, 8), draft_k=zeros(1, 8, 1, 24)).validate(mla)
    assert [len(p.tensors) for p in mb.pools.values()] == [1]      # the latent only


def test_its_tensors_are_checked_with_the_draft_geometry():
    lay = layout()
    tokens = 2 * lay.page_size
    bad = [
        (dict(draft_k=zeros(2, tokens, 2, 8)), r"draft_k\[0\] has shape \(8, 2, 8\), expected \[num_pages \* 4, 1, 16\]"),
        (dict(draft_v=zeros(2, tokens + 4, 1, 16)), r"draft_v\[0\] has 12 tokens, layer k\[0\] has 8"),
        (dict(draft_k=zeros(1, tokens, 1, 16)), "draft_k has 1 layers, DraftKV.num_layers is 2"),
    ]
    for kw, message in bad:
        with pytest.raises(ValueError, match=message):
            buffers(lay, **kw).validate(lay)
    b = buffers(lay)
    b.draft_v = [b.draft_k[0], b.draft_v[1]]
    with pytest.raises(ValueError, match="overlap"):
        b.validate(lay)


def test_the_draft_pool_names_are_reserved():
    lay = layout()
    with pytest.raises(ValueError, match=r"pool name 'kvstage.draft.0' is reserved"):
        buffers(lay, pools={draft_pool_name(0): StatePool(tensors=[torch.zeros(5, 3)])}).validate(lay)
    plain = layout(entries=0)
    with pytest.raises(ValueError, match="is reserved"):
        buffers(plain, pools={draft_pool_name(3): StatePool(tensors=[torch.zeros(5, 3)])}).validate(plain)
    b = buffers(lay).validate(lay)
    with pytest.raises(ValueError, match="is the draft KV's own: kvstage names its items"):
        check_pool_items({draft_pool_name(0): [0, 1]}, b.pools, "room 1 init()")
    with pytest.raises(ValueError, match=r"unknown pool 'x' \(registered: none\)"):   # internal ones not listed
        check_pool_items({"x": [0]}, b.pools, "room 1 init()")


def test_items_are_the_token_slots_of_the_pages():
    assert draft_items(np.array([3, 0]), 4).tolist() == [12, 13, 14, 15, 0, 1, 2, 3]
    assert draft_items(np.array([5, 2, 7]), 1).tolist() == [5, 2, 7]     # head-major: a page is one "token"
    assert draft_items(np.array([], dtype=np.int64), 4).size == 0
    got = request_draft_items(["aux", draft_pool_name(0), draft_pool_name(1)], np.array([1]), 2)
    assert sorted(got) == [draft_pool_name(0), draft_pool_name(1)] and got[draft_pool_name(1)].tolist() == [2, 3]


def summary(entries=2, **kw):
    lay = layout(entries=entries, **kw)
    return lay.summary(buffers(lay).validate(lay).pool_specs)


@pytest.mark.parametrize("prefill, decode, ok", [
    (2, 2, True), (1, 2, True), (0, 2, True),    # decode-only speculation: the extra entries stay unwritten
    (2, 1, False), (1, 0, False),
])
def test_pairing_counts_ignore_the_decode_extra_pools(prefill, decode, ok):
    problems = summary(prefill).mismatches(summary(decode))
    assert (problems == []) == ok, problems
    assert not any("registered" in p for p in problems)          # the draft is compared as a draft, not a pool


def test_pairing_geometry():
    problems = summary(1).mismatches(summary(1, draft=dict(total_kv_heads=2, head_dim=32)))
    assert len(problems) == 1 and "draft KV geometry" in problems[0] and "head_dim 32" in problems[0]
    same = summary(1, draft=dict(total_kv_heads=4, head_dim=8))   # the decode's draft has the target's geometry
    assert "draft KV geometry" in summary(1).mismatches(same)[0]


def test_writers_must_be_the_kv_writers():
    """2 draft heads beside 4 KV heads: P4 -> D1 has the KV written by all four prefill ranks, the
    replicated draft by two of them: refused at connect, naming both; P2 -> D4 and P1 -> D2 pair."""
    specs = buffers(layout(tp_size=4, tp_rank=0)).validate(layout(tp_size=4, tp_rank=0)).pool_specs
    why = writers_mismatch(specs, 4, 1, 4, False)
    assert "draft KV entry 0 (2 heads)" in why and "its KV (4 heads) by [0, 1, 2, 3]" in why
    assert "must have the KV's writers" in why
    assert writers_mismatch(specs, 2, 4, 4, False) == "" and writers_mismatch(specs, 1, 2, 4, False) == ""


def records(**fields):
    layout_ = {"num_layers": 3, "pp_size": 1, "stage_start": 0, "stage_stop": 3, "total_kv_heads": 4, "head_dim": 8,
               **fields}
    return [SimpleNamespace(tp_rank=r, tp_size=2, role="prefill", incarnation=100 + r, layout=dict(layout_))
            for r in range(2)]


def test_decode_learns_the_prefill_draft_pools():
    own = peering.read_stages("e", records(draft_layers=2, draft_kv_heads=2, draft_head_dim=16), 3)
    assert own.layers == (range(3),) and own.draft_pools == 2
    same = peering.read_stages("e", records(draft_layers=2, draft_kv_heads=4, draft_head_dim=8), 3)
    assert same.layers == (range(5),) and same.draft_pools == 0
    need = peering.needed_ranks(2, layout(tp_size=1, tp_rank=0), own.layers, own.draft_pools)
    assert need.draft_pools == 2


def test_plan_carries_the_draft_pools_the_prefill_writes():
    kw = dict(staging=True, ring_size=1 << 20, ring_align=256, piece_cap=1 << 20, epoch=3)
    offers = {p: WriterOffer(PeerKey("p", p, 10 + p), True, 1 << 20, range(3)) for p in (0, 1)}
    lay = layout(tp_size=1, tp_rank=0)
    m = compute_assignments(2, 1, 4)
    plan = plan_room(lay, m, offers, {}, **kw, draft_pools=1)
    assert not isinstance(plan, PlanRefused) and plan.draft_pools == 1 and plan.num_layers == 3
    assert plan.head_page_bytes == 2 * 3 * lay.page_size * lay.head_bytes      # the draft is no layer
    refused = plan_room(lay, m, offers, {}, **kw, draft_pools=3)
    assert isinstance(refused, PlanRefused) and "writes 3 draft KV entries" in refused.reason
    same = layout(tp_size=1, tp_rank=0, draft=dict(total_kv_heads=4, head_dim=8))
    refused = plan_room(same, m, offers, {}, **kw, draft_pools=1)
    assert isinstance(refused, PlanRefused) and "2 of the target's geometry" in refused.reason


def test_from_pointers_gives_the_draft_its_own_shape():
    lay = layout()
    pages = 2
    sizes = [lay.page_bytes] * 6 + [lay.page_size * 1 * 16 * 2] * 4
    mem = [torch.zeros(pages * n, dtype=torch.uint8) for n in sizes]
    b = KVBuffers.from_pointers(lay, [t.data_ptr() for t in mem], [pages * n for n in sizes], sizes)
    assert [tuple(t.shape) for t in b.draft_k + b.draft_v] == [(8, 1, 16)] * 4
    assert [t.data_ptr() for t in b.draft_v] == [mem[8].data_ptr(), mem[9].data_ptr()]
    with pytest.raises(ValueError, match=r"item_lens\[6\]=64: one page of one draft entry is 128 bytes"):
        KVBuffers.from_pointers(lay, [t.data_ptr() for t in mem], [pages * n for n in sizes], sizes[:6] + [64] * 4)
