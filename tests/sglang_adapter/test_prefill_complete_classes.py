"""SGLang's prefill_complete allocation policy through SGLang's real transfer classes
(scheduler-class harness), prefill TP 1 -> decode TP 1 (SGLang allows the policy only there):
each decode receiver announces its room at init() and polls WaitingForInput only once the
prefill's sender called mark_prefill_complete(); two requests are completed only after the
decode finished others (`mark_after`), so a decode that reserved early would be seen doing it.
A decode that aborts while it waits fails the prefill's request with a reason, and a prefill
that fails a request before completing it fails the waiting decode's. At the end each rank's
manager is torn down: the thread reading SGLang's bootstrap messages is gone with kvstage's
others, and SGLang's socket is closed. Both backends."""

from __future__ import annotations

import json

import pytest
from scenario import expect, requests_for, run


@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_decode_reserves_only_after_the_prefill_completed(tmp_path, model_dir, bootstrap_server, backend):
    reqs = requests_for(47, 6, abort={3: "decode-early", 4: "prefill-early"})
    reqs[1]["mark_after"] = [reqs[0]["room"], reqs[2]["room"]]
    reqs[5]["mark_after"] = [reqs[1]["room"]]
    # a request the prefill completes 6 s after its sender was made, past kvstage's metadata deadline
    # of 3 s here: that deadline counts from the completion (the decode sends nothing before it)
    reqs[0]["mark_after_s"] = 6
    results = run(tmp_path, model_dir, bootstrap_server, 1, 1, reqs, backend=backend, prefill_complete=True,
                  extra_env={"KVSTAGE_TIMEOUT_METADATA": "3"})
    expect(results, reqs, lambda i: "Failed" if i in (3, 4) else "Success")
    prefill, decode = results[("prefill", 0)]["rooms"], results[("decode", 0)]["rooms"]
    # the decode's ABORT reaches the prefill after its sender was made, or before (SGLang's table
    # then holds the room as cancelled, and the sender fails as it is made)
    aborted = prefill[str(reqs[3]["room"])]["error"]
    assert "before it sent its metadata" in aborted or "Duplicate or cancelled bootstrap room" in aborted, aborted
    assert "the prefill failed the request before it completed it: Prefill bootstrap failed" in decode[str(reqs[4]["room"])]["error"], decode[str(reqs[4]["room"])]
    assert all(prefill[str(q["room"])].get("marked") for i, q in enumerate(reqs) if i != 3)
    for role in ("prefill", "decode"):
        left = json.loads((tmp_path / f"{role}0.json.teardown").read_text())
        assert left == {"threads": [], "socket_closed": True}, (role, left)
        log = (tmp_path / f"{role}0.log").read_text()
        assert "Exception in thread" not in log, log[-3000:]   # stopped, not killed by its socket's close


def test_a_decode_whose_prefill_runs_the_other_policy_fails_each_request_naming_both(tmp_path, model_dir,
                                                                                     bootstrap_server):
    """The decode runs prefill_complete, the prefill the default policy (SGLang's own check refuses
    the pairing too): each decode receiver fails at init() naming both policies, and the prefill's
    senders, whose metadata never comes, fail at kvstage's metadata deadline (3 s here)."""
    reqs = requests_for(59, 3)
    results = run(tmp_path, model_dir, bootstrap_server, 1, 1, reqs, prefill_complete="decode",
                  extra_env={"KVSTAGE_TIMEOUT_METADATA": "3"})
    expect(results, reqs, lambda i: "Failed")
    for q in reqs:
        decode = results[("decode", 0)]["rooms"][str(q["room"])]["error"]
        assert "decode allocation policy mismatch: prefill early, decode prefill_complete" in decode, decode
        prefill = results[("prefill", 0)]["rooms"][str(q["room"])]["error"]
        assert "no room metadata" in prefill, prefill
