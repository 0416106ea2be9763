"""One legend under a figure of several panels, each label once (the plots of bench_phases.py and
hop_report.py)."""

from __future__ import annotations


def legend_below(fig, axes, *, ncol: int, bottom: float) -> None:
    """The labels of the first column of `axes`, each once, in a legend below the panels, which
    keep the figure above `bottom` (a fraction of its height)."""
    handles, labels = [], []
    for ax in axes[:, 0]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, bottom, 1, 1))
