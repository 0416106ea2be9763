"""The rules of layer-wise input (transfer/protocol/prefill/layer_sends.py): which (page, layer) pairs a
send covers, what is refused, and how sends become write units."""

import numpy as np
import pytest

from kvstage.transfer.protocol.prefill.layer_sends import LayerGrouper, SendLedger, SendStep, check_layers, group_size

STAGE = range(0, 6)


def ledger(n=4, stage=STAGE):
    led = SendLedger(room=7, stage=stage)
    led.set_page_count(n)
    return led


def send(led, pages, layers=None, last=None):
    arr = np.asarray(pages, dtype=np.int64)
    step = led.check(arr, layers, last)
    led.record(step, arr)
    return step


def test_each_layer_advances_on_its_own_and_the_request_ends_when_every_cell_was_sent():
    led = ledger()
    assert send(led, [10, 11], range(0, 3)).page_start == 0
    step = send(led, [10, 11], range(3, 6))
    assert (step.page_start, step.num_pages, step.layers, step.last) == (0, 2, range(3, 6), False)
    assert send(led, [12, 13], range(3, 6)).page_start == 2    # layers 3-5 run ahead of 0-2
    last = send(led, [12, 13], range(0, 3))
    assert last.last and last.page_start == 2 and led.ended


def test_a_send_without_layers_is_every_layer():
    led = ledger()
    step = send(led, [1, 2, 3, 4])
    assert step.layers == STAGE and step.last


@pytest.mark.parametrize("layers, match", [
    (range(0, 7), r"outside this rank's layers \[0, 6\)"),
    (range(-1, 2), "outside"),
    (range(2, 2), "is empty"),
    (range(0, 6, 2), "step 1"),
    ([0, 1], "must be a range"),
])
def test_bad_layer_ranges_are_refused(layers, match):
    with pytest.raises(ValueError, match=match):
        check_layers(7, layers, STAGE)
    led = ledger()
    with pytest.raises(ValueError, match=match):
        led.check(np.array([1]), layers, None)


def test_a_cell_sent_twice_is_refused_and_changes_nothing():
    led = ledger()
    send(led, [10, 11], range(0, 2))
    with pytest.raises(ValueError, match=r"\(page 10, layers \[0, 2\)\) was already sent"):
        led.check(np.array([10]), range(0, 2), None)
    # the layers that have not moved yet take the same pages without complaint
    assert led.check(np.array([10, 11]), range(2, 4), None).page_start == 0


def test_pages_must_agree_with_what_other_layers_sent_there():
    led = ledger()
    send(led, [10, 11], range(0, 2))
    with pytest.raises(ValueError, match="page 12 at position 1 differs from page 11"):
        led.check(np.array([10, 12]), range(2, 4), None)


def test_layers_at_different_positions_cannot_be_sent_together():
    led = ledger()
    send(led, [10, 11], range(0, 2))
    with pytest.raises(ValueError, match=r"layers \[0, 4\) are at different pages"):
        led.check(np.array([12]), range(0, 4), None)


def test_after_the_end_and_before_the_count_sends_are_refused():
    led = SendLedger(room=7, stage=STAGE)
    with pytest.raises(ValueError, match="before init"):
        led.check(np.array([1]), None, None)
    led.set_page_count(1)
    send(led, [1])
    with pytest.raises(ValueError, match="after the last chunk"):
        led.check(np.array([2]), range(0, 1), None)


def test_too_many_pages_for_a_layer_and_a_last_that_leaves_cells_unsent_are_refused():
    led = ledger(n=2)
    with pytest.raises(ValueError, match=r"3 pages sent for layers \[0, 1\), the sender was created for 2"):
        led.check(np.array([1, 2, 3]), range(0, 1), None)
    send(led, [1, 2], range(0, 3))
    with pytest.raises(ValueError, match="layer 3 is at page 0 of 2"):
        led.check(np.array([], dtype=np.int64), range(0, 3), True)


def test_a_pp_stage_sends_its_own_layers_only():
    led = ledger(n=1, stage=range(4, 8))
    with pytest.raises(ValueError, match=r"outside this rank's layers \[4, 8\)"):
        led.check(np.array([1]), range(0, 4), None)
    assert send(led, [1], range(4, 8)).last


@pytest.mark.parametrize("size, min_tokens, tokens, want", [
    (2, 0, 10, 2), (0, 0, 10, 6), (2, 100, 99, 6), (2, 100, 100, 2), (9, 0, 10, 6)])
def test_group_size_is_the_whole_stage_below_the_threshold(size, min_tokens, tokens, want):
    assert group_size(layer_group=size, min_tokens=min_tokens, num_tokens=tokens, stage=STAGE) == want


def units(grouper, *sends):
    out = []
    for start, pages, layers, last in sends:
        step = SendStep(page_start=start, num_pages=len(pages), layers=layers, last=last)
        out += [(u.page_start, list(u.pages), u.layers, u.ready) for u in
                grouper.add(step, np.array(pages), ready=(f"r{layers.start}",))]
    return out


def test_single_layers_are_held_until_their_group_is_complete():
    g = LayerGrouper(stage=STAGE, size=3)
    assert units(g, (0, [5], range(0, 1), False), (0, [5], range(1, 2), False)) == []
    assert units(g, (0, [5], range(2, 3), False)) == [(0, [5], range(0, 3), ("r0", "r1", "r2"))]


def test_a_send_of_whole_groups_stays_one_unit_and_partial_groups_wait():
    g = LayerGrouper(stage=STAGE, size=2)
    assert units(g, (0, [5, 6], range(0, 6), True)) == [(0, [5, 6], range(0, 6), ("r0",))]
    g = LayerGrouper(stage=STAGE, size=2)
    got = units(g, (0, [5], range(1, 5), False))
    assert got == [(0, [5], range(2, 4), ("r1",))]   # layer 1 waits for 0, layer 4 for 5
    assert units(g, (0, [5], range(0, 1), False), (0, [5], range(5, 6), False)) == [
        (0, [5], range(0, 2), ("r1", "r0")), (0, [5], range(4, 6), ("r1", "r5"))]


def test_what_is_held_when_the_input_ends_goes_out_in_runs_of_consecutive_layers():
    g = LayerGrouper(stage=STAGE, size=6)
    got = units(g, (0, [5], range(0, 2), False), (0, [5], range(3, 4), False), (1, [6], range(0, 6), False),
                (0, [5], range(5, 6), True))
    assert got == [(1, [6], range(0, 6), ("r0",)), (0, [5], range(0, 2), ("r0", "r3", "r5")),
                   (0, [5], range(3, 4), ("r0", "r3", "r5")), (0, [5], range(5, 6), ("r0", "r3", "r5"))]
