"""The storage tier's pure parts: the batch file's layout and footer, read runs, the prefetch budget."""

import pytest

from kvstage.storage.batch_file import (
    ALIGN,
    Entry,
    FormatError,
    decode_footer,
    encode_tail,
    plan_batch,
    plan_reads,
)
from kvstage.storage.prefetch import GrantVerdict, PrefetchBudget, PrefetchMetrics


def test_slots_are_aligned_and_disjoint():
    lay = plan_batch([4096, 100, 8193, 4096])
    assert lay.offsets == (0, 4096, 8192, 20480)
    assert lay.data_bytes == 24576
    with pytest.raises(ValueError):
        plan_batch([0])


def test_footer_round_trip_and_refusals():
    entries = [Entry(kind="kv", key=f"h{i}", offset=i * ALIGN, nbytes=ALIGN, digest=i * 7) for i in range(3)]
    tail = encode_tail("ns", entries)
    assert len(tail) % ALIGN == 0
    size = 3 * ALIGN + len(tail)
    footer = decode_footer(tail, size)
    assert footer.namespace == "ns" and footer.entries == entries
    with pytest.raises(FormatError, match="magic"):
        decode_footer(tail[:-16] + b"XXXX" + tail[-12:], size)
    with pytest.raises(FormatError, match="version"):
        decode_footer(tail[:-12] + (99).to_bytes(4, "little") + tail[-8:], size)
    with pytest.raises(FormatError, match="outside"):   # a file cut short: its entries point past the data
        decode_footer(tail, 2 * ALIGN + len(tail))


def test_reads_group_by_file_and_split_at_the_buffer():
    e = lambda k, off: Entry(kind="kv", key=k, offset=off, nbytes=ALIGN, digest=0)
    wanted = [(0, 1, e("a", 0)), (1, 1, e("b", ALIGN)), (2, 2, e("c", 0)), (3, 1, e("d", 2 * ALIGN))]
    runs = plan_reads(wanted, max_bytes=1 << 20)
    assert sorted((r.file_id, r.offset, r.length) for r in runs) == [(1, 0, 3 * ALIGN), (2, 0, ALIGN)]
    run1 = next(r for r in runs if r.file_id == 1)
    assert [(i.index, i.at) for i in run1.items] == [(0, 0), (1, ALIGN), (3, 2 * ALIGN)]
    split = plan_reads(wanted, max_bytes=2 * ALIGN)
    assert sorted((r.file_id, r.offset, r.length) for r in split) == [(1, 0, 2 * ALIGN), (1, 2 * ALIGN, ALIGN),
                                                                       (2, 0, ALIGN)]
    gap = plan_reads([(0, 1, e("a", 0)), (1, 1, e("z", 64 * ALIGN))], max_bytes=1 << 30, max_gap=ALIGN)
    assert len(gap) == 2
    with pytest.raises(ValueError, match="exceeds"):
        plan_reads([(0, 1, e("a", 0))], max_bytes=ALIGN // 2)


def test_prefetch_never_takes_the_l2_reserve():
    b = PrefetchBudget(pool_tokens=1000, page_size=10, reserve_fraction=0.25)   # 250 tokens kept
    full = b.grant(5, free_tokens=1000)
    assert (full.granted, full.verdict) == (5, GrantVerdict.FULL)
    shrunk = b.grant(50, free_tokens=400)            # 150 spare tokens: 15 pages
    assert (shrunk.granted, shrunk.verdict) == (15, GrantVerdict.SHRUNK)
    none = b.grant(3, free_tokens=250)
    assert (none.granted, none.verdict) == (0, GrantVerdict.NONE)
    m = PrefetchMetrics()
    for g in (full, shrunk, none):
        m.add(g)
    assert m.as_dict() == {"prefetch_requests": 3, "prefetch_pages_requested": 58, "prefetch_pages_granted": 20,
                           "prefetch_shrunk": 1, "prefetch_refused": 1}
    with pytest.raises(ValueError):
        PrefetchBudget(pool_tokens=10, page_size=1, reserve_fraction=1.0)
