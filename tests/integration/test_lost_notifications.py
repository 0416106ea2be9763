"""Lost write notifications cost a heartbeat, not the request (issue 49): a decode rank whose
backend loses every notification, or every second one, still gets every room bit-exact,
because the writers repeat the tags of their completed writes over the control socket
(TagsAgain) while the room is unconfirmed. Both backends, staged and direct, real processes.
Before TagsAgain these rooms failed ("... but only N notifications arrived", or the prefill's
"did not confirm the room")."""

import pytest
from engine_cases import TEST_TIMEOUTS, Case, Topo, problems, random_rooms, run_cases

pytestmark = pytest.mark.integration


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_rooms_succeed_bit_exact_when_notifications_are_lost(backend):
    cases = []
    for i, (topo, staging, every) in enumerate(((Topo(P=2, D=1, H=4), True, 1), (Topo(P=1, D=2, H=4), True, 2),
                                                (Topo(P=2, D=2, H=4), False, 1))):
        case = Case(topo=topo, staging=staging, backend=backend, label=f"drop{every}",
                    rooms=random_rooms(70 + i, 8, 16, max_tokens=300, base=7000 + 100 * i),
                    extra={"timeouts": {**TEST_TIMEOUTS, "arrival": 20.0}, "run_timeout_s": 120})
        case.decode_extra = {"faults": {"drop_every_tag": every}}
        cases.append(case)
    results, codes, logs, _ = run_cases(cases, timeout=200)
    assert problems(results, codes, logs) == []
    for case in cases:
        every = case.decode_extra["faults"]["drop_every_tag"]
        for res in results[case.name]["decode"]:
            st = res["stats"]
            recovered = st.get("tags_again", {}).get("recovered", 0)
            if every == 1:   # no notification arrived: every tag the room took came again
                assert recovered == st["tags_received"] > 0, (case.name, st.get("tags_again"), st["tags_received"])
            else:
                assert 0 < recovered < st["tags_received"], (case.name, st.get("tags_again"), st["tags_received"])
