"""Naming a receiver's prefill (engine id, or rendezvous address + DP rank) and finding the engine
of a DP rank from a rendezvous server's status rows."""

import pytest

from kvstage.bootstrap import BootstrapError
from kvstage.transfer.engine.prefill_sources import PrefillSource, SourceResolver, make_source
from kvstage.transfer.protocol.peering import DpEngine, DpMatch, engine_for_dp


def row(engine, dp=0, role="prefill", stale=False):
    return {"engine_id": engine, "role": role, "dp_rank": dp, "stale": stale}


def test_engine_for_dp():
    rows = [row("a", 0), row("a", 0), row("b", 1), row("c", 1, stale=True), row("d", 2, role="decode")]
    assert engine_for_dp(rows, 0) == DpEngine(DpMatch.FOUND, engine_id="a")   # one engine, several ranks
    assert engine_for_dp(rows, 1) == DpEngine(DpMatch.FOUND, engine_id="b")   # a stale one does not count
    assert engine_for_dp(rows, 2).match is DpMatch.NONE                       # decode engines do not count
    assert engine_for_dp(rows + [row("e", 1)], 1) == DpEngine(
        DpMatch.AMBIGUOUS, reason="prefill engines b, e all claim DP rank 1")
    no_dp_rank = [{"engine_id": "old", "role": "prefill"}]                    # no dp_rank: 0
    assert engine_for_dp(no_dp_rank, 0) == DpEngine(DpMatch.FOUND, engine_id="old")


def test_make_source_and_keys():
    assert make_source("pf", None, None) == PrefillSource("pf") and PrefillSource("pf").key == "pf"
    s = make_source(None, "10.0.0.7:8998", 3)
    assert (s.engine_id, s.bootstrap, s.dp_rank, s.key) == ("", "10.0.0.7:8998", 3, "10.0.0.7:8998#dp3")
    assert make_source(None, "h:1", None).key == "h:1#dp0"
    assert make_source("pf", "h:1", None).key == "h:1/pf"


@pytest.mark.parametrize("args, match", [((None, None, None), "name the prefill"), (("", None, None), "non-empty"),
                                         ((None, "nohost", 1), "host:port"), ((None, "h:1", -1), ">= 0"),
                                         ((None, "h:1", True), "prefill_dp_rank"), (("pf", "h:1", 2), "not both")])
def test_make_source_refuses(args, match):
    with pytest.raises(ValueError, match=match):
        make_source(*args)


class StatusClient:
    """Answers status() with each given list of rows in turn (the last one repeats)."""

    def __init__(self, *answers):
        self.answers, self.calls = list(answers), 0

    def status(self):
        self.calls += 1
        ans = self.answers[min(self.calls, len(self.answers)) - 1]
        if isinstance(ans, Exception):
            raise ans
        return {"ranks": ans}


def test_the_engine_of_a_dp_rank_is_polled_for_until_it_registers():
    r = SourceResolver(own=None, token=None, poll_s=0.001)
    client = StatusClient(BootstrapError("no answer", "timeout"), [], [row("x", 0)], [row("x", 0), row("y", 1)])
    assert r._engine_of_dp(client, PrefillSource("", "h:1", 1), timeout=5) == "y"
    assert client.calls == 4


def test_two_engines_claiming_a_dp_rank_fail_at_once_and_a_silent_server_at_the_deadline():
    r = SourceResolver(own=None, token=None, poll_s=0.001)
    client = StatusClient([row("x", 1), row("y", 1)])
    with pytest.raises(BootstrapError, match="x, y all claim DP rank 1"):
        r._engine_of_dp(client, PrefillSource("", "h:1", 1), timeout=5)
    assert client.calls == 1
    with pytest.raises(BootstrapError, match="rendezvous server h:1: no answer"):
        r._engine_of_dp(StatusClient(BootstrapError("no answer", "timeout")), PrefillSource("", "h:1", 0), timeout=0.05)
