"""The engine's shell of engine-pair leases (engine/engine_liveness.py) with its parts alone (no
sockets): the acknowledgements move a prefill rank's write fence where the write queue and the
backend read it, sibling beats reach it before the peer table, and a peer running the other
lease mode is declared lost with that reason. The rule itself: test_engine_leases.py."""

from types import SimpleNamespace

from engine_parts import peer_table
from test_loop_handlers import router_of

from kvstage.transfer.engine.engine_liveness import EngineLiveness, SiblingsFound
from kvstage.transfer.engine.liveness import Liveness
from kvstage.transfer.engine.peers import Peer
from kvstage.transfer.engine.stats import Stats
from kvstage.transfer.protocol.actions import PeerKey
from kvstage.transfer.protocol.leases import Lease
from kvstage.transfer.protocol.messages import Ack, EngineBeat, Heartbeat

LEASE, BEAT = 2.0, 0.25
TIMEOUTS = SimpleNamespace(lease=LEASE, heartbeat=BEAT, connect=3.0, bootstrap=5.0)


def prefill_rank(me=1):
    """A prefill rank of engine "pf" connected to decode rank 77 of engine "dc" since 0."""
    stats, sent, fences, lost = Stats(), [], {}, []
    sock = SimpleNamespace(send=lambda ep, msg: sent.append((ep, msg)) or True, forget=lambda ep: None)
    side = SimpleNamespace(writes_to_peers=True, connect_failed=lambda peer, now: None,
                           peer_lost=lambda peer, reason, now, clean: lost.append(reason))
    peers = peer_table(me=me, sock=sock, stats=stats, listeners=lambda: [side])
    peers.peers[77] = Peer(key=PeerKey("dc", 0, 77), role="decode", tp_size=1, endpoint="tcp://d:1",
                           lease=Lease(LEASE, 0.0), state="connected", backend_name="b77")
    live = EngineLiveness(me=me, engine_id="pf", peers=peers, timeouts=TIMEOUTS, stats=stats, side=side, sock=sock,
                          fences=SimpleNamespace(fence=lambda peer, until: fences.__setitem__(peer, until)),
                          lookup=lambda timeout: [], post=lambda ev: None, now=0.0)
    live._looking = True   # no lookup thread here: the tests hand SiblingsFound in themselves
    return SimpleNamespace(live=live, peers=peers, stats=stats, sent=sent, fences=fences, lost=lost)


def test_an_acknowledged_stamp_moves_the_write_fence_of_the_write_queue_and_of_the_backend():
    r = prefill_rank()
    r.live.tick(0.5)                     # links the decode rank; our first engine beat carries a stamp
    (_, beat), = [(ep, m) for ep, m in r.sent if isinstance(m, EngineBeat)]
    stamp = beat.vouches[0]
    assert stamp.rank == 1 and stamp.seq > 0
    assert r.peers.peers[77].lease.fence_base == 0.0     # the connection's start, until acknowledged
    r.live.on_EngineBeat(r.peers.peers[77], EngineBeat(src=77, dst=1, acks=[Ack(77, 1, stamp.seq)], every=BEAT), 0.7)
    assert r.peers.peers[77].lease.fence_base == 0.5     # the stamp's time: may_write until 2.5
    assert r.fences == {"b77": 0.5 + LEASE}
    assert r.peers.peers[77].lease.may_write(2.4) and not r.peers.peers[77].lease.may_write(2.5)


def test_a_silent_peer_engine_is_lost_within_the_lease_and_the_fence_ran_out_no_later():
    r = prefill_rank()
    now = 0.0
    while r.peers.peers.get(77) is not None and now < 10:
        r.live.tick(now)
        now += 0.1
    assert r.lost and "lease expired" in r.lost[0], r.lost
    assert LEASE <= now <= LEASE + 0.2                       # at the first tick past the lease
    assert r.fences["b77"] <= now                           # the backend drove no write past it


def test_sibling_beats_reach_it_before_the_peer_table_and_an_unknown_sibling_is_looked_up():
    r = prefill_rank()
    router = router_of(SimpleNamespace(role="prefill", stats=r.stats, me=1), r.peers, r.live.handlers)
    router.siblings = r.live
    beat = EngineBeat(src=5, dst=1, sibling=True, links={"dc": [77]})
    r.live._looking, r.live._look_at = False, float("inf")
    router.on_frame(beat, 1.0)
    assert r.stats.snapshot()["dropped_messages"] == {"unknown_sibling": 1}
    assert r.live._look_at == 1.0                         # looked up again at the next tick
    r.live.on_siblings(SiblingsFound([SimpleNamespace(incarnation=5, ctrl_endpoint="tcp://s:5"),
                                      SimpleNamespace(incarnation=1, ctrl_endpoint="tcp://me:1")], None), 1.1)
    router.on_frame(beat, 1.2)
    assert r.stats.snapshot()["heartbeats_received"] == {"sibling": 1}
    assert r.live.leases.siblings[5].links == {"dc": frozenset({77})}
    r.live.tick(1.3)                                      # a beat to the sibling, at its endpoint
    assert any(ep == "tcp://s:5" and m.sibling for ep, m in r.sent)


def test_a_peer_running_the_other_lease_mode_is_lost_with_that_reason():
    r = prefill_rank()
    r.live.on_Heartbeat(r.peers.peers[77], Heartbeat(src=77, dst=1, seq=1), 0.1)
    assert r.lost and "rank-pair leases and this rank engine-pair" in r.lost[0]
    stats, lost = Stats(), []
    side = SimpleNamespace(writes_to_peers=True, peer_lost=lambda peer, reason, now, clean: lost.append(reason))
    peers = peer_table(me=1, sock=SimpleNamespace(send=lambda ep, m: True, forget=lambda ep: None), stats=stats,
                       listeners=lambda: [side])
    peers.peers[77] = Peer(key=PeerKey("dc", 0, 77), role="decode", tp_size=1, endpoint="tcp://d:1",
                           lease=Lease(LEASE, 0.0), state="connected")
    rank_pair = Liveness(me=1, peers=peers, timeouts=TIMEOUTS, stats=stats, ring=SimpleNamespace(allocator=None),
                         side=side, heartbeats=None)
    rank_pair.on_EngineBeat(peers.peers[77], EngineBeat(src=77, dst=1), 0.1)
    assert lost and "engine-pair leases and this rank rank-pair" in lost[0]


def test_a_silent_sibling_has_its_queued_beats_dropped_once_a_lease_and_the_engine_looked_up_again(monkeypatch):
    from kvstage.transfer.engine import engine_liveness
    monkeypatch.setattr(engine_liveness.threading, "Thread",   # the lookup runs at once, in this thread
                        lambda target, name, daemon: SimpleNamespace(start=target))
    r = prefill_rank()
    forgot = []
    r.live.sock = SimpleNamespace(send=lambda ep, msg: True, forget=forgot.append)
    r.live.on_siblings(SiblingsFound([SimpleNamespace(incarnation=5, ctrl_endpoint="tcp://s:5")], None), 0.0)
    r.live._looking, r.live._look_at, r.live._looked_up = False, float("inf"), 0.0
    looked = []
    r.live._do_lookup = lambda: looked.append(True)   # the lookup thread's work, counted
    now = 0.0
    while now < 3 * LEASE + 0.05:
        r.live.tick(now)
        if looked and r.live._looking:            # the lookup answers at once: the same sibling
            r.live.on_siblings(SiblingsFound([SimpleNamespace(incarnation=5, ctrl_endpoint="tcp://s:5")], None), now)
        now = round(now + 0.1, 1)
    assert forgot and all(ep == "tcp://s:5" for ep in forgot)
    assert 2 <= len(forgot) <= 3 and 2 <= len(looked) <= 3, (forgot, looked)   # once a lease past the first
