"""A staging buffer's space (staging/buffer_space.py) and a transfer worker's pieces in flight
(staging/workers.py): a worker gathers its next piece while its earlier pieces' writes are still
in flight, into parts of its buffer no write in flight reads, and the write's completion reports
the piece where the backend completes it."""

import queue
import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstage.staging.buffer_space import BufferSpace, Extents, SpaceClosed
from kvstage.staging.buffers import StagingBuffer
from kvstage.staging.workers import GatherJob, TransferWorkers


# ------------------------------------------------------------------------------ the rule (pure)
def test_first_fit_reuses_a_freed_gap_and_aligns_every_part():
    e = Extents(10_000, 1024)
    a, b, c = e.place(1000), e.place(1000), e.place(1000)
    assert (a, b, c) == (0, 1024, 2048)
    e.free(b)
    assert e.place(1024) == 1024            # the freed gap, exactly
    assert e.place(5000) == 3072            # after c, aligned
    assert e.place(2000) is None            # 8072 + 2000 > 10,000: waits for a write to complete
    e.free(a)
    assert e.place(100) == 0
    assert e.peak == 4


def test_a_part_larger_than_the_buffer_is_refused_and_a_double_free_raises():
    e = Extents(4096, 4096)
    with pytest.raises(ValueError, match="does not fit a staging buffer of 4096"):
        e.place(4097)
    at = e.place(4096)
    assert e.place(1) is None
    e.free(at)
    with pytest.raises(KeyError):
        e.free(at)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 3000)), max_size=60))
def test_parts_in_use_never_overlap_and_stay_inside(moves):
    e = Extents(8192, 512)
    used: dict[int, int] = {}
    for free_one, n in moves:
        if free_one and used:
            at = sorted(used)[n % len(used)]
            e.free(at)
            del used[at]
            continue
        at = e.place(n)
        if at is None:   # nothing fits: every gap (and the tail) is too small for n
            continue
        assert at % 512 == 0 and at + n <= 8192
        assert all(at + n <= s or s + m <= at for s, m in used.items()), (at, n, used)
        used[at] = n
    assert len(e) == len(used)


# ---------------------------------------------------------------------------- the thread shell
def test_take_waits_for_a_give_and_close_wakes_a_waiter():
    space = BufferSpace(8192, 4096)
    first, second = space.take(4096), space.take(4096)
    got: queue.SimpleQueue = queue.SimpleQueue()
    t = threading.Thread(target=lambda: got.put(space.take(4096)))
    t.start()
    space.give(second)
    assert got.get(timeout=10) == second
    t.join(10)

    def closed():
        try:
            space.take(4096)
        except SpaceClosed as exc:
            got.put(exc)

    t = threading.Thread(target=closed)
    t.start()
    space.close()
    assert isinstance(got.get(timeout=10), SpaceClosed)
    t.join(10)
    space.give(first)
    assert space.in_use == 1


# ----------------------------------------------------- a worker's pieces in flight, one buffer
def test_one_worker_gathers_its_next_pieces_while_the_first_writes_are_in_flight():
    page_size, heads, head_dim = 2, 2, 4
    k = [torch.arange(8 * page_size * heads * head_dim, dtype=torch.float32).reshape(-1, heads, head_dim)]
    v = [k[0] + 1000]
    nbytes = 2 * page_size * heads * head_dim * 4   # one page of K and of V: 128 bytes
    pending: list = []                # the writes posted and not completed, as the backend holds them
    posted = threading.Semaphore(0)
    reports: queue.SimpleQueue = queue.SimpleQueue()

    def submit(peer, src, dst, tag, on_done, on_posted=None, *, dst_kind=None, room=None):
        pending.append((int(src[0, 0]), on_done))   # completes only when the test says so
        posted.release()

    def report(op_id, room, ok, reason, gather_s, tag):
        reports.put((op_id, ok, reason, threading.current_thread().name))

    buf = StagingBuffer.host(3 * 4096)   # three 4096-aligned parts
    workers = TransferWorkers([buf], k, v, page_size, submit, report)
    try:
        for op in range(4):
            workers.submit(GatherJob(op_id=op, room=7, peer="decode-0", pages=np.array([op]), heads=(0, heads),
                                     nbytes=nbytes, dst_addr=1 << 20, dst_device=0, tag=b"t", layers=range(1)))
        for _ in range(3):   # three pieces in flight from the one buffer, none completed
            assert posted.acquire(timeout=10), "the worker waited for a completion before its next piece"
        # the fourth waits in take(): the three parts of the buffer are read by writes in flight
        assert sorted(at for at, _ in pending) == [buf.addr, buf.addr + 4096, buf.addr + 8192]
        assert workers.spaces[0].peak == 3 and reports.empty()
        _, done = pending.pop(1)
        done(True, None)     # the backend's owner completes the second write: it reports there
        assert reports.get(timeout=10) == (1, True, None, threading.current_thread().name)
        assert posted.acquire(timeout=10), "the freed part was not reused"
        assert pending[-1][0] == buf.addr + 4096
        for _, done in pending:
            done(True, None)
        assert sorted(reports.get(timeout=10)[0] for _ in range(3)) == [0, 2, 3]
        assert workers.spaces[0].in_use == 0
    finally:
        workers.stop()
        buf.close()


# ------------------------------------------------- small pieces gathered by the calling thread
def test_run_here_gathers_and_posts_on_the_calling_thread_and_refuses_when_no_part_is_free():
    page_size, heads, head_dim = 2, 2, 4
    k = [torch.arange(8 * page_size * heads * head_dim, dtype=torch.float32).reshape(-1, heads, head_dim)]
    v = [k[0] + 1000]
    nbytes = 2 * page_size * heads * head_dim * 4
    posts: list = []

    def submit(peer, src, dst, tag, on_done, on_posted=None, *, dst_kind=None, room=None):
        posts.append((threading.current_thread().name, int(src[0, 0]), on_done))

    def report(*a):
        raise AssertionError("nothing completed, nothing failed: no report")

    def job(op, ready=()):
        return GatherJob(op_id=op, room=7, peer="decode-0", pages=np.array([op]), heads=(0, heads), nbytes=nbytes,
                         dst_addr=1 << 20, dst_device=0, tag=b"t", layers=range(1), ready=ready)

    bufs = [StagingBuffer.host(4096), StagingBuffer.host(4096)]
    workers = TransferWorkers(bufs, k, v, page_size, submit, report, inline_max_bytes=nbytes)
    try:
        assert workers.takes_here(job(0))
        assert not workers.takes_here(job(0, ready=(object(),)))   # its layers may not be written yet
        big = GatherJob(**{**job(0).__dict__, "nbytes": nbytes + 1})
        assert not workers.takes_here(big)
        assert workers.run_here(job(0)) and workers.run_here(job(1))   # one part of each buffer
        me = threading.current_thread().name
        assert [(t, at) for t, at, _ in posts] == [(me, bufs[0].addr), (me, bufs[1].addr)]
        assert bytes(bufs[0].tensor[:nbytes].numpy()) == k[0][0:2].numpy().tobytes() + v[0][0:2].numpy().tobytes()
        assert not workers.run_here(job(2)) and len(posts) == 2   # both buffers' parts in flight
    finally:
        workers.stop()
        for b in bufs:
            b.close()
