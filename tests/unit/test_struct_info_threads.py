"""Every msgspec Struct of the packages has its decoding info built at import, so threads that
use a type for the first time at once cannot crash the process (a SIGSEGV in msgspec 0.22 seen
in a rank process hosting several ranks: see kvstage.wire.prebuild_struct_info)."""

import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

import msgspec

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("kvstage.bootstrap", "kvstage.transfer", "kvstage.staging")


def all_modules():
    for name in PACKAGES:
        pkg = importlib.import_module(name)
        yield pkg
        for info in pkgutil.walk_packages(pkg.__path__, f"{name}."):
            if info.name.endswith("__main__"):
                continue
            yield importlib.import_module(info.name)


def test_every_struct_is_prebuilt():
    from kvstage.wire import PREBUILT

    structs = {v for mod in all_modules() for v in vars(mod).values()
               if isinstance(v, type) and issubclass(v, msgspec.Struct) and v.__module__.startswith(PACKAGES)}
    assert structs, "found no Struct classes: the walk is broken"
    missing = sorted(f"{t.__module__}.{t.__qualname__}" for t in structs - PREBUILT)
    assert not missing, f"call prebuild_struct_info(globals()) at the end of their modules: {missing}"


HAMMER = """
import sys, threading
sys.setswitchinterval(1e-6)  # switch threads as often as possible: the race needs a switch mid-build
import msgspec
from kvstage.bootstrap import messages as m
from kvstage.wire import PREBUILT

entry = dict(engine_id="e", role="prefill", tp_size=2, tp_rank=1, ctrl_endpoint="tcp://h:1", backend="nixl",
             backend_identity="x" * 64, layout={"a": 1, "b": "c"}, pools={"kv": 10}, incarnation=5)
gate = threading.Barrier(8)

def first_use():
    gate.wait()
    for _ in range(3):
        msgspec.convert(entry, m.RankEntry)  # what crashed: RankInfo._entry() in BootstrapClient.register
    for t in sorted(PREBUILT, key=lambda t: t.__qualname__):
        msgspec.msgpack.Decoder(t)

threads = [threading.Thread(target=first_use) for _ in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print("ok")
"""


def test_first_use_from_many_threads_does_not_crash():
    # Without the prebuild about one run in three crashed (SIGSEGV); eight runs take a few seconds.
    for _ in range(8):
        proc = subprocess.run([sys.executable, "-X", "faulthandler", "-c", HAMMER], cwd=ROOT, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0 and "ok" in proc.stdout, (proc.returncode, proc.stderr[-3000:])
