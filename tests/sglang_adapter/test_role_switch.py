"""SGLang's PD role switch (--enable-pd-role-switch) through SGLang's real transfer classes
(scheduler-class harness, rank.run_switch): two instances, A a prefill and B a decode, move a
first set of requests A -> B; each then tears its manager down as SGLang's switch does
(KvstageKVManager.teardown) and builds the other role's over the same KV tensors, and a second
set moves B -> A. Every byte, aux row and untouched page is checked on each decode, in each
phase, and each teardown left no kvstage thread running and SGLang's socket closed. Both
backends. SGLang's own switch (handle_pd_role_switch, on a real scheduler) is not run."""

from __future__ import annotations

import json

import pytest
from scenario import expect, requests_for, run


@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_instances_switch_roles_and_move_requests_the_other_way(tmp_path, model_dir, bootstrap_server, backend):
    first, second = requests_for(71, 4), requests_for(72, 4)
    results = run(tmp_path, model_dir, bootstrap_server, 1, 1, first, backend=backend, switch=second)
    # each process's report: its second role's; the file beside it (".1"): its first role's
    phase1 = {(role, 0): json.loads((tmp_path / f"{role}0.json.1").read_text()) for role in ("prefill", "decode")}
    for role in ("prefill", "decode"):   # the teardown stopped every kvstage thread and closed SGLang's socket
        assert json.loads((tmp_path / f"{role}0.json.teardown").read_text()) == {"threads": [], "socket_closed": True}
    expect(phase1, first, lambda i: "Success")
    phase2 = {("decode", 0): results[("prefill", 0)], ("prefill", 0): results[("decode", 0)]}
    expect(phase2, second, lambda i: "Success")
    for q in second:   # the old decode sent what the old prefill received
        sent = phase2[("prefill", 0)]["rooms"][str(q["room"])]["bytes"]
        assert sent and phase2[("decode", 0)]["rooms"][str(q["room"])]["bytes"] == sent, q
