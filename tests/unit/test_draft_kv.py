"""Draft KV (speculative decoding): the layout and buffers that hold it, the rule pairing a
prefill's draft with a decode's, and how the decode side learns and plans the entries the
prefill writes. Pure."""

from types import SimpleNamespace

import pytest
import torch

from kvstage.transfer.draft_kv import DraftKV
from kvstage.transfer.kv_buffers import KVBuffers
from kvstage.transfer.layout import KVLayout
from kvstage.transfer.protocol import peering
from kvstage.transfer.protocol.actions import PeerKey
from kvstage.transfer.protocol.decode.plan import PlanRefused, WriterOffer, plan_room
from kvstage.transfer.protocol.head_mapping import compute_assignments


def layout(draft=1, **kw):
    base = dict(num_layers=3, total_kv_heads=4, head_dim=8, dtype=torch.bfloat16, page_size=4, tp_size=2, tp_rank=1)
    base.update(kw)
    if isinstance(draft, int):
        draft = DraftKV(num_layers=draft) if draft else None
    return KVLayout(**base, draft=draft)


def tensors(lay, n, pages=2):
    return [torch.zeros(pages * lay.page_size, lay.local_heads, lay.head_dim, dtype=lay.dtype) for _ in range(n)]


def buffers(lay, **kw):
    mla = lay.mla
    args = dict(k=tensors(lay, lay.num_layers), v=None if mla else tensors(lay, lay.num_layers),
                draft_k=tensors(lay, lay.draft_layers), draft_v=None if mla or not lay.draft_layers
                else tensors(lay, lay.draft_layers))
    args.update(kw)
    return KVBuffers(**args)


def test_entries_follow_the_layers():
    lay = layout(draft=2)
    assert (lay.num_layers, lay.draft_layers, lay.num_entries) == (3, 2, 5)
    assert lay.layers == range(0, 5) and lay.stage == range(0, 3)   # the model's layers stay the model's
    assert lay.draft == DraftKV(num_layers=2, total_kv_heads=4, head_dim=8)   # None -> the target's
    assert layout(draft=0).num_entries == 3 and layout(draft=0).layers == range(3)
    b = buffers(lay).validate(lay)
    assert b.entry_k == list(b.k) + list(b.draft_k) and b.entry_v == list(b.v) + list(b.draft_v)
    assert b.tensors() == b.entry_k + b.entry_v                     # K of every entry, then V
    k, v = b.layer_views(range(3, 5))
    assert k == list(b.draft_k) and v == list(b.draft_v)
    mla = layout(draft=1, mla=True, total_kv_heads=1, tp_rank=0)
    mb = buffers(mla).validate(mla)
    assert mb.entry_v is None and mb.tensors() == list(mb.k) + list(mb.draft_k)


def test_the_last_pp_stage_holds_the_draft_after_the_models_last_layer():
    last = layout(draft=2, pp_size=2, pp_rank=1, stage=range(1, 3))
    assert last.layers == range(1, 5) and last.num_entries == 5 and last.local(range(3, 5)) == range(2, 4)
    b = buffers(last, k=tensors(last, 2), v=tensors(last, 2)).validate(last)
    assert b.first_layer == 1 and b.entry_k == list(b.k) + list(b.draft_k)
    assert b.layer_views(range(3, 5))[0] == list(b.draft_k)


@pytest.mark.parametrize("draft, kw, message", [
    (DraftKV(num_layers=1), dict(pp_size=2, pp_rank=0, stage=range(0, 1)), "belong to the last stage"),
    (DraftKV(num_layers=1, total_kv_heads=3), {}, "draft KV of 3 heads cannot be split over tp_size=2"),
    (DraftKV(num_layers=1, total_kv_heads=2), dict(mla=True, total_kv_heads=1), "beside an MLA target"),
    ("one", {}, "draft must be a DraftKV"),
])
def test_layouts_a_draft_cannot_have(draft, kw, message):
    with pytest.raises(ValueError, match=message):
        layout(draft=draft, **kw)


@pytest.mark.parametrize("kw, message", [
    (dict(num_layers=0), "DraftKV.num_layers must be a positive int"),
    (dict(num_layers=True), "DraftKV.num_layers"),
    (dict(num_layers=1, total_kv_heads=0), "DraftKV.total_kv_heads"),
    (dict(num_layers=1, head_dim=2.5), "DraftKV.head_dim"),
])
def test_draft_fields_are_checked(kw, message):
    with pytest.raises(ValueError, match=message):
        DraftKV(**kw)


def test_buffers_are_checked_like_k_and_v():
    lay = layout(draft=2)
    bad = [
        (dict(draft_k=tensors(lay, 1)), "draft_k has 1 layers, DraftKV.num_layers is 2"),
        (dict(draft_v=None), "draft_v is None but the layout is not MLA"),
        (dict(draft_v=tensors(lay, 1) + [torch.zeros(8, 2, 4, dtype=torch.bfloat16)]), r"draft_v\[1\] has shape"),
        (dict(draft_k=tensors(lay, 2, pages=3)), r"draft_k\[0\] has 12 tokens, layer k\[0\] has 8"),
        (dict(draft_k=[t.float() for t in tensors(lay, 2)]), r"draft_k\[0\] has dtype"),
    ]
    for kw, message in bad:
        with pytest.raises(ValueError, match=message):
            buffers(lay, **kw).validate(lay)
    b = buffers(lay)
    b.draft_k = [b.k[0], b.draft_k[1]]   # a draft entry aliasing a target layer
    with pytest.raises(ValueError, match=r"draft_k\[0\] and k\[0\] overlap|k\[0\] and draft_k\[0\] overlap"):
        b.validate(lay)
    plain = layout(draft=0)
    with pytest.raises(ValueError, match="the layout has no draft"):
        buffers(plain, draft_k=tensors(plain, 1)).validate(plain)
    mla = layout(draft=1, mla=True, total_kv_heads=1, tp_rank=0)
    with pytest.raises(ValueError, match="draft_v must be None"):
        buffers(mla, draft_v=tensors(mla, 1)).validate(mla)


def test_from_pointers_takes_the_draft_after_the_target():
    """SGLang's pointer lists: target K, target V, then the draft's K, then its V."""
    lay = layout(draft=2)
    pages, page = 2, lay.page_bytes
    mem = [torch.arange(pages * page, dtype=torch.uint8) + i for i in range(2 * lay.num_entries)]
    b = KVBuffers.from_pointers(lay, [t.data_ptr() for t in mem], [pages * page] * len(mem), [page] * len(mem))
    got = [t.data_ptr() for t in b.k + b.v + b.draft_k + b.draft_v]
    n, d = lay.num_layers, lay.draft_layers
    want = [mem[i].data_ptr() for i in list(range(n)) + list(range(n, 2 * n)) + list(range(2 * n, 2 * n + d))
            + list(range(2 * n + d, 2 * n + 2 * d))]
    assert got == want
    with pytest.raises(ValueError, match=r"must list 10 entries \(5 entries, K then V, the target's 3 then the "
                                         r"draft's 2\)"):
        KVBuffers.from_pointers(lay, [t.data_ptr() for t in mem[:6]], [pages * page] * 6, [page] * 6)


def summary(draft=1, **kw):
    return layout(draft=draft, **kw).summary()


@pytest.mark.parametrize("prefill, decode, ok", [
    (1, 1, True), (2, 2, True),
    (1, 2, True),      # decode-only speculation beyond the prefill's entries
    (0, 2, True),      # decode-only speculation: a prefill without a draft
    (0, 0, True),
    (2, 1, False),     # the prefill writes an entry the decode does not hold
    (1, 0, False),     # a prefill with a draft, a decode without one
])
def test_pairing_rule_on_counts(prefill, decode, ok):
    problems = summary(prefill).mismatches(summary(decode))
    if ok:
        assert problems == []
    else:
        assert len(problems) == 1, problems
        assert f"the prefill has {prefill} draft KV entr" in problems[0]
        assert (f"the decode {decode} draft KV entr" if decode else "the decode no draft KV") in problems[0]
        assert "at least as many draft entries" in problems[0]


def test_pairing_rule_on_geometry():
    """The draft's heads and head_dim must be equal on both sides (the layout summaries carry
    them; a side states its resolved draft)."""
    mine = summary(1)
    theirs = type(mine)(**{**{f: getattr(mine, f) for f in mine.__struct_fields__}, "draft_head_dim": 16})
    problems = mine.mismatches(theirs)
    assert len(problems) == 1 and "draft KV geometry" in problems[0]
    assert "1 draft KV entry of 4 heads x head_dim 8" in problems[0] and "4 heads x head_dim 16" in problems[0]
    heads = type(mine)(**{**{f: getattr(mine, f) for f in mine.__struct_fields__}, "draft_kv_heads": 2})
    assert "draft KV geometry" in mine.mismatches(heads)[0]
    # a prefill without a draft pairs with any decode draft
    assert summary(0).mismatches(theirs) == []


def test_target_mismatch_stays_a_mismatch_with_drafts():
    problems = summary(1).mismatches(summary(1, num_layers=4))
    assert problems == ["num_layers: 3 here vs 4 at peer"]


def records(draft, tp=2, num_layers=3):
    return [SimpleNamespace(tp_rank=r, tp_size=tp, role="prefill", incarnation=100 + r,
                            layout={"num_layers": num_layers, "pp_size": 1, "stage_start": 0, "stage_stop": num_layers,
                                    **({"draft_layers": draft} if draft is not None else {})})
            for r in range(tp)]


def test_decode_learns_the_prefill_entries_from_its_records():
    assert peering.read_stages("e", records(2), 3).layers == (range(0, 5),)
    assert peering.read_stages("e", records(0), 3).layers == (range(0, 3),)
    assert peering.read_stages("e", records(None), 3).layers == (range(0, 3),)   # a record without the field
    recs = records(1)
    recs[1].layout["draft_layers"] = 2
    with pytest.raises(ValueError, match=r"disagree on the draft KV entries: \[1, 2\]"):
        peering.read_stages("e", recs, 3)
    # the published stage is the model's layers only (a PP decode check tiles the model with it)
    assert peering.stage_record(layout(draft=2)) == {"pp_size": 1, "stage_start": 0, "stage_stop": 3, "page_shards": 1}


def test_with_pp_the_decode_reads_the_draft_from_the_prefills_last_stage():
    recs = records(0, tp=4, num_layers=4)   # PP 2 x TP 2: stages [0, 2) and [2, 4)
    for r in recs:
        r.layout.update(pp_size=2, stage_start=2 * (r.tp_rank // 2), stage_stop=2 * (r.tp_rank // 2) + 2)
    for r in recs[2:]:
        r.layout["draft_layers"] = 1
    assert peering.read_stages("e", recs, 4).layers == (range(0, 2), range(2, 5))
    recs[0].layout["draft_layers"] = 1
    with pytest.raises(ValueError, match=r"PP stages before the last register draft KV entries \(\[1\]\)"):
        peering.read_stages("e", recs, 4)


def test_the_drafts_are_compared_only_where_both_hold_the_models_last_layer():
    """A prefill's last stage meets a decode stage before the last (no draft there): nothing to
    pair; the decode's last stage must hold the prefill's draft entries."""
    assert summary(1).mismatches(summary(0), shared=range(0, 2)) == []
    assert "the decode no draft KV" in summary(1).mismatches(summary(0), shared=range(1, 3))[0]
    assert "the decode no draft KV" in summary(1).mismatches(summary(0))[0]


def test_plan_counts_the_prefill_entries_only():
    """A decode rank with 2 draft entries planning a room from a prefill with 1: the plan's bytes
    and entries are the prefill's; a prefill with more entries than this rank is refused."""
    lay = layout(draft=2, tp_size=1, tp_rank=0)     # decode TP 1, prefill TP 2
    m = compute_assignments(2, 1, 4)
    kw = dict(staging=True, ring_size=1 << 20, ring_align=256, piece_cap=1 << 20, epoch=3)

    def offers(entries):
        return {p: WriterOffer(PeerKey("p", p, 10 + p), True, 1 << 20, range(entries)) for p in (0, 1)}

    plan = plan_room(lay, m, offers(4), {}, **kw)
    assert not isinstance(plan, PlanRefused)
    assert plan.num_layers == 4 and plan.head_page_bytes == 2 * 4 * lay.page_size * lay.head_bytes
    assert plan_room(lay, m, offers(5), {}, **kw).num_layers == 5
    refused = plan_room(lay, m, offers(6), {}, **kw)
    assert isinstance(refused, PlanRefused) and refused.kind == "layout"
    assert "the prefill writes 6 KV entries" in refused.reason and "holds 5" in refused.reason
