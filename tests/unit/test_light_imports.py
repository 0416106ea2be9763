"""What a process pays for importing a part: the pure protocol, the frame codec, the rendezvous
and the package root load neither torch nor the engine (the import contracts in pyproject.toml
check the code's imports; this checks what a fresh interpreter actually loads)."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "kvstage.transfer.engine", "kvstage.staging", "zmq")


@pytest.mark.parametrize("module", ["kvstage", "kvstage.wire", "kvstage.transfer.protocol.prefill.room",
                                    "kvstage.transfer.protocol.decode.room", "kvstage.transfer.layout"])
def test_a_pure_part_loads_no_torch_and_no_engine(module):
    code = (f"import sys, {module}\n"
            f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"importing {module} loaded {out}"


def test_the_public_names_still_load_on_first_use():
    code = "import sys, kvstage\nkvstage.KVManager\nprint('kvstage.transfer.engine.manager' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "True"
