"""The fleet simulator (kvstage.sim.fleet) at a small size: every invariant holds, and a broken
write path or ring is caught by its checks. The large runs are examples/fleet_sim.py's."""

import dataclasses

import numpy as np
import pytest

from kvstage.sim.fleet import Fleet, FleetConfig, Model
from kvstage.sim.network import NetworkModel
from kvstage.sim.report import room_memory, summarize

SMALL = FleetConfig(prefill_engines=4, decode_engines=4, prefill_tp=(2, 4), decode_tp=(1, 2, 4),
                    models=(Model(name="gqa", mla=False, heads=4, layers=3, page_size=4),
                            Model(name="mla", mla=True, heads=1, layers=3, page_size=16)),
                    requests=90, in_flight=40, pages=(1, 12), layerwise=0.4, prefix=0.4, aborts=0.1, deaths=2,
                    ring_bytes=64 << 10, buffer_bytes=16 << 10, seed=3)


@pytest.mark.parametrize("loss", [0.0, 0.01])
def test_small_fleet_ends_every_request_cleanly_and_counts_what_it_measures(loss):
    fleet = Fleet(dataclasses.replace(SMALL, network=NetworkModel(loss=loss)))
    memory = {}
    fleet.at(0.03, "hook", lambda: memory.update(room_memory(fleet, 20)))
    fleet.run()
    out = summarize(fleet, 0.0)
    assert out["invariants_broken"] == []
    assert len(fleet.requests) == SMALL.requests - fleet.refused and not fleet.open
    assert out["requests"].get("success", 0) > SMALL.requests // 2          # most succeed
    assert sum(out["requests"].values()) == len(fleet.requests)
    assert fleet.ring_occ and out["ring"]["overlaps"] == 0                  # the staged path ran
    assert out["messages_per_request"]["AllocGrant"] > 0
    assert len(fleet.deaths) == 2 and fleet.detect and out["death"]["requests_failed"] > 0
    assert min(fleet.detect) > SMALL.timeouts.lease - SMALL.timeouts.heartbeat   # noticed by the lease
    assert 0 < fleet.lookups < SMALL.requests
    assert memory["decode"]["sampled"] and memory["decode"]["mean_bytes"] > 0
    assert (fleet.net.lost > 0) == (loss > 0)


class MisplacedWrites(Fleet):
    """A shell that lands a direct write one page off."""

    def _cover(self, req, p, d, src, dst, layers, src_heads, dst_heads, what):
        if what == "write" and dst.size > 1:
            dst = np.roll(dst, 1)
        super()._cover(req, p, d, src, dst, layers, src_heads, dst_heads, what)


class IgnoresWatermark(Fleet):
    """A writer that posts staged writes without waiting for the ring's watermark."""

    def _connect(self, d, p, staging):
        super()._connect(d, p, staging)
        view = self.remote_wm.get((p, d))
        if view is not None:
            view.allows = lambda start, nbytes: True


def test_a_write_to_the_wrong_page_is_caught():
    fleet = MisplacedWrites(dataclasses.replace(SMALL, deaths=0, aborts=0.0, pages=(3, 12)))
    fleet.run()
    broken = fleet.check()
    assert any("source pages" in b for b in broken), broken


def test_a_writer_overrunning_the_ring_is_caught():
    cfg = dataclasses.replace(SMALL, deaths=0, aborts=0.0, ring_bytes=48 << 10, buffer_bytes=16 << 10,
                              models=SMALL.models[:1], pages=(8, 12), in_flight=60)
    fleet = IgnoresWatermark(cfg)
    fleet.run()
    broken = fleet.check()
    assert any("ring bytes another piece still held" in b for b in broken) or any("ring offset" in b for b in broken), broken
