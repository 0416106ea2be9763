"""Engine-pair leases (transfer/protocol/engine_leases.py; issue 52: at most 50 heartbeats a second
per rank at 64 x 64, mixed TP included): the rule on one rank, then driven over fleets by
kvstage.sim.beats, which checks that a dead rank is declared lost within its lease, that a live
one never is, and that a rank cut off stopped writing before its peers declared it lost."""

import dataclasses

import pytest

from kvstage.sim.beats import BeatRank, fleet_beats, run_beats
from kvstage.sim.fleet import Fleet, FleetConfig, Model
from kvstage.sim.report import heartbeat_rates
from kvstage.transfer.protocol.engine_leases import EngineLeases, LossKind, engine_interval
from kvstage.transfer.protocol.messages import Ack, EngineBeat, Vouch

LEASE, BASE, TICK = 10.0, 1.0, 0.25


def test_the_slot_is_the_configured_interval_until_the_rate_would_pass_the_bound_then_up_to_an_eighth_lease():
    assert engine_interval(4, base=BASE, lease=LEASE) == BASE
    assert engine_interval(22, base=BASE, lease=LEASE) == pytest.approx(1.1)
    assert engine_interval(27, base=BASE, lease=LEASE) == LEASE / 8
    with pytest.raises(ValueError):
        engine_interval(4, base=BASE, lease=LEASE, per_s=0)
    with pytest.raises(ValueError):   # a slot that does not fit the lease's chain of beats
        EngineLeases(me=1, engine="e", lease=LEASE, sibling_every=1.0, base=2.0, now=0.0)


def rank(**kw):
    return EngineLeases(**{"me": 1, "engine": "d", "lease": LEASE, "sibling_every": 1.0, "base": BASE, "now": 0.0, **kw})


def test_a_relayed_stamp_counts_from_when_it_left_its_rank_not_from_when_it_arrived():
    me = rank()
    me.connect(7, "p", now=0.0)
    me.on_beat(EngineBeat(src=8, dst=1, vouches=[Vouch(8, 3, 0.0), Vouch(7, 5, 2.5)]), now=4.0)
    assert me.heard(7) == pytest.approx(1.5)                # 4.0 less the 2.5 s the relay held it
    assert me.verdicts(11.4) == []
    assert [(v.rank, v.kind) for v in me.verdicts(11.6)] == [(7, LossKind.SILENT)]
    assert me.verdicts(11.6, looked=11.4) == []             # our own lateness is not its silence
    with pytest.raises(ValueError):
        me.connect(9, "d", now=0.0)                         # our own engine's ranks are siblings


def test_an_acknowledgement_fences_at_the_time_of_the_stamp_it_names_whoever_relayed_it():
    me = rank(me=7, engine="p")
    me.set_siblings({7, 8}, now=0.0)
    me.connect(1, "d", now=0.0)
    beats = me.beats(2.0, clock=2.0)                        # our stamp 1, taken at 2.0
    assert {b.to for b in beats} >= {8}
    stamp = next(v for b in beats for v in b.beat.vouches if v.rank == 7).seq
    me.beats(3.0, clock=3.0)                                # stamp 2 at 3.0
    me.on_beat(EngineBeat(src=8, dst=7, sibling=True, vouches=[Vouch(1, 4, 0.5)],
                          acks=[Ack(1, 7, stamp), Ack(1, 99, 1)]), now=6.0)
    assert me.may_write(1, 11.9) and not me.may_write(1, 12.0)   # stamp 1's time + the lease
    me.on_beat(EngineBeat(src=8, dst=7, sibling=True, acks=[Ack(1, 7, 12345)]), now=6.5)   # not ours
    assert not me.may_write(1, 12.0)
    assert [v.kind for v in me.verdicts(12.0, writes=True)] == [LossKind.FENCED]
    assert "the last stamp of ours it acknowledged is 10.0 s old, lease 10 s" in me.verdicts(12.0, writes=True)[0].reason


def test_two_engines_settle_on_the_longer_slot_so_a_rank_receives_no_more_than_it_sends():
    me = rank()
    for r in range(4):
        me.connect(10 + r, "p", now=0.0)
    def engine_beats(seconds, start):
        n = 0
        for step in range(round(seconds / 0.05)):
            t = start + step * 0.05
            me.on_beat(EngineBeat(src=10, dst=1, vouches=[Vouch(10, step + 1, 0.0)], every=1.25), now=t)
            n += sum(b.kind == "engine" for b in me.beats(t, clock=t))
        return n
    assert me.slot_length("p", 1.0) == 1.0
    assert engine_beats(20.0, 0.0) in (16, 17)               # 1.25 s, theirs, not our 1.0 s
    assert me.slot_length("p", 1.0) == 1.25 and me.slot_length("q", 1.0) == 1.0


def test_what_a_sibling_relayed_about_a_rank_no_one_of_our_engine_is_connected_to_any_more_is_dropped():
    me = rank(me=7, engine="p")
    me.set_siblings({7, 8}, now=0.0)
    me.on_beat(EngineBeat(src=8, dst=7, sibling=True, links={"d": [50]}, vouches=[Vouch(8, 1, 0.0), Vouch(50, 3, 0.1)],
                          acks=[Ack(8, 50, 2), Ack(50, 8, 1)]), now=1.0)
    me.beats(1.0, clock=1.0)
    assert 50 in me.relayed and (8, 50) in me.acks and (50, 8) in me.acks
    me.on_beat(EngineBeat(src=8, dst=7, sibling=True, links={}, vouches=[Vouch(8, 2, 0.0)]), now=2.0)
    me.beats(2.0, clock=2.0)
    assert 50 not in me.relayed and me.acks == {}


def tp1_meets_tp8(engines: int) -> tuple[list[BeatRank], list[tuple[int, int]]]:
    """One decode rank of TP 1 (gid 0) connected to every rank of `engines` prefill engines of
    TP 8 (216 ranks for 27: the hottest rank of the 64 x 64 mixed fleet, docs/scale.md), and one
    decode engine of TP 8 connected rank to rank to the first of them."""
    ranks, links = [BeatRank(0, "d0", 1000)], []
    for e in range(engines):
        for r in range(8):
            g = 1 + 8 * e + r
            ranks.append(BeatRank(g, f"p{e}", 1000 + g))
            links.append((g, 0))
    for r in range(8):
        g = 1 + 8 * engines + r
        ranks.append(BeatRank(g, "d1", 1000 + g))
        links.append((1 + r, g))
    return ranks, links


def test_a_rank_meeting_216_peer_ranks_of_27_engines_beats_under_50_a_second_and_deaths_are_still_noticed():
    ranks, links = tp1_meets_tp8(27)
    out = run_beats(ranks, links, lease=LEASE, base=BASE, sibling_every=BASE, seconds=30.0, tick=TICK,
                    kills=[(15.0, 3), (15.0, 1 + 8 * 27 + 5)], cuts=[(16.0, 20)])
    assert out.false_losses == [] and out.fence_breaks == [] and out.missed == []
    hot = out.sent_per_s[0] + out.received_per_s[0]
    assert 30 <= hot <= 50, hot                                  # 21.6 each way; 172.8 a rank pair each
    assert out.received_per_s[0] <= out.sent_per_s[0] + 0.5
    assert out.both_max() <= 50
    # gid 3 is linked to the decode rank of TP 1 and to rank 2 of d1; rank 5 of d1 to prefill rank 5
    assert len(out.detect_s) == 3
    assert all(LEASE - out.stalest_s - TICK <= s <= LEASE + 2 * TICK for s in out.detect_s), out.detect_s
    assert out.stalest_s < LEASE / 2 and out.fence_slack_min_s > 1.0


@pytest.mark.parametrize("seed", [1, 2])
def test_with_lost_beats_a_cut_off_writer_is_fenced_before_it_is_declared_lost(seed):
    ranks, links = tp1_meets_tp8(4)
    out = run_beats(ranks, links, lease=4.0, base=0.5, sibling_every=0.5, seconds=30.0, tick=0.1, seed=seed,
                    loss=0.2, cuts=[(10.0, 2), (12.0, 4 * 8 + 3)], kills=[(14.0, 9)])
    assert out.fence_breaks == [] and out.missed == []
    assert len(out.detect_s) == 1 and out.detect_s[0] <= 4.0 + 0.3


def test_the_fleet_simulators_beats_stay_under_50_where_rank_pair_heartbeats_do_not():
    """A small fleet whose decode ranks of TP 1 meet 64 prefill ranks (8 engines of TP 8): the
    rank-pair leases (leases.py, the fleet's heartbeat figure) make 51.2 a second; engine-pair
    leases far fewer, every check of kvstage.sim.beats holding."""
    cfg = FleetConfig(prefill_engines=8, decode_engines=2, prefill_tp=(8,), decode_tp=(1,),
                      models=(Model(name="gqa", mla=False, heads=8, layers=2, page_size=4),),
                      requests=160, in_flight=80, pages=(1, 4), deaths=0, aborts=0.0, seed=2)
    fleet = Fleet(dataclasses.replace(cfg))
    fleet.run()
    assert fleet.check() == []
    sent, received = heartbeat_rates(fleet)
    assert max(s + r for s, r in zip(sent, received)) > 50          # the rank-pair figure misses the goal
    out = fleet_beats(fleet, 20.0)
    assert out.false_losses == [] and out.fence_breaks == [] and out.missed == []
    assert out.both_max() <= 20 and out.detect_s
