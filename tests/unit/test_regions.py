"""Regions and memory kinds, pure parts: a direct write's descriptors grouped so that no backend
write mixes kinds and every byte goes exactly once; the decode side counting a write split into
groups only once every group landed; which regions a backend build cannot register or write."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstage.transfer.protocol.decode.tracker import Outcome, RoomTracker
from kvstage.transfer.protocol.hello_admission import unwritable_peer_kinds
from kvstage.transfer.protocol.write_groups import DescriptorPart, group_parts
from kvstage.transfer.regions import buffer_regions, unregistrable
from kvstage.transfer.state_pools import StatePool

KINDS = ("DRAM", "VRAM")


def rows(start: int, n: int, device: int = 0) -> np.ndarray:
    out = np.zeros((n, 3), dtype=np.uint64)
    out[:, 0] = start + 64 * np.arange(n, dtype=np.uint64)
    out[:, 1] = 64
    out[:, 2] = device
    return out


@st.composite
def logical_writes(draw):
    """The KV part and 0..4 pool parts of one logical write, every region with its own kinds on
    each side, some pools with writes of their own, some parts empty."""
    kv = DescriptorPart("kv", draw(st.sampled_from(KINDS)), draw(st.sampled_from(KINDS)), False,
                        rows(1 << 20, draw(st.integers(1, 5))), rows(1 << 30, 0))
    kv = DescriptorPart(kv.label, kv.src_kind, kv.dst_kind, False, kv.src, rows(1 << 30, len(kv.src)))
    parts = [kv]
    for i in range(draw(st.integers(0, 4))):
        n = draw(st.integers(0, 3))
        parts.append(DescriptorPart(f"pool{i}", draw(st.sampled_from(KINDS)), draw(st.sampled_from(KINDS)),
                                    draw(st.booleans()), rows((2 + i) << 20, n), rows((40 + i) << 20, n)))
    return parts


@settings(max_examples=300, deadline=None)
@given(logical_writes())
def test_groups_never_mix_kinds_and_cover_every_row_once(parts):
    groups = group_parts(parts)
    owner = {}   # (src addr, dst addr) -> (src kind, dst kind) of the part it came from
    for p in parts:
        for s, d in zip(p.src[:, 0].tolist(), p.dst[:, 0].tolist()):
            owner[(s, d)] = (p.src_kind, p.dst_kind, p.label if p.own else "")
    seen = []
    for g in groups:
        assert len(g.src) == len(g.dst) > 0
        pairs = list(zip(g.src[:, 0].tolist(), g.dst[:, 0].tolist()))
        keys = {owner[x] for x in pairs}
        assert len(keys) == 1, f"a group mixes {keys}"
        assert next(iter(keys))[:2] == (g.src_kind, g.dst_kind)
        seen += pairs
    assert sorted(seen) == sorted(owner), "every row in exactly one group"
    wanted = {(p.src_kind, p.dst_kind, p.label if p.own else "") for p in parts if len(p.src)}
    assert len(groups) == len(wanted), "one backend write per pair of kinds (own pools apart)"
    assert groups[0].labels[0] == "kv", "the KV's group comes first"


def test_a_host_pool_beside_a_device_cache_is_a_write_of_its_own():
    kv = DescriptorPart("kv", "VRAM", "VRAM", False, rows(1 << 20, 4), rows(1 << 30, 4))
    aux = DescriptorPart("aux", "DRAM", "DRAM", False, rows(2 << 20, 1), rows(3 << 20, 1))
    ssm = DescriptorPart("ssm", "VRAM", "VRAM", False, rows(4 << 20, 2), rows(5 << 20, 2))
    groups = group_parts([kv, aux, ssm])
    assert [(g.src_kind, g.dst_kind, g.labels) for g in groups] == [("VRAM", "VRAM", ("kv", "ssm")),
                                                                   ("DRAM", "DRAM", ("aux",))]
    assert [len(g.src) for g in groups] == [6, 1] and groups[1].nbytes == 64


def test_rows_that_do_not_pair_up_are_refused():
    with pytest.raises(ValueError, match="aux: 2 source rows for 1 destination rows"):
        group_parts([DescriptorPart("aux", "DRAM", "DRAM", False, rows(1, 2), rows(9, 1))])


def tracker(pages: int = 4, final_extra: int = 100) -> RoomTracker:
    return RoomTracker(num_pages=pages, writer_page_bytes={0: 1000}, final_extra={0: final_extra})


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 5).flatmap(lambda n: st.tuples(st.just(n), st.permutations(range(n)),
                                                     st.lists(st.integers(0, n - 1), max_size=3))))
def test_a_split_write_counts_once_every_group_landed(args):
    groups, order, dupes = args
    t = tracker()
    t.arrive_direct(0, 0, 0, 3, 3000)
    want_bytes = 1000 + 100
    arrived = []
    for g in order:
        for d in [x for x in dupes if x in arrived]:   # a group seen again is a duplicate, nothing more
            assert t.arrive_direct(0, 1, 3, 1, want_bytes, d, groups).outcome is Outcome.DUPLICATE
        last = len(arrived) == groups - 1
        assert t.group_completes((0, 1, 3, 1), g, groups) is last
        outcome = t.arrive_direct(0, 1, 3, 1, want_bytes, g, groups).outcome
        arrived.append(g)
        assert outcome is (Outcome.ACCEPTED if last else Outcome.PARTIAL)
        assert t.complete is last
    assert t.arrive_direct(0, 1, 3, 1, want_bytes, order[0], groups).outcome is Outcome.DUPLICATE


@pytest.mark.parametrize("group, groups, second, match", [
    (2, 2, None, "group 2 of 2 is not a group"), (0, 17, None, "group 0 of 17"), (-1, 3, None, "group -1 of 3"),
    (0, 2, 3, "came as 2 and as 3 groups"),
])
def test_groups_that_do_not_add_up_are_rejected(group, groups, second, match):
    t = tracker(pages=1)
    out = t.arrive_direct(0, 0, 0, 1, 1100, group, groups)
    if second is not None:
        assert out.outcome is Outcome.PARTIAL
        out = t.arrive_direct(0, 0, 0, 1, 1100, 1, second)
    assert out.outcome is Outcome.REJECTED and match in out.reason


def test_a_split_write_of_the_wrong_size_is_rejected_when_it_completes():
    t = tracker(pages=1)
    assert t.arrive_direct(0, 0, 0, 1, 999, 0, 2).outcome is Outcome.PARTIAL
    out = t.arrive_direct(0, 0, 0, 1, 999, 1, 2)
    assert out.outcome is Outcome.REJECTED and "expected 1100" in out.reason


def test_buffer_regions_are_the_kv_then_each_pool_with_its_own_kind():
    """A CUDA cache with SGLang's host aux rows (the cache faked: only its device is read as
    data, no CUDA call is made) gives a VRAM KV region and a DRAM aux region."""
    aux = StatePool(tensors=[torch.zeros(4, 8), torch.zeros(4, 2, dtype=torch.int64)])
    k = SimpleNamespace(data_ptr=lambda: 1 << 40, numel=lambda: 1024, element_size=lambda: 2)
    kv = SimpleNamespace(device=torch.device("cuda:3"), kind="VRAM", tensors=lambda: [k, k], pools={"aux": aux})
    regions = buffer_regions(kv)
    assert [(r.name, r.kind, str(r.device)) for r in regions] == [("kv", "VRAM", "cuda:3"),
                                                                  ("pool 'aux'", "DRAM", "cpu")]
    assert {s.device for s in regions[0].spans} == {3} and {s.kind for s in regions[1].spans} == {"DRAM"}
    assert regions[1].nbytes == 4 * 8 * 4 + 4 * 2 * 8
    assert unregistrable(regions, ("DRAM",), "mooncake") == (
        "the kv region is VRAM memory (on cuda:3), which this mooncake build cannot register (it handles DRAM)")
    assert unregistrable(regions, ("DRAM", "VRAM"), "nixl") is None


def test_a_peer_region_of_a_kind_the_build_cannot_write_is_named():
    got = unwritable_peer_kinds("VRAM", "VRAM", {"aux": "DRAM", "ssm": "VRAM"}, ("DRAM",), "mooncake")
    assert got == [f"the peer's {n} region is VRAM memory, which this mooncake build cannot write into (it handles "
                   f"DRAM)" for n in ("kv", "staging ring", "pool 'ssm'")]
    assert unwritable_peer_kinds("VRAM", None, {"aux": "DRAM"}, ("DRAM", "VRAM"), "nixl") == []
