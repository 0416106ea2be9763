"""The control loop's lateness record (transfer/engine/loop.py, Lateness): its maxima go to
stats() every tick, and a backend step or a tick held up by a quarter lease or more is a
warning naming the rank and which of the two it was, at most one each 10 s."""

import logging

from kvstage.transfer.engine.loop import Lateness
from kvstage.transfer.engine.stats import Stats


def test_a_long_backend_step_and_a_late_tick_are_warned_once_each_interval(caplog):
    late = Lateness(who="prefill rank 0 of p", warn_s=2.5)
    stats = Stats()
    with caplog.at_level(logging.WARNING, logger="kvstage"):
        late.step(0.5, now=100.0)                 # short: nothing said
        late.tick(1.0, stats, now=100.0)
        assert caplog.records == []
        late.step(12.3, now=101.0)
        late.step(13.0, now=105.0)                # within 10 s of the last warning: counted, not said
        late.tick(20.0, stats, now=111.5)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2, said
    assert said[0].startswith("kvstage prefill rank 0 of p: a backend call held its control thread for 12.3 s"), said
    assert said[1].startswith("kvstage prefill rank 0 of p: its control loop ran 20.0 s late"), said
    snap = stats.snapshot()
    assert snap["backend_step_max_s"] == 13.0 and snap["ctrl_tick_late_max_s"] == 20.0


def test_no_threshold_no_warning(caplog):
    late = Lateness()
    with caplog.at_level(logging.WARNING, logger="kvstage"):
        late.step(1e6, now=0.0)
        late.tick(1e6, Stats(), now=0.0)
    assert caplog.records == []
