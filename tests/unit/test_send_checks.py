"""A sender's input rules, written once (protocol/prefill/layer_sends.py): the
prefill room refuses what the caller's handle refuses, in the same words."""

import itertools

import numpy as np
import pytest
import torch

from kvstage.transfer.config import Timeouts
from kvstage.transfer.engine.handles import KVSender, RoomStatus
from kvstage.transfer.layout import KVLayout
from kvstage.transfer.protocol.prefill.layer_sends import check_late_items, check_page_count
from kvstage.transfer.protocol.prefill.room import PrefillRoom

LAYOUT = KVLayout(num_layers=2, total_kv_heads=2, head_dim=4, dtype=torch.uint8, page_size=2, tp_size=1, tp_rank=0, mla=False)


def room(n):
    return PrefillRoom(room=7, num_pages=n, layout=LAYOUT, me=1000, now=0.0, timeouts=Timeouts(), op_ids=itertools.count(1))


CASES = [  # (num_pages, chunks already sent (size, last), this chunk's size, last) -> the refusal
    (None, [], 2, None, "send\\(\\) before init\\(\\)"),
    (4, [(4, None)], 1, None, "send\\(\\) after the last chunk"),
    (4, [(2, False)], 3, None, "5 pages sent, the sender was created for 4"),
    (4, [], 2, True, "the last chunk ends at page 2 of 4"),
]


@pytest.mark.parametrize("n,before,size,last,match", CASES)
def test_room_and_handle_refuse_alike(n, before, size, last, match):
    r, sent = room(n), 0
    h = KVSender(lambda ev: None, 100, 7, n, RoomStatus(), layers=LAYOUT.layers)
    for s, lst in before:
        r.add_chunk(np.arange(sent, sent + s), lst, 0.0)
        h.send(np.arange(sent, sent + s), lst)
        sent += s
    with pytest.raises(ValueError, match=match):
        h.send(np.arange(sent, sent + size), last)
    with pytest.raises(ValueError, match=match):
        r.add_chunk(np.arange(sent, sent + size), last, 1.0)
    assert r.pages_given == sent    # nothing of a refused chunk is kept


def test_last_is_inferred_from_the_count():
    r = room(4)
    r.add_chunk(np.arange(2), None, 0.0)
    assert not r.last
    r.add_chunk(np.arange(2, 4), None, 0.0)
    assert r.last


@pytest.mark.parametrize("given, late, last, match", [
    ({}, {"aux": np.array([1])}, False, "with the last send only"),
    ({"aux": np.array([1])}, {"aux": np.array([2])}, True, r"pool\(s\) aux were given at init\(\) and again"),
])
def test_late_pool_items_rules(given, late, last, match):
    with pytest.raises(ValueError, match=match):
        check_late_items(7, given, late, last)
    check_late_items(7, given, {}, last)                                   # nothing late: nothing to check
    check_late_items(7, {"other": np.array([1])}, late, True)              # another pool's, on the last send


@pytest.mark.parametrize("current,n,match", [(4, 4, "init\\(\\) called twice"), (None, 0, "positive int"),
                                              (None, True, "positive int"), (None, 2.0, "positive int")])
def test_page_count_rules(current, n, match):
    with pytest.raises(ValueError, match=match):
        check_page_count(7, current, n)
    if current is None:
        with pytest.raises(ValueError, match=match):
            room(None).init(n, 0.0)
