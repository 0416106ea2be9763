"""The one page-list validator (staging/page_lists.py): what it accepts, each refusal's message,
and that the handles (send()/init()) and the gather/scatter refuse a bad list with the same words."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstage.staging.gather_scatter import Gatherer, Scatterer
from kvstage.staging.page_lists import check_pages
from kvstage.transfer.engine.handles import KVReceiver, KVSender, RoomStatus


@pytest.mark.parametrize("pages", [[3, 0, 3], (1, 2), np.array([4, 1], np.uint16),
                                   torch.tensor([2, 0], dtype=torch.int32), [], np.zeros(0, np.float64),
                                   torch.zeros(0, dtype=torch.int64)])
def test_accepts_int_lists_arrays_and_tensors_as_int64(pages):
    got = check_pages(pages, 5, "x", unique=False)
    assert got.dtype == np.int64 and got.ndim == 1
    assert got.tolist() == (pages.tolist() if hasattr(pages, "tolist") else list(pages))


@pytest.mark.parametrize("pages, unique, message", [
    ([0, 5], False, "x: page index 5 is out of range for a cache of 5 pages"),
    ([2, -1, 9], False, "x: page index -1 is out of range for a cache of 5 pages"),   # the first bad one
    ([1.0, 2.0], False, "x: page indices must be integers, got float64"),
    (torch.tensor([1.0]), False, "x: page indices must be integers, got torch.float32"),
    (torch.tensor([True]), False, "x: page indices must be integers, got torch.bool"),
    ("12", False, "x: page indices must be integers, got <U2"),
    ([[0, 1]], False, "x: page indices must be 1-D, got shape (1, 2)"),
    (3, False, "x: page indices must be 1-D, got shape ()"),
    ([4, 1, 4, 2], True, "x: destination pages must be distinct (the list repeats page 4)"),
])
def test_refusals_name_what_is_wrong(pages, unique, message):
    with pytest.raises(ValueError) as exc:
        check_pages(pages, 5, "x", unique=unique)
    assert str(exc.value) == message


def test_repeats_are_fine_for_a_source_list():
    assert check_pages([4, 1, 4], 5, "x", unique=False).tolist() == [4, 1, 4]


def test_host_only_refuses_a_device_tensor():
    pages = torch.zeros(2, dtype=torch.int64, device="meta")
    with pytest.raises(ValueError, match="x: page indices must be a CPU tensor, got one on meta"):
        check_pages(pages, 5, "x", unique=False, host_only=True)


@pytest.mark.parametrize("make", [lambda: np.array([1, 2], np.int64), lambda: torch.tensor([1, 2])])
def test_copy_never_shares_the_callers_memory(make):
    pages = make()
    kept = check_pages(pages, 5, "x", unique=False, copy=True)
    pages[0] = 4
    assert kept.tolist() == [1, 2]


def test_handles_and_scatter_refuse_with_the_same_words():
    """send()/init() and gather/scatter run the same validator: only the call named differs."""
    k = [torch.zeros(8, 1, 4, dtype=torch.uint8)]
    out = torch.zeros(64, dtype=torch.uint8)
    for bad, tail in (([0, 9], "page index 9 is out of range for a cache of 4 pages"),
                      ([2, 2], "destination pages must be distinct (the list repeats page 2)")):
        with pytest.raises(ValueError) as by_handle:
            KVReceiver(lambda e: None, 4, 7, "p", RoomStatus()).init(bad)
        with pytest.raises(ValueError) as by_scatter:
            Scatterer().scatter(out, k, None, bad, 2, (0, 1))
        assert str(by_handle.value) == f"room 7 init(): {tail}"
        assert str(by_scatter.value) == f"scatter: {tail}"
    with pytest.raises(ValueError) as by_sender:
        KVSender(lambda e: None, 4, 7, 2, RoomStatus()).send([0.5])
    with pytest.raises(ValueError) as by_gather:
        Gatherer().gather(k, None, [0.5], 2, (0, 1), out)
    assert str(by_sender.value) == "room 7 send(): page indices must be integers, got float64"
    assert str(by_gather.value) == "gather: page indices must be integers, got float64"
