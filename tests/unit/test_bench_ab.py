"""support/bench_ab.py's pure parts: the rounds alternate the trees' order, the table gives each
figure's median, range and ratio to the first tree, a tree is found by PYTHONPATH, and bad
arguments are usage errors before anything runs."""

from __future__ import annotations

import pytest

from kvstage.support import bench_ab
from kvstage.support.bench_ab import Tree


def test_rounds_alternate_the_order_of_the_trees():
    trees = [Tree("a", "/x"), Tree("b", "/y"), Tree("c", "/z")]
    assert [[t.label for t in bench_ab.round_order(trees, r)] for r in range(3)] == [
        ["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"]]


def test_the_table_gives_median_range_and_ratio_to_the_first_tree():
    samples = {"before": {"staged p50_ms": [5.0, 6.0, 4.0]}, "after": {"staged p50_ms": [2.0, 3.0, 2.5]},
               "other": {}}
    (line,) = bench_ab.summarize(samples, "before")
    assert line.split() == ["staged", "p50_ms", "before", "5.000", "[4.000-6.000]",
                            "after", "2.500", "[2.000-3.000]", "(0.50x)", "other", "-"]


def test_a_tree_imports_as_kvstage_from_its_parent_or_a_link(tmp_path):
    named = tmp_path / "kvstage"
    named.mkdir()
    (named / "__init__.py").write_text("")
    assert bench_ab.package_entry(str(named), str(tmp_path / "s"), "x") == str(tmp_path)
    other = tmp_path / "checkout"
    other.mkdir()
    (other / "__init__.py").write_text("")
    entry = bench_ab.package_entry(str(other), str(tmp_path / "s"), "y")
    assert (tmp_path / "s" / "tree-y" / "kvstage").resolve() == other.resolve() and entry == str(tmp_path / "s" / "tree-y")
    with pytest.raises(SystemExit, match="is not a kvstage tree"):
        bench_ab.package_entry(str(tmp_path), str(tmp_path / "s"), "z")


@pytest.mark.parametrize("argv", [
    ["--rev", "HEAD"],                                                 # one tree
    ["--rev", "HEAD", "--rev", "HEAD~1", "--measure", "fastest"],      # no such measurement
    ["--rev", "HEAD", "--rev", "HEAD~1", "--requests", "10"],          # nothing left after the warm-up
    ["--rev", "HEAD", "--rev", "HEAD~1", "--rounds", "0"],
])
def test_bad_arguments_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as e:
        bench_ab.main(argv)
    assert e.value.code == 2 and "usage" in capsys.readouterr().err
