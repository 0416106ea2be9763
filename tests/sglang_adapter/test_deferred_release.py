"""SGLang's deferred decode KV release with kvstage, through SGLang's real DecodeTransferQueue.

A request fails while a prefill write of it is still in flight: the prefill rank's writes of
that room are held back by kvstage's fault injection (`hold_write_rooms`: posted, landing
`hold_write_s` later), and the prefill side aborts the request as soon as its write is held. The
decode side learns of the failure from kvstage (a failure it did not start), and SGLang's queue
decides what to do with the request's pages (decode_queue.py; only the page release itself and
the commit of a transferred request are the harness's).

- Deferred release on (SGLang's default, kvstage declares supports_deferred_decode_kv_release):
  SGLang holds the pages until `kv_mgr.is_abort_release_safe()`, which kvstage answers from its
  receiver's `released`. The late write lands while the pages are held (they hold its bytes when
  SGLang releases them); the harness then rewrites them to the sentinel, and no byte lands in
  them afterwards.
- Deferred release off (`SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE=0`, which is what a
  backend without the flag gets): SGLang frees the pages at once, before the write landed, and
  the late write lands in pages that SGLang already gave back: the hazard, shown.
"""

from __future__ import annotations

import pytest
from scenario import requests_for, run

HOLD_S = 4.0


@pytest.mark.parametrize("deferred", [True, False], ids=["deferred-release", "immediate-release"])
def test_late_write_lands_only_in_held_pages(tmp_path, model_dir, bootstrap_server, deferred, device="cpu"):
    """`device`: the ranks' KV device (test_cuda_scheduler_classes.py passes "cuda")."""
    reqs = requests_for(19, 3, abort={1: "prefill-held"})
    victim = reqs[1]["room"]
    results = run(tmp_path, model_dir, bootstrap_server, 1, 1, reqs, queue=True, device=device,
                  hold={"room": victim, "s": HOLD_S},
                  extra_env={"SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE": "1" if deferred else "0"})
    prefill, decode = results[("prefill", 0)], results[("decode", 0)]
    assert prefill["rooms"][str(victim)]["held"], "the victim's write was never held in flight"
    for i, q in enumerate(reqs):
        want = "Failed" if i == 1 else "Success"
        for side in (prefill, decode):
            assert side["rooms"][str(q["room"])]["result"] == want, side["rooms"][str(q["room"])]
        if i != 1:
            row = decode["rooms"][str(q["room"])]
            assert row["aux_room"] == q["room"] and row["aux_ids_ok"], row
    row = decode["rooms"][str(victim)]
    assert "KVTransferError" in row["error"] and "abort" in row["error"], row
    late = [e for e in decode["errors"] if "no successful room owns it" in e]
    if deferred:
        assert decode["errors"] == [], decode["errors"][:5]
        # held until the write landed: its bytes were there when SGLang let the pages go
        assert row["landed_before_release"] is True, row
    else:
        # SGLang let the pages go before the write landed, and the write landed in them later
        assert row["landed_before_release"] is False, row
        assert late and not [e for e in decode["errors"] if e not in late], decode["errors"][:5]
