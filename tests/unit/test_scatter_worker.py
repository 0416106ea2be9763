"""The decode scatter thread on CPU tensors: a landed piece reaches the cache through its named
parts, and a part whose digest is not the sent one is never scattered. A small piece runs on the
calling thread instead (`run_here`) with the same outcome; a larger one is not taken there."""

import queue

import numpy as np
import pytest
import torch

from kvstage.staging.digests import digest
from kvstage.staging.gather_scatter import Gatherer
from kvstage.staging.workers import LandedPart, PartDigest, ScatterJob, ScatterWorker
from kvstage.transfer.protocol.kinds import FailureKind

PAGE, HEADS, HEAD_BYTES, PAGES = 2, 4, 8, 6


def cache(gen=None):
    shape = (PAGES * PAGE, HEADS, HEAD_BYTES)
    make = (lambda: torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)) if gen else (
        lambda: torch.zeros(shape, dtype=torch.uint8))
    return [make()], [make()]


def run(job, here=False):
    """One job through a real ScatterWorker, on its thread or (`here`) on this one; its report
    as a dict."""
    dst_k, dst_v = cache()
    reports: queue.SimpleQueue = queue.SimpleQueue()
    worker = ScatterWorker(dst_k, dst_v, PAGE, report=lambda *a: reports.put(a), inline_max_bytes=1 << 20)
    try:
        if here:
            assert worker.takes_here(job)
            worker.run_here(job)
            room, key, ok, reason, _seconds, kind = reports.get_nowait()   # reported before run_here returned
        else:
            worker.submit(job)
            room, key, ok, reason, _seconds, kind = reports.get(timeout=30)
    finally:
        worker.stop()
    return dict(room=room, key=key, ok=ok, reason=reason, kind=kind), dst_k, dst_v


def landed():
    """Pages [4, 1] x heads [1, 3) of a random cache, gathered as a writer would stage them."""
    src_k, src_v = cache(torch.Generator().manual_seed(7))
    ring = torch.empty(1 << 12, dtype=torch.uint8)
    pages = torch.tensor([4, 1])
    n = Gatherer().gather(src_k, src_v, pages, PAGE, (1, 3), ring)
    return src_k, src_v, ring[:n]


def expect_rows(src, dst, pages, touched):
    for p in range(PAGES):
        rows = slice(p * PAGE, (p + 1) * PAGE)
        if touched:
            assert torch.equal(dst[rows, 1:3], src[rows, 1:3]) == (p in pages), p
        else:
            assert not dst[rows].any(), p
    assert not dst[:, 0].any() and not dst[:, 3].any()   # heads outside the part stay as they were


@pytest.mark.parametrize("here", [False, True], ids=["thread", "here"])
def test_a_checked_part_lands_in_its_heads(here):
    src_k, src_v, view = landed()
    job = ScatterJob(room=3, key=(0, 1), pages=np.array([4, 1]), layers=range(1),
                     parts=(LandedPart(view, (1, 3)),),
                     checks=(PartDigest(view=view, digest=digest(view), writer=2),))
    report, dst_k, dst_v = run(job, here)
    assert report == dict(room=3, key=(0, 1), ok=True, reason=None, kind=FailureKind.SCATTER)
    expect_rows(src_k[0], dst_k[0], {4, 1}, touched=True)
    expect_rows(src_v[0], dst_v[0], {4, 1}, touched=True)


@pytest.mark.parametrize("here", [False, True], ids=["thread", "here"])
def test_a_part_with_a_wrong_digest_is_not_scattered(here):
    _, _, view = landed()
    sent = digest(view) ^ 1
    job = ScatterJob(room=3, key=(0, 1), pages=np.array([4, 1]), layers=range(1),
                     parts=(LandedPart(view, (1, 3)),),
                     checks=(PartDigest(view=view, digest=digest(view), writer=0),
                             PartDigest(view=view, digest=sent, writer=5)))
    report, dst_k, dst_v = run(job, here)
    assert (report["ok"], report["kind"]) == (False, FailureKind.CORRUPT)
    assert report["reason"] == (f"corrupt data in chunk 0 piece 1: writer 5: the landed bytes' digest "
                                f"{digest(view):#018x} is not the sent {sent:#018x}")
    expect_rows(None, dst_k[0], set(), touched=False)
    expect_rows(None, dst_v[0], set(), touched=False)


def test_a_layer_group_lands_in_its_layers_only():
    """A layer-wise piece holds K of its layers, then V of them: scattered into exactly those."""
    gen = torch.Generator().manual_seed(3)
    shape = (PAGES * PAGE, HEADS, HEAD_BYTES)
    src_k = [torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen) for _ in range(3)]
    src_v = [torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen) for _ in range(3)]
    ring = torch.empty(1 << 12, dtype=torch.uint8)
    n = Gatherer().gather(src_k[1:3], src_v[1:3], torch.tensor([4, 1]), PAGE, (1, 3), ring)
    dst_k = [torch.zeros(shape, dtype=torch.uint8) for _ in range(3)]
    dst_v = [torch.zeros(shape, dtype=torch.uint8) for _ in range(3)]
    reports: queue.SimpleQueue = queue.SimpleQueue()
    worker = ScatterWorker(dst_k, dst_v, PAGE, report=lambda *a: reports.put(a))
    try:
        worker.submit(ScatterJob(room=3, key=(0, 0), pages=np.array([4, 1]), layers=range(1, 3),
                                 parts=(LandedPart(ring[:n], (1, 3)),)))
        assert reports.get(timeout=30)[2] is True
    finally:
        worker.stop()
    assert not dst_k[0].any() and not dst_v[0].any()
    for layer in (1, 2):
        for src, dst in ((src_k, dst_k), (src_v, dst_v)):
            expect_rows(src[layer], dst[layer], [4, 1], touched=True)


def test_only_a_piece_up_to_the_limit_is_taken_here():
    _, _, view = landed()
    job = ScatterJob(room=3, key=(0, 1), pages=np.array([4, 1]), layers=range(1), parts=(LandedPart(view, (1, 3)),))
    assert job.nbytes == view.numel() > 0
    dst_k, dst_v = cache()
    for limit, taken in ((0, False), (job.nbytes - 1, False), (job.nbytes, True)):
        worker = ScatterWorker(dst_k, dst_v, PAGE, report=lambda *a: None, inline_max_bytes=limit)
        try:
            assert worker.takes_here(job) is taken, limit
        finally:
            worker.stop()
