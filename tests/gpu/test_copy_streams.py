"""Each kvstage thread that copies on a GPU does so on a non-blocking stream of its own
(staging/copy_streams.py): a transfer worker's and the scatter worker's waits then cover their own
copies only; a decode room's pages prepared on the scatter thread (ScatterWorker.prepare) are
uploaded there once, before its first piece. Run by `make gpu-check` only (tests/gpu/conftest.py)."""

from __future__ import annotations

import ctypes
import queue
import threading

import numpy as np
import pytest
import torch

import kvstage.staging.workers as workers
from kvstage.staging.copy_streams import use_own_stream
from kvstage.staging.gather_scatter import Gatherer
from kvstage.staging.workers import LandedPart, ScatterJob, ScatterWorker

DEV = torch.device("cuda", 0)
NON_BLOCKING = 0x1   # cudaStreamNonBlocking


def _non_blocking(stream: torch.cuda.Stream) -> bool:
    """cudaStreamGetFlags through the CUDA runtime torch loaded."""
    name = next(n for n in ("libcudart.so.13", "libcudart.so.12", "libcudart.so") if _loads(n))
    flags = ctypes.c_uint()
    assert ctypes.CDLL(name).cudaStreamGetFlags(ctypes.c_void_p(stream.cuda_stream), ctypes.byref(flags)) == 0
    return bool(flags.value & NON_BLOCKING)


def _loads(name: str) -> bool:
    try:
        ctypes.CDLL(name)
    except OSError:
        return False
    return True


def test_a_thread_takes_a_non_blocking_stream_of_its_own_and_no_other_thread_changes():
    seen: queue.SimpleQueue = queue.SimpleQueue()

    def thread(enabled: bool) -> None:
        took = use_own_stream(DEV, enabled)
        seen.put((took, torch.cuda.current_stream(DEV)))

    for enabled in (True, True, False):
        t = threading.Thread(target=thread, args=(enabled,))
        t.start()
        t.join()
    (took_a, a), (took_b, b), (took_off, off) = (seen.get_nowait() for _ in range(3))
    default = torch.cuda.default_stream(DEV)
    assert (took_a, took_b, took_off) == (True, True, False)
    assert a != default and b != default and a != b
    assert off == default
    assert _non_blocking(a) and _non_blocking(b) and not _non_blocking(default)
    assert torch.cuda.current_stream(DEV) == default   # the calling thread's is untouched
    assert use_own_stream(torch.device("cpu"), True) is False


PAGE, SRC_PAGES = 4, [6, 1, 3]


def landed_piece(*, pages: int, seed: int):
    """Three layers of K and V (4 heads of 32 bytes, pages of 4 tokens) on the GPU, heads 1-2 of
    pages 6, 1 and 3 gathered into a ring, and zeroed destination caches: (src_k, src_v, the
    landed part, dst_k, dst_v)."""
    shape = (pages * PAGE, 4, 32)
    gen = torch.Generator().manual_seed(seed)
    src_k = [torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen).to(DEV) for _ in range(3)]
    src_v = [torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen).to(DEV) for _ in range(3)]
    ring = torch.empty(1 << 16, dtype=torch.uint8, device=DEV)
    n = Gatherer().gather(src_k, src_v, torch.tensor(SRC_PAGES), PAGE, (1, 3), ring)
    dst_k = [torch.zeros(shape, dtype=torch.uint8, device=DEV) for _ in range(3)]
    dst_v = [torch.zeros(shape, dtype=torch.uint8, device=DEV) for _ in range(3)]
    return src_k, src_v, LandedPart(ring[:n], (1, 3)), dst_k, dst_v


def assert_scattered(src: list, dst: list, dst_pages: list[int]) -> None:
    """Heads 1-2 of SRC_PAGES landed in `dst_pages`, bit-exact, and heads 0 and 3 untouched."""
    for s, d in zip(src, dst, strict=True):
        for sp, dp in zip(SRC_PAGES, dst_pages, strict=True):
            assert torch.equal(d[dp * PAGE:(dp + 1) * PAGE, 1:3], s[sp * PAGE:(sp + 1) * PAGE, 1:3])
        assert not d[:, 0].any() and not d[:, 3].any()


@pytest.mark.parametrize("own", [True, False], ids=["own-streams", "default-stream"])
def test_the_scatter_thread_copies_on_the_stream_the_option_says(monkeypatch, own):
    """The scatter thread takes its stream before its first scatter (or keeps the default one
    with the option off), and a landed piece reaches the cache bit-exact through it."""
    src_k, src_v, landed, dst_k, dst_v = landed_piece(pages=8, seed=5)
    streams: queue.SimpleQueue = queue.SimpleQueue()

    def spy(device: torch.device, enabled: bool) -> bool:
        took = use_own_stream(device, enabled)
        streams.put((threading.current_thread().name, torch.cuda.current_stream(device)))
        return took

    monkeypatch.setattr(workers, "use_own_stream", spy)
    reports: queue.SimpleQueue = queue.SimpleQueue()
    worker = ScatterWorker(dst_k, dst_v, PAGE, report=lambda *a: reports.put(a), own_streams=own)
    try:
        worker.submit(ScatterJob(room=1, key=(0, 0), pages=np.array([2, 7, 0]), layers=range(3),
                                 parts=(landed,)))
        _room, _key, ok, reason, _s, _kind = reports.get(timeout=60)
    finally:
        worker.stop()
    assert ok, reason
    name, stream = streams.get_nowait()
    assert name == "kvstage-scatter"
    assert (stream != torch.cuda.default_stream(DEV)) == own
    assert_scattered(src_k + src_v, dst_k + dst_v, [2, 7, 0])


def test_a_rooms_pages_prepared_on_the_scatter_thread_are_uploaded_once_and_scattered_bit_exact():
    """ScatterWorker.prepare on a GPU cache (a decode room's PrepareScatter): a list of several
    runs is validated and uploaded on the scatter thread before the room's first piece; that
    piece, a slice of it, finds it kept (one miss, one hit) and lands bit-exact."""
    src_k, src_v, landed, dst_k, dst_v = landed_piece(pages=16, seed=6)
    room_pages = np.array([11, 2, 9, 0, 14])
    reports: queue.SimpleQueue = queue.SimpleQueue()
    worker = ScatterWorker(dst_k, dst_v, PAGE, report=lambda *a: reports.put(a))
    try:
        worker.prepare(4, room_pages)
        worker.submit(ScatterJob(room=4, key=(0, 0), pages=room_pages[1:4], layers=range(3), parts=(landed,)))
        _room, _key, ok, reason, _s, _kind = reports.get(timeout=60)
        assert ok, reason
        assert (worker.plans.hits, worker.plans.misses) == (1, 1)
    finally:
        worker.stop()
    assert_scattered(src_k + src_v, dst_k + dst_v, [2, 9, 0])
