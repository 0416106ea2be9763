"""kvstage starved the way a busy serving engine starves it (issue 49): every rank process runs
beside a thread that always wants the GIL (the scheduler loop's stand-in), the machine's cores are
oversubscribed by CPU burners, and the deadlines are the production ones. No fault and no abort:
every request must succeed bit-exact, none may hang, and no rank may declare a peer lost.

One short epoch of examples/soak.py --starve over Mooncake, whose engine the CI failure of issue
49 ran (about a minute; docs/soak.md has runs of both backends and their figures).
"""

import json

import pytest
from example_runs import run_example

pytestmark = pytest.mark.integration


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", ["mooncake"])
def test_starved_soak_fails_nothing(backend, tmp_path):
    out = tmp_path / "starved.json"
    run = run_example("soak.py", ["--starve", "--faults", "none", "--no-aborts", "--epochs", "1", "--minutes", "5",
                                  "--backend", backend, "--seed", "49", "--json", str(out)], timeout=540)
    assert run.returncode == 0, run.stdout[-6000:]
    tally = json.loads(out.read_text())
    assert tally["starve"] and tally["burners"] == 4 * tally["cpu_count"], tally
    assert tally["epochs"] == 1 and tally["rooms_completed"] > 0, tally
    assert tally["rooms_failed"] == 0, (tally["failed_by_kind"], tally["problems"])
    assert tally["failed_untouched"] == 0 and tally["untrue_reasons"] == 0, tally["problems"]
    assert tally["corruptions"] == 0 and tally["hangs"] == 0, tally["problems"]
    assert tally["peers_lost"] == 0 and tally["lost_untouched"] == 0, tally["problems"]
