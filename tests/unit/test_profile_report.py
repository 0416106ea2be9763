"""pd_rank.py's per-thread CPU profiles (PD_RANK_PROFILE_DIR) and the report that reads them."""

from __future__ import annotations

import pstats
import threading

from kvstage.support.pd_rank import profile_kvstage_threads
from kvstage.support.profile_report import profiles


def _busy() -> None:
    sum(i * i for i in range(200_000))


def test_each_kvstage_thread_is_profiled_and_no_other(tmp_path):
    dump = profile_kvstage_threads(str(tmp_path))
    try:
        threads = [threading.Thread(target=_busy, name=name) for name in ("kvstage-ctrl", "driver-dc-0")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        threading.setprofile(None)
    dump("decode")
    (found,) = profiles(str(tmp_path))
    assert (found.role, found.thread) == ("decode", "kvstage-ctrl")
    st = pstats.Stats(found.path)
    assert any(func[2] == "_busy" for func in st.stats)   # type: ignore[attr-defined]
    assert st.total_tt > 0
