"""Page lists validated, indexed and uploaded once per room and list (staging/plan_cache.py):
a plan built from a kept list moves the same bytes as a fresh one, for the torch path and the
Triton kernels; a list is found by value, so a new or changed list, another cache size or the
other direction's rules never reuse a stale entry; releasing a room drops its lists; the cache
stays bounded. No timings here: the host time per call is measured by
examples/bench_gpu_kernels.py --host-only (docs/staging_kernels.md)."""

from __future__ import annotations

import queue

import numpy as np
import pytest
import torch

from kvstage.staging import triton_kernels as tk
from kvstage.staging.copy_plan import Direction
from kvstage.staging.gather_scatter import Gatherer, Scatterer, region_nbytes
from kvstage.staging.plan_cache import COUNTING, Counting, PlanCache, needs_upload
from kvstage.staging.workers import LandedPart, ScatterJob, ScatterWorker, TransferWorkers

DEVICE = torch.device("cuda" if torch.cuda.is_available() and not tk.interpreted() else "cpu")
LAYERS, PAGES, PS, HEADS, HD = 2, 12, 2, 4, 8
IMPLS = {"torch": (Gatherer, Scatterer), "triton": (tk.TritonGatherer, tk.TritonScatterer)}


def make_cache(seed, device=DEVICE, pages=PAGES):
    gen = torch.Generator().manual_seed(seed)

    def one():
        return torch.randint(0, 256, (pages * PS, HEADS, HD * 2), dtype=torch.uint8,
                             generator=gen).view(torch.bfloat16).to(device)

    return tuple(one() for _ in range(LAYERS)), tuple(one() for _ in range(LAYERS))


def region(n_pages, heads=(1, 3)):
    return torch.full((region_nbytes(LAYERS, True, n_pages * PS, heads[1] - heads[0], HD, 2),), 0xA5,
                      dtype=torch.uint8, device=DEVICE)


def raw(ts) -> list[bytes]:
    return [t.view(torch.uint8).cpu().numpy().tobytes() for t in ts]


def fresh_gather(k, v, pages, heads=(1, 3)):
    out = region(len(pages), heads)
    Gatherer().gather(list(k), list(v), np.array(pages), PS, heads, out)   # a new planner, lists: no reuse
    return out


@pytest.mark.parametrize("impl", IMPLS)
def test_a_kept_list_gathers_and_scatters_the_same_bytes_as_a_fresh_plan(impl):
    gcls, scls = IMPLS[impl]
    k, v = make_cache(1)
    plans = PlanCache()
    g, s = gcls(plans), scls(plans)
    pages = np.array([7, 2, 3, 11, 0])
    for _ in range(3):   # the first call keeps the list, the others find it
        out = region(len(pages))
        g.gather(k, v, pages, PS, (1, 3), out, room=5)
        assert torch.equal(out, fresh_gather(k, v, pages))
    assert plans.rooms() == [5] and len(plans) == 1 and plans.hits == 2
    dst_pages = np.array([4, 9, 1, 10, 6])  # scatter: unique pages, kept separately (other rules)
    want_k, want_v = make_cache(2)
    Scatterer().scatter(out, list(want_k), list(want_v), dst_pages.copy(), PS, (0, 2))
    for _ in range(2):
        got_k, got_v = make_cache(2)
        s.scatter(out, got_k, got_v, dst_pages, PS, (0, 2), room=5)
        assert raw(got_k) == raw(want_k) and raw(got_v) == raw(want_v)
    assert len(plans) == 2 and plans.hits == 3


def test_the_index_is_built_and_uploaded_once_per_list():
    k, v = make_cache(1)
    g = tk.TritonGatherer()
    pages = torch.tensor([3, 1, 4])
    first = g.plan(Direction.GATHER, k, v, pages, PS, (0, 4), region(3, (0, 4)), room=1)
    again = g.plan(Direction.GATHER, k, v, pages.clone(), PS, (1, 2), region(3, (1, 2)), room=1)  # equal values
    assert first.pages is again.pages and first.pages.device == k[0].device
    assert tk.kernel_launch(first).table is tk.kernel_launch(again).table   # one address table per cache
    assert g.plan(Direction.GATHER, k, v, pages, PS, (0, 4), region(3, (0, 4)), room=2).pages is not first.pages


def test_a_changed_list_is_never_served_from_a_stale_entry():
    """Same room, same array object, new values in it: validated and indexed anew."""
    k, v = make_cache(3)
    g = tk.TritonGatherer()
    pages = np.array([1, 2, 3, 4])
    out = region(4)
    g.gather(k, v, pages, PS, (1, 3), out, room=9)
    pages[:] = [10, 0, 5, 5]                 # the caller reuses its array
    g.gather(k, v, pages, PS, (1, 3), out, room=9)
    assert torch.equal(out, fresh_gather(k, v, [10, 0, 5, 5]))
    assert g.plans.hits == 0 and len(g.plans) == 2
    g.gather(k, v, np.array([1, 2, 3, 4], dtype=np.int32), PS, (1, 3), out, room=9)   # other dtype, same pages
    assert torch.equal(out, fresh_gather(k, v, [1, 2, 3, 4]))


def test_what_a_list_was_validated_against_is_part_of_its_key():
    k, v = make_cache(4)
    plans = PlanCache()
    g, s = Gatherer(plans), Scatterer(plans)
    g.gather(k, v, [2, 2, 11], PS, (0, 4), region(3, (0, 4)), room=1)   # a gather may repeat a page
    with pytest.raises(ValueError, match="destination pages must be distinct"):
        s.scatter(region(3, (0, 4)), k, v, [2, 2, 11], PS, (0, 4), room=1)
    small_k, small_v = make_cache(4, pages=6)   # a smaller cache: page 11 is out of range there
    with pytest.raises(ValueError, match="page index 11 is out of range for a cache of 6 pages"):
        g.gather(small_k, small_v, [2, 2, 11], PS, (0, 4), region(3, (0, 4)), room=1)


def test_releasing_a_room_drops_its_lists_and_only_its():
    plans = PlanCache()
    g = Gatherer(plans)
    k, v = make_cache(5)
    for room in (1, 2):
        for pages in ([0, 1], [5, 3, 8]):
            g.gather(k, v, pages, PS, (0, 4), region(len(pages), (0, 4)), room=room)
    assert sorted(plans.rooms()) == [1, 2] and len(plans) == 4 and plans.nbytes > 0
    g.forget_room(1)
    assert plans.rooms() == [2] and len(plans) == 2
    plans.forget(2)
    plans.forget(3)   # unknown: nothing to do
    assert not plans.rooms() and len(plans) == 0 and plans.nbytes == 0


def test_the_cache_is_bounded():
    plans = PlanCache(max_rooms=3, per_room=2, max_bytes=1 << 20)
    g = Gatherer(plans)
    k, v = make_cache(6)
    for room in range(5):
        for first in range(4):
            g.gather(k, v, [first, first + 1], PS, (0, 4), region(2, (0, 4)), room=room)
    assert plans.rooms() == [2, 3, 4] and len(plans) == 6   # the least recently used rooms went first
    small = PlanCache(max_rooms=10, per_room=10, max_bytes=200)   # 2 x 8 bytes per page: 6 lists of 2 pages
    g = Gatherer(small)
    for room in range(10):
        g.gather(k, v, [room, room + 1], PS, (0, 4), region(2, (0, 4)), room=room)
        assert small.nbytes <= 200
    assert small.rooms() == [4, 5, 6, 7, 8, 9]


def test_a_cache_swapped_under_a_kept_tuple_is_validated_again():
    """The same k/v tuples skip the memo key, never the address check (set_ gives new storage)."""
    g = tk.TritonGatherer()
    k, v = make_cache(7)
    out = region(2)
    g.gather(k, v, [4, 1], PS, (1, 3), out, room=1)
    k2, v2 = make_cache(8)
    for a, b in zip(k + v, k2 + v2, strict=True):
        a.set_(b)
    g.gather(k, v, [4, 1], PS, (1, 3), out, room=1)
    assert torch.equal(out, fresh_gather(k2, v2, [4, 1]))


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_fixed_caches_skip_the_address_check_of_the_same_tuples_only(monkeypatch, impl):
    """`caches_fixed` (the workers': the engine's caches are registered and never move): the same
    k/v tuples as the last call skip the address check of every tensor; new tuples are validated
    (a bad one raises), and without the flag the check runs on every call."""
    from kvstage.staging.copy_plan import PreparedCache

    checks = []
    real = PreparedCache.valid
    monkeypatch.setattr(PreparedCache, "valid", lambda self: checks.append(1) or real(self))
    k, v = make_cache(12)
    out = region(2)
    for fixed, want in ((True, 0), (False, 2)):
        g = IMPLS[impl][0](caches_fixed=fixed)
        checks.clear()
        for _ in range(3):
            g.gather(k, v, [4, 1], PS, (1, 3), out, room=1)
        assert len(checks) == want
        assert torch.equal(out, fresh_gather(k, v, [4, 1]))
        bad = (*k[:-1], k[-1][:, :2])   # new tuples, one tensor of other heads: validated again
        with pytest.raises(ValueError):
            g.gather(bad, v, [4, 1], PS, (1, 3), out, room=1)


def test_the_workers_share_one_cache_per_rank_and_release_rooms_in_it():
    k, v = make_cache(9, device=torch.device("cpu"))
    workers = TransferWorkers([], k, v, PS, submit=None, report=None)
    try:
        assert isinstance(workers.plans, PlanCache)
        workers.plans.pages(4, [1, 2], PAGES, "gather", unique=False)
        workers.forget_room(4)
        assert not workers.plans.rooms()
    finally:
        workers.stop()


def test_the_scatter_thread_keeps_a_rooms_list_until_the_room_is_released():
    src_k, src_v = make_cache(10, device=torch.device("cpu"))
    ring = torch.empty(region_nbytes(LAYERS, True, 2 * PS, 2, HD, 2), dtype=torch.uint8)
    Gatherer().gather(src_k, src_v, [4, 1], PS, (1, 3), ring)
    dst_k, dst_v = make_cache(11, device=torch.device("cpu"))
    want_k, want_v = [t.clone() for t in dst_k], [t.clone() for t in dst_v]
    Scatterer().scatter(ring, want_k, want_v, [7, 0], PS, (1, 3))
    reports: queue.SimpleQueue = queue.SimpleQueue()
    worker = ScatterWorker(dst_k, dst_v, PS, report=lambda *a: reports.put(a))
    try:
        for key in ((0, 0), (0, 1)):   # the same piece's pages twice: kept once, under the room
            worker.submit(ScatterJob(room=21, key=key, pages=np.array([7, 0]), layers=range(LAYERS),
                                     parts=(LandedPart(ring, (1, 3)),)))
            assert reports.get(timeout=30)[2] is True
        assert worker.plans.rooms() == [21] and len(worker.plans) == 1 and worker.plans.hits == 1
        assert raw(dst_k) == raw(want_k) and raw(dst_v) == raw(want_v)
        worker.forget_room(21)
        assert not worker.plans.rooms()
    finally:
        worker.stop()


@pytest.mark.parametrize("impl", IMPLS)
def test_a_rooms_pages_prepared_before_its_first_piece_are_found_kept(impl):
    """Planner.prepare (what the scatter thread does for a decode room's PrepareScatter): the
    room's destination array is validated and indexed before any piece lands; each piece, a
    slice of it, is then served from that entry (a hit, no new entry) and moves the same bytes."""
    _, scls = IMPLS[impl]
    src_k, src_v = make_cache(16)
    ring = region(2)
    Gatherer().gather(list(src_k), list(src_v), [4, 1], PS, (1, 3), ring)
    want_k, want_v = make_cache(17)
    got_k, got_v = make_cache(17)
    Scatterer().scatter(ring, list(want_k), list(want_v), [9, 2], PS, (1, 3))
    room_pages = np.array([5, 9, 2, 11])
    plans = PlanCache()
    s = scls(plans)
    assert s.prepare(Direction.SCATTER, got_k, got_v, room_pages, PS, room=22)
    assert (plans.hits, plans.misses, plans.rooms()) == (0, 1, [22])
    s.scatter(ring, got_k, got_v, room_pages[1:3], PS, (1, 3), room=22)
    assert (plans.hits, plans.misses, len(plans)) == (1, 1, 1)
    assert raw(got_k) == raw(want_k) and raw(got_v) == raw(want_v)
    cpu = torch.device("cpu")
    assert plans.prepare(1, room_pages[1:3], PAGES, "scatter", cpu, unique=True)          # a slice: its array
    assert not plans.prepare(2, [1, 2], PAGES, "scatter", cpu, unique=True)               # no array: per call
    assert not plans.prepare(3, np.array([1, 1]), PAGES, "scatter", cpu, unique=True)     # repeats
    assert not plans.prepare(4, np.array([1, 99]), PAGES, "scatter", cpu, unique=True)    # out of range
    assert plans.rooms() == [22, 1, 3]   # the list with repeats is kept (a gather may take it), never for a scatter


def test_only_a_list_that_would_be_uploaded_is_prepared_ahead():
    """needs_upload: a cache off the CPU and a list of more than one run; the scatter thread of
    a CPU cache does nothing for a prepare (its one scatter below is the room's only miss)."""
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert needs_upload(gpu, np.array([5, 9, 2])) and needs_upload(gpu, np.array([3, 4, 6], dtype=np.int32))
    assert not needs_upload(gpu, np.array([4, 5, 6])) and not needs_upload(gpu, np.array([7]))   # one run: a view
    assert not needs_upload(cpu, np.array([5, 9, 2])) and not needs_upload(gpu, [5, 9, 2])
    dst_k, dst_v = make_cache(18, device=cpu)
    ring = torch.zeros(region_nbytes(LAYERS, True, 2 * PS, 2, HD, 2), dtype=torch.uint8)
    reports: queue.SimpleQueue = queue.SimpleQueue()
    worker = ScatterWorker(dst_k, dst_v, PS, report=lambda *a: reports.put(a))
    try:
        room_pages = np.array([5, 9, 2, 11])
        worker.prepare(23, room_pages)
        worker.submit(ScatterJob(room=23, key=(0, 0), pages=room_pages[1:3], layers=range(LAYERS),
                                 parts=(LandedPart(ring, (1, 3)),)))
        assert reports.get(timeout=30)[2] is True
        assert (worker.plans.hits, worker.plans.misses) == (0, 1)
    finally:
        worker.stop()


@pytest.mark.parametrize("impl", IMPLS)
def test_pieces_of_a_rooms_list_share_one_validated_and_indexed_list(impl):
    """The protocol cuts a room's pieces out of the room's page array: the whole array is
    validated and indexed once, each piece's index is a view of it, and the bytes are a fresh
    plan's."""
    gcls, scls = IMPLS[impl]
    k, v = make_cache(12)
    plans = PlanCache()
    g, s = gcls(plans), scls(plans)
    room_pages = np.array([9, 3, 4, 5, 0, 11, 7, 2])
    pieces = [room_pages[0:3], room_pages[3:6], room_pages[6:8]]
    indexes = []
    for piece in pieces:
        out = region(piece.size)
        g.gather(k, v, piece, PS, (1, 3), out, room=4)
        assert torch.equal(out, fresh_gather(k, v, piece.tolist()))
        indexes.append(g.plan(Direction.GATHER, k, v, piece, PS, (1, 3), out, room=4).pages)
        want_k, want_v = make_cache(13)
        got_k, got_v = make_cache(13)
        Scatterer().scatter(out, list(want_k), list(want_v), piece.copy(), PS, (0, 2))
        s.scatter(out, got_k, got_v, piece, PS, (0, 2), room=4)
        assert raw(got_k) == raw(want_k) and raw(got_v) == raw(want_v)
    assert len(plans) == 1   # one entry: the room's whole list
    if impl == "triton":     # index tensors: views of one
        storages = {t.untyped_storage().data_ptr() for t in indexes}
        assert len(storages) == 1 and [t.tolist() for t in indexes] == [p.tolist() for p in pieces]


def test_a_run_of_consecutive_pages_is_a_view_of_the_counting_tensor_not_an_index_of_its_own():
    """A one-page piece, or any run of consecutive pages, is never uploaded: its index is a view
    of COUNTING (0, 1, 2, ...), and the bytes are a fresh plan's. A piece that is one run, cut
    from a room list that is not, is such a view too; the room's other pieces view its index."""
    k, v = make_cache(14)
    plans = PlanCache()
    g, s = tk.TritonGatherer(plans), tk.TritonScatterer(plans)
    room_pages = np.array([9, 3, 4, 5, 0])
    cases = [(1, np.array([4])), (2, np.array([6, 7, 8])), (3, np.arange(PAGES)),
             (4, room_pages[1:4]), (4, room_pages[3:5])]
    indexes = []
    for room, pages in cases:
        out = region(pages.size)
        g.gather(k, v, pages, PS, (1, 3), out, room=room)
        assert torch.equal(out, fresh_gather(k, v, pages.tolist()))
        indexes.append(g.plan(Direction.GATHER, k, v, pages, PS, (1, 3), out, room=room).pages)
        want_k, want_v = make_cache(15)
        got_k, got_v = make_cache(15)
        Scatterer().scatter(out, list(want_k), list(want_v), pages.copy(), PS, (0, 2))
        s.scatter(out, got_k, got_v, pages, PS, (0, 2), room=room)
        assert raw(got_k) == raw(want_k) and raw(got_v) == raw(want_v)
    assert [t.tolist() for t in indexes] == [p.tolist() for _, p in cases]
    counting = COUNTING.view(k[0].device, 0, 1).untyped_storage().data_ptr()   # keyed by the caches' device
    assert [t.untyped_storage().data_ptr() == counting for t in indexes] == [True, True, True, True, False]


def test_counting_views_keep_their_values_as_it_grows():
    c, cpu = Counting(), torch.device("cpu")
    first = c.view(cpu, 5, 3)
    far = c.view(cpu, Counting.MIN + 10, 4)    # past the first tensor: a larger one
    assert first.tolist() == [5, 6, 7] and far.tolist() == list(range(Counting.MIN + 10, Counting.MIN + 14))
    assert c.view(cpu, 0, 2).untyped_storage().data_ptr() == far.untyped_storage().data_ptr()
    assert first.untyped_storage().data_ptr() != far.untyped_storage().data_ptr()
    assert c.view(cpu, 3, 0).numel() == 0
    with pytest.raises(ValueError, match="starts at a page >= 0"):
        c.view(cpu, -1, 2)


def test_a_rooms_list_written_to_is_validated_again():
    k, v = make_cache(14)
    g = tk.TritonGatherer()
    room_pages = np.array([1, 2, 3, 4, 5, 6])
    out = region(3)
    g.gather(k, v, room_pages[3:], PS, (1, 3), out, room=1)
    room_pages[3:] = [11, 0, 0]
    g.gather(k, v, room_pages[3:], PS, (1, 3), out, room=1)
    assert torch.equal(out, fresh_gather(k, v, [11, 0, 0]))
    room_pages[0] = 99   # out of range, outside the piece: the piece alone is still valid
    g.gather(k, v, room_pages[3:], PS, (1, 3), out, room=1)
    assert torch.equal(out, fresh_gather(k, v, [11, 0, 0]))
    with pytest.raises(ValueError, match="^gather: page index 99 is out of range for a cache of 12 pages$"):
        g.gather(k, v, room_pages[:3], PS, (1, 3), out, room=1)


def test_a_piece_is_checked_for_repeats_on_its_own_where_the_whole_list_has_some():
    k, v = make_cache(15)
    s = tk.TritonScatterer()
    room_pages = np.array([1, 2, 1, 3])   # a gather list may repeat a page: the scatter rules apply per piece
    src = region(2)
    want_k, want_v = make_cache(16)
    Scatterer().scatter(src, list(want_k), list(want_v), [2, 1], PS, (1, 3))
    got_k, got_v = make_cache(16)
    s.scatter(src, got_k, got_v, room_pages[1:3], PS, (1, 3), room=2)
    assert raw(got_k) == raw(want_k) and raw(got_v) == raw(want_v)
    with pytest.raises(ValueError, match="destination pages must be distinct"):
        s.scatter(region(3), got_k, got_v, room_pages[0:3], PS, (1, 3), room=2)


def test_pieces_of_an_int32_list_are_compared_by_value():
    k, v = make_cache(17)
    plans = PlanCache()
    g = tk.TritonGatherer(plans)
    room_pages = np.array([6, 1, 8, 2], dtype=np.int32)
    for _ in range(2):
        for lo in (0, 2):
            out = region(2)
            g.gather(k, v, room_pages[lo:lo + 2], PS, (1, 3), out, room=3)
            assert torch.equal(out, fresh_gather(k, v, room_pages[lo:lo + 2].tolist()))
    assert len(plans) == 1 and plans.hits == 3   # one whole list, built once


def test_a_prepare_that_raises_leaves_the_scatter_thread_serving(monkeypatch):
    """A prepared list is a hint: its failure is logged, and the room's scatters still run."""
    import kvstage.staging.workers as workers

    def boom(*_a, **_k):
        raise RuntimeError("no device")

    monkeypatch.setattr(workers, "needs_upload", lambda device, pages: True)
    monkeypatch.setattr(Scatterer, "prepare", boom)
    dst_k, dst_v = make_cache(19, device=torch.device("cpu"))
    ring = torch.zeros(region_nbytes(LAYERS, True, 2 * PS, 2, HD, 2), dtype=torch.uint8)
    reports: queue.SimpleQueue = queue.SimpleQueue()
    worker = ScatterWorker(dst_k, dst_v, PS, report=lambda *a: reports.put(a))
    try:
        worker.prepare(24, np.array([5, 9, 2]))
        worker.submit(ScatterJob(room=24, key=(0, 0), pages=np.array([9, 2]), layers=range(LAYERS),
                                 parts=(LandedPart(ring, (1, 3)),)))
        assert reports.get(timeout=30)[2] is True
    finally:
        worker.stop()
