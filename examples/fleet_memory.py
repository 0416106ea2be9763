"""Memory per room in flight only: the fleet of examples/fleet_sim.py's flags run to 35 ms of
simulated time, then sim/report.py `room_memory` (--memory-sample rooms per side), as
fleet_sim.py measures it, without running the fleet to its end (seconds instead of minutes).

    .venv/bin/python examples/fleet_memory.py --prefill 64 --decode 64 --in-flight 2000 --prefill-tp 8,4 --decode-tp 1,2,4,8

Prints one JSON line. The package measured is the `kvstage` on the path (another tree's with
PYTHONPATH: docs/scale.md compares two commits so, with this commit's sim/deep_size.py).
"""

import json
import os
import sys
import time

import kvstage
from kvstage.sim.fleet import Fleet
from kvstage.sim.report import room_memory

root = os.path.dirname(kvstage.__file__)
sys.path.insert(0, os.path.join(root, "examples"))
import fleet_sim  # noqa: E402 - the measured tree's own flags and fleet

a = fleet_sim.parse(sys.argv[1:])
fleet = Fleet(fleet_sim.config(a))
out: dict = {}
fleet.at(0.035, "hook", lambda: out.update(room_memory(fleet, a.memory_sample)))
t = time.perf_counter()
fleet.run(until=0.036)
print(json.dumps({"package": root, "args": sys.argv[1:], "wall_s": round(time.perf_counter() - t, 1),
                  "memory_per_room_in_flight": out}))
