"""The clusters of the tests, benchmarks and demo leave nothing behind in the temp directory:
each one's work directory goes when the process that made it exits, unless
KVSTAGE_KEEP_WORKDIRS asks to keep it (support/cluster.py scratch_dir)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
MAKE = "from kvstage.support.cluster import Cluster; c = Cluster(); open(c.workdir + '/x.log', 'w').write('x'); print(c.workdir)"


def _workdir(env: dict) -> Path:
    out = subprocess.run([sys.executable, "-c", MAKE], cwd=HERE, env=env, capture_output=True, text=True,
                         check=True, timeout=60)
    return Path(out.stdout.strip())


def test_a_cluster_work_directory_goes_when_its_process_exits():
    env = {k: v for k, v in os.environ.items() if k != "KVSTAGE_KEEP_WORKDIRS"}
    path = _workdir(env)
    assert path.name.startswith("kvstage-")
    assert not path.exists()


def test_a_cluster_work_directory_stays_when_asked():
    path = _workdir({**os.environ, "KVSTAGE_KEEP_WORKDIRS": "1"})
    try:
        assert (path / "x.log").read_text() == "x"
    finally:
        shutil.rmtree(path, ignore_errors=True)
