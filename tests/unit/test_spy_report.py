"""support/spy_report.py: py-spy's raw lines read into (process, thread) sample counts, own and
inclusive frames; rank processes named by their spec file, numbered pool threads summed."""

from __future__ import annotations

import gzip

import pytest

from kvstage.support import spy_report

RAW = [
    'process 10:"python bench.py";process 11:"python pd_rank.py /tmp/x/002-d1.json";'
    "thread (11): kvstage-scatter;run (t.py:1);work (w.py:2);index (p.py:3);_upload (p.py:4) 5\n",
    'process 10:"python bench.py";process 11:"python pd_rank.py /tmp/x/002-d1.json";'
    "thread (11): kvstage-scatter;run (t.py:1);work (w.py:2);launch (k.py:9) 3\n",
    'process 10:"python bench.py";process 12:"python pd_rank.py /tmp/x/000-p0.json";'
    "thread (13): kvstage-xfer-0;run (t.py:1);gather (g.py:1) 2\n",
    'process 10:"python bench.py";process 12:"python pd_rank.py /tmp/x/000-p0.json";'
    "thread (14): kvstage-xfer-1;run (t.py:1);gather (g.py:1);gather (g.py:1) 4\n",
    "\n",
    'process 10:"python bench.py";thread (10): MainThread;main (b.py:1) 1\n',
]


def test_samples_by_rank_process_and_thread_with_own_and_inclusive_frames():
    s = spy_report.summarize(RAW)
    assert {k: v.samples for k, v in s.items()} == {("d1", "kvstage-scatter"): 8, ("p0", "kvstage-xfer-N"): 6,
                                                     ("bench.py", "MainThread"): 1}
    scatter = s[("d1", "kvstage-scatter")]
    assert scatter.own == {"_upload (p.py:4)": 5, "launch (k.py:9)": 3}
    assert scatter.inside["work (w.py:2)"] == 8 and scatter.inside["index (p.py:3)"] == 5
    assert s[("p0", "kvstage-xfer-N")].inside["gather (g.py:1)"] == 6   # a recursive frame counts once a stack


def test_the_report_leaves_out_frames_of_every_sample_and_filters_threads(tmp_path, capsys):
    lines = spy_report.report(spy_report.summarize(RAW), top=2, thread="scatter")
    assert lines[0].split() == ["d1", "kvstage-scatter", "8", "samples"]
    assert [line.split()[:3] for line in lines[1:]] == [["own", "5", "_upload"], ["own", "3", "launch"],
                                                      ["in", "5", "index"], ["in", "5", "_upload"]]
    path = tmp_path / "spy.txt.gz"
    with gzip.open(path, "wt") as f:
        f.writelines(RAW)
    assert spy_report.main([str(path), "--thread", "xfer"]) == 0
    assert capsys.readouterr().out.split() == ["p0", "kvstage-xfer-N", "6", "samples"]


def test_a_line_that_is_not_py_spys_raw_format_is_named():
    with pytest.raises(ValueError, match="not a py-spy raw line"):
        spy_report.parse_line("frame;frame no-count\n")
