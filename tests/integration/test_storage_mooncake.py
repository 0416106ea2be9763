"""MooncakePageStore against a real Mooncake Store: the package's mooncake_master (with its HTTP
metadata server), a writer in this process and a reader in another one."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kvstage.storage.file_store import PageKey

pytestmark = pytest.mark.integration

PAGE = 64 * 1024 + 12


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    from kvstage.support.mooncake_master import mooncake_master
    with mooncake_master(tmp_path_factory.mktemp("mooncake")) as addrs:
        yield addrs


def store(master, namespace="m"):
    from kvstage.storage.mooncake_store import MooncakePageStore
    return MooncakePageStore(namespace=namespace, master=master[0], metadata=master[1], staging_bytes=4 << 20,
                             segment_bytes=64 << 20)


def page(i):
    return torch.arange(PAGE, dtype=torch.int64).mul(i + 1).remainder(251).to(torch.uint8)


READER = textwrap.dedent("""
    import sys, torch
    from kvstage.storage.file_store import PageKey
    from kvstage.storage.mooncake_store import MooncakePageStore
    sys.path.insert(0, sys.argv[3])
    from test_storage_mooncake import PAGE, page
    s = MooncakePageStore(namespace="m", master=sys.argv[1], metadata=sys.argv[2], staging_bytes=4 << 20,
                          segment_bytes=16 << 20)
    out = {}
    ok = s.get([PageKey("kv", f"k{i}") for i in range(8)], [PAGE] * 8, lambda i, src: out.__setitem__(i, src.clone()))
    print("OK" if all(ok) and all(torch.equal(out[i], page(i)) for i in range(8)) else f"BAD {ok}", s.stats.reads)
    s.close()
""")


def test_a_batch_written_here_is_read_by_another_process(master):
    s = store(master)
    pks = [PageKey("kv", f"k{i}") for i in range(8)]
    assert s.put(pks, [PAGE] * 8, lambda i, dst: dst.copy_(page(i))) == [True] * 8
    assert s.stats.writes == 1
    res = subprocess.run([sys.executable, "-c", READER, *master, str(Path(__file__).parent)], capture_output=True,
                         text=True, timeout=120, env=dict(os.environ))
    assert res.stdout.split()[:2] == ["OK", "1"], res.stdout + res.stderr[-2000:]
    other = store(master, namespace="other")
    assert other.present(pks) == [False] * 8
    other.close()
    s.close()


def test_an_object_whose_bytes_do_not_match_is_a_miss(master):
    s = store(master)
    good = PageKey("kv", "good")
    assert s.put([good], [PAGE], lambda i, dst: dst.copy_(page(3))) == [True]
    raw = bytearray(s._store.get(s._key(good)))      # page and trailer, as stored
    raw[100] ^= 0xFF                                 # one bit of the page flipped
    pk = PageKey("kv", "tampered")
    assert s._store.put(s._key(pk), bytes(raw)) == 0  # stored under a key of this namespace
    assert s.get([good], [PAGE], lambda i, src: None) == [True]
    out = {}
    assert s.get([pk], [PAGE], lambda i, src: out.__setitem__(i, src.clone())) == [False]
    assert not out and s.stats.pages_corrupt == 1
    assert s.get([PageKey("kv", "never")], [PAGE], lambda i, src: None) == [False]
    s.close()
