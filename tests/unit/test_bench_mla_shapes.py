"""The MLA shapes benchmark's pure parts (support/bench_mla_shapes.py): the room specs of each
shape (a DCP decode rank holds its local pages, both sides name the token count) and the summary
(each shape's median of round medians, its ratio to the plain shape of the same rounds)."""

import pytest

from kvstage.support.bench_mla_shapes import SHAPES, parse, rooms_for, summarize


def test_the_rooms_of_a_dcp_round_name_their_tokens_and_the_decode_holds_its_local_pages():
    a = parse(["--tokens", "100", "--page-size", "16", "--requests", "2"])
    shapes = {s.name: s for s in SHAPES}
    plain, sharded = shapes["plain"], shapes["sharded"]
    for dcp in (shapes["dcp"], shapes["dcp-runs"]):
        pre, dec = rooms_for(a, dcp, 500)
        assert [r["room"] for r in pre] == [500, 501, 502] == [r["room"] for r in dec]
        assert {r["pages"] for r in pre} == {7} and {r["pages"] for r in dec} == {4}   # ceil(100 / 32) virtual pages
        assert all(r["dcp_tokens"] == 100 for r in pre + dec)
    assert [s.name for s in SHAPES if not s.staging] == ["dcp-runs"]   # the token runs, with no buffer to gather into
    for shape in (plain, sharded):
        pre, dec = rooms_for(a, shape, 0)
        assert all(r["pages"] == 7 and "dcp_tokens" not in r for r in pre + dec)


def test_the_summary_is_the_median_of_round_medians_with_the_ratio_to_plain_of_the_same_rounds():
    a = parse(["--tokens", "10", "--layers", "1", "--head-dim", "100"])
    rounds = [{"shape": "plain", "median_s": 1.0}, {"shape": "dcp", "median_s": 3.0},
              {"shape": "plain", "median_s": 2.0}, {"shape": "dcp", "median_s": 2.0},
              {"shape": "plain", "median_s": 4.0}, {"shape": "dcp", "median_s": 6.0}]
    s = summarize(a, rounds)["summary"]
    assert s["plain"]["median_ms"] == 2000.0 and s["dcp"]["median_ms"] == 3000.0
    assert s["dcp"]["ratio_to_plain"] == 1.5 and s["dcp"]["round_ratios"] == [3.0, 1.0, 1.5]
    assert s["plain"]["range_ms"] == [1000.0, 4000.0]
    assert s["dcp"]["gb_per_s"] == pytest.approx(10 * 100 * 2 / 3.0 / 1e9)


def test_unknown_shapes_and_empty_counts_are_refused():
    with pytest.raises(SystemExit):
        parse(["--shapes", "plain,fancy"])
    with pytest.raises(SystemExit):
        parse(["--rounds", "0"])
    assert [s.name for s in parse(["--shapes", "sharded,plain"]).shapes] == ["sharded", "plain"]
