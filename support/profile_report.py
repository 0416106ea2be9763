"""The CPU each kvstage thread of each rank process spent, from the pstats files that
`PD_RANK_PROFILE_DIR` makes pd_rank.py write (docs/trace.md, "CPU per thread").

    python -m kvstage.support.profile_report DIR [--top N]

One line per rank process and thread: its CPU seconds (the profile's total, on time.thread_time)
and its function calls; with --top N, also each thread's N functions of most CPU of their own.
The files are named <pid>-<role>-<thread>-<i>.prof.
"""

from __future__ import annotations

import argparse
import glob
import os
import pstats
from dataclasses import dataclass


@dataclass(frozen=True)
class ThreadProfile:
    pid: str
    role: str
    thread: str
    path: str


def profiles(directory: str) -> list[ThreadProfile]:
    out = []
    for path in sorted(glob.glob(os.path.join(directory, "*.prof"))):
        parts = os.path.basename(path)[: -len(".prof")].split("-")
        out.append(ThreadProfile(pid=parts[0], role=parts[1], thread="-".join(parts[2:-1]), path=path))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("directory")
    ap.add_argument("--top", type=int, default=0, help="also each thread's N functions of most own CPU")
    a = ap.parse_args()
    for p in profiles(a.directory):
        st = pstats.Stats(p.path)
        print(f"{p.pid:>8s} {p.role:16s} {p.thread:26s} {st.total_tt:8.3f} s CPU {st.total_calls:10d} calls")
        if a.top:
            st.sort_stats("tottime").print_stats(a.top)


if __name__ == "__main__":
    main()
