"""How many heartbeats a rank sends (issue 52: at most 50 a second sent and received per rank of a
64 x 64 fleet of TP 8 engines). leases.py `heartbeat_interval`: the configured interval while a
rank sends at most 20 a second, longer with more peers, never longer than a quarter of the
lease; engine/liveness.py follows it."""

from types import SimpleNamespace

import pytest
from engine_parts import peer_table

from kvstage.transfer.engine.liveness import Liveness
from kvstage.transfer.engine.peers import Peer
from kvstage.transfer.engine.stats import Stats
from kvstage.transfer.protocol.actions import PeerKey
from kvstage.transfer.protocol.leases import HEARTBEATS_PER_S, Lease, heartbeat_interval, over_rate
from kvstage.transfer.protocol.messages import Heartbeat

LEASE, BASE, TICK = 10.0, 1.0, 0.1


def test_the_interval_is_the_configured_one_until_the_rate_would_pass_the_bound_then_grows_up_to_a_quarter_lease():
    assert heartbeat_interval(1, base=BASE, lease=LEASE) == BASE
    assert heartbeat_interval(20, base=BASE, lease=LEASE) == BASE
    assert heartbeat_interval(32, base=BASE, lease=LEASE) == pytest.approx(32 / HEARTBEATS_PER_S)
    assert heartbeat_interval(216, base=BASE, lease=LEASE) == LEASE / 4
    assert heartbeat_interval(5, base=3.0, lease=LEASE) == 3.0          # a longer configured interval stays
    with pytest.raises(ValueError):
        heartbeat_interval(5, base=BASE, lease=LEASE, per_s=0)


def test_past_a_quarter_lease_of_peers_at_the_bound_the_rate_is_over_it():
    """50 peers at 2.5 s each are 20 a second: the most rank-pair leases can keep to the bound."""
    assert not over_rate(50, base=BASE, lease=LEASE)
    assert over_rate(51, base=BASE, lease=LEASE)
    assert not over_rate(100, base=BASE, lease=40.0)      # a longer lease spaces them further
    assert over_rate(216, base=BASE, lease=LEASE)


@pytest.mark.parametrize("n_peers, warned", [(50, False), (216, True)])
def test_a_rank_past_the_rate_says_once_that_engine_pair_leases_would_beat_less(caplog, n_peers, warned):
    with caplog.at_level("WARNING", logger="kvstage.liveness"):
        run_liveness(n_peers, 3.0)
    said = [r.getMessage() for r in caplog.records if "KVSTAGE_LEASES=engine" in r.getMessage()]
    assert len(said) == (1 if warned else 0), said
    if warned:
        assert f"connected to {n_peers} peer ranks" in said[0] and "86 heartbeats a second" in said[0]


def run_liveness(n_peers: int, seconds: float, peer_every: float = TICK) -> dict[int, list[float]]:
    """A prefill rank's Liveness with `n_peers` connected decode ranks that each heartbeat it every
    `peer_every` seconds (acknowledging its latest); the control loop ticks every 0.1 s. Returns
    peer -> when it was sent a heartbeat."""
    now = 0.0
    sent: dict[int, list[float]] = {}
    stats = Stats()
    sock = SimpleNamespace(send=lambda ep, msg: sent.setdefault(msg.dst, []).append(now) or True, forget=lambda ep: None)
    peers = peer_table(me=1, sock=sock, stats=stats)
    for i in range(n_peers):
        peers.peers[100 + i] = Peer(key=PeerKey("d", i, 100 + i), role="decode", tp_size=8, endpoint=f"tcp://d:{i}",
                                    lease=Lease(LEASE, 0.0), state="connected")
    liveness = Liveness(me=1, peers=peers, timeouts=SimpleNamespace(lease=LEASE, heartbeat=BASE, connect=3.0),
                        stats=stats, ring=SimpleNamespace(allocator=None), side=SimpleNamespace(writes_to_peers=True),
                        heartbeats=SimpleNamespace(on_heartbeat=lambda peer, msg, now: None))
    every = round(peer_every / TICK)
    for step in range(round(seconds / TICK)):
        now = step * TICK
        liveness.tick(now)
        if step % every == 0:   # each peer heartbeats us, acknowledging our latest
            for peer in peers.connected():
                liveness.on_Heartbeat(peer, Heartbeat(src=peer.key.incarnation, dst=1, seq=step + 1,
                                                      ack=peer.lease.seq), now)
    assert all(p.state == "connected" for p in peers.peers.values())   # nobody lost, no fence ran out
    return sent


@pytest.mark.parametrize("n_peers", [8, 32, 40, 216])
def test_a_rank_sends_at_most_20_heartbeats_a_second_while_each_peer_gets_one_every_quarter_lease(n_peers):
    seconds = 30.0
    sent = run_liveness(n_peers, seconds)
    assert set(sent) == {100 + i for i in range(n_peers)}
    total = sum(len(times) for times in sent.values())
    interval = heartbeat_interval(n_peers, base=BASE, lease=LEASE)
    # per second, over the run: the bound (or the quarter lease's), and not less than that
    bound = max(HEARTBEATS_PER_S, n_peers / (LEASE / 4))
    assert total / seconds <= bound * 1.05 + n_peers / seconds, (n_peers, total / seconds)
    for times in sent.values():   # every peer, at least every quarter lease (plus a tick)
        gaps = [b - a for a, b in zip(times, times[1:])]
        assert max(gaps) <= min(interval, LEASE / 4) + TICK + 1e-9
        assert times[0] == 0.0 and seconds - times[-1] <= interval + TICK


def test_a_rank_heartbeats_a_peer_no_more_often_than_the_peer_heartbeats_it():
    """A peer with many peers of its own heartbeats us every 2 s: we answer at its pace, not at
    our 1 s (leases.py pair_interval), so what a rank receives is no more than what it sends."""
    seconds = 30.0
    sent = run_liveness(4, seconds, peer_every=2.0)
    for times in sent.values():   # once it heard two of the peer's (at 0 and 2 s; ours then went at 2 and 3 s)
        gaps = [b - a for a, b in zip(times, times[1:]) if a >= 3.0]
        assert min(gaps) >= 2.0 - 1e-9 and max(gaps) <= 2.0 + TICK + 1e-9, gaps
    times = run_liveness(4, seconds, peer_every=5.0)[100]   # a slower peer: a quarter lease at most
    assert [b - a for a, b in zip(times, times[1:]) if a >= 6.0] == pytest.approx([LEASE / 4] * 9)
