"""DirectFileStore on a real filesystem that honours O_DIRECT: a loop-mounted ext4 image."""

import os
import subprocess

import pytest
import torch

from kvstage.storage.file_store import DirectFileStore, DirectMode, PageKey

pytestmark = pytest.mark.integration

PAGE = 3 * 4096 + 100          # not a multiple of 4096: slots are padded


@pytest.fixture(scope="module")
def ext4(tmp_path_factory):
    from loop_ext4 import loop_ext4
    with loop_ext4(tmp_path_factory.mktemp("ext4"), size_mb=64) as mnt:
        yield mnt


@pytest.fixture
def root(ext4, request):
    d = ext4 / request.node.name
    d.mkdir()
    return d


def pages(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (PAGE,), dtype=torch.uint8, generator=g) for _ in range(n)]


def keys(n, kind="kv", prefix="h"):
    return [PageKey(kind, f"{prefix}{i}") for i in range(n)]


def put(store, pks, data):
    return store.put(pks, [d.numel() for d in data], lambda i, dst: dst.copy_(data[i]))


def get(store, pks, size=PAGE):
    out = {}
    ok = store.get(pks, [size] * len(pks), lambda i, src: out.__setitem__(i, src.clone()))
    return ok, out


def test_one_direct_write_per_batch_and_reopen(root):
    s = DirectFileStore(root=root, namespace="m", staging_bytes=1 << 20, direct=DirectMode.ON)
    data, pks = pages(40), keys(40)
    assert put(s, pks, data) == [True] * 40
    assert s.stats.writes == 1 and s.stats.direct
    assert put(s, pks[:5], data[:5]) == [True] * 5 and s.stats.writes == 1      # present: not written again
    ok, out = get(s, pks + [PageKey("kv", "absent")])
    assert ok == [True] * 40 + [False]
    assert all(torch.equal(out[i], data[i]) for i in range(40))
    assert s.stats.reads == 1
    s.close()
    again = DirectFileStore(root=root, namespace="m", staging_bytes=1 << 20, direct=DirectMode.ON)
    assert again.present(pks) == [True] * 40
    assert get(again, pks[7:9])[0] == [True, True]
    # another namespace on the same directory: nothing of this one is found
    other = DirectFileStore(root=root, namespace="other", staging_bytes=1 << 20, direct=DirectMode.ON)
    assert other.present(pks) == [False] * 40
    again.close(), other.close()


def test_bytes_that_do_not_match_their_digest_are_a_miss(root):
    s = DirectFileStore(root=root, namespace="m", staging_bytes=1 << 20, direct=DirectMode.ON)
    data, pks = pages(4, seed=1), keys(4)
    put(s, pks, data)
    (path,) = list(s.dir.glob("*.kvb"))
    with open(path, "r+b") as f:             # page 2's slot starts at 2 * 4 * 4096
        f.seek(2 * 4 * 4096 + 10)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
    ok, out = get(s, pks)
    assert ok == [True, True, False, True]
    assert 2 not in out and s.stats.pages_corrupt == 1
    assert s.present(pks[2:3]) == [False]        # dropped from the index
    s.close()


def test_full_store_evicts_whole_batches_and_refuses_what_never_fits(root):
    one = 4 * 4096 * 4 + 4096                # 4 pages and a footer
    s = DirectFileStore(root=root, namespace="m", staging_bytes=1 << 20, capacity_bytes=2 * one, direct=DirectMode.ON)
    a, b, c = keys(4, prefix="a"), keys(4, prefix="b"), keys(4, prefix="c")
    assert put(s, a, pages(4)) == [True] * 4
    assert put(s, b, pages(4)) == [True] * 4
    assert get(s, a[:1])[0] == [True]              # a is now more recent than b
    assert put(s, c, pages(4)) == [True] * 4       # evicts b whole, keeps a
    assert s.present(b) == [False] * 4 and s.present(a) == [True] * 4 and s.stats.batches_evicted == 1
    assert put(s, keys(12, prefix="z"), pages(12)) == [False] * 12
    assert "store full" in s.stats.last_error
    s.close()


def test_read_only_and_missing_store(root, ext4):
    s = DirectFileStore(root=root, namespace="m", staging_bytes=1 << 20, direct=DirectMode.ON)
    pks, data = keys(3), pages(3)
    put(s, pks, data)
    subprocess.run(["mount", "-o", "remount,ro", str(ext4)], check=True)
    try:
        assert put(s, keys(2, prefix="new"), pages(2)) == [False, False]
        assert "Read-only" in s.stats.last_error or "read-only" in s.stats.last_error
        assert get(s, pks)[0] == [True] * 3        # still served
        ro = DirectFileStore(root=root, namespace="m", staging_bytes=1 << 20, direct=DirectMode.ON)
        assert ro.read_only and ro.present(pks) == [True] * 3
        ro.close()
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(ext4)], check=True)
    for p in s.dir.glob("*.kvb"):                 # the files vanish under the store: misses
        p.unlink()
    assert get(s, pks)[0] == [False] * 3
    assert "No such file" in s.stats.last_error
    s.close()


def test_a_batch_is_written_and_read_in_large_segments_whole_pages_each(root, monkeypatch):
    """A batch larger than `segment_bytes` goes out as several O_DIRECT writes into its one file
    (the I/O thread writes a segment while the next one is gathered) and comes back as several
    reads: each write and read starts on an ALIGN boundary, none but the last is shorter than a
    segment, no page is split between two, and the bytes round trip, also through a reopen."""
    import kvstage.storage.file_store as fs
    calls = []
    real_pwrite, real_preadv = os.pwrite, os.preadv
    monkeypatch.setattr(fs.os, "pwrite", lambda fd, b, off: calls.append(("w", off, len(b))) or real_pwrite(fd, b, off))
    monkeypatch.setattr(fs.os, "preadv", lambda fd, bs, off: calls.append(("r", off, len(bs[0]))) or real_preadv(fd, bs, off))
    slot = 4 * 4096                          # PAGE rounded up
    s = DirectFileStore(root=root, namespace="m", staging_bytes=1 << 20, direct=DirectMode.ON, segment_bytes=3 * slot)
    data, pks = pages(10, seed=3), keys(10)
    assert put(s, pks, data) == [True] * 10 and s.stats.writes == 1
    writes = [c for c in calls if c[0] == "w"]
    assert [(off, n) for _, off, n in writes[:-1]] == [(0, 3 * slot), (3 * slot, 3 * slot), (6 * slot, 3 * slot)]
    assert writes[-1][1] == 9 * slot and writes[-1][2] % 4096 == 0 and writes[-1][2] > slot   # page 9 + footer
    assert len(list(s.dir.glob("*.kvb"))) == 1
    calls.clear()
    ok, out = get(s, pks)
    assert ok == [True] * 10 and all(torch.equal(out[i], data[i]) for i in range(10))
    assert [(off, n) for _, off, n in calls] == [(0, 3 * slot), (3 * slot, 3 * slot), (6 * slot, 3 * slot),
                                                 (9 * slot, slot)]
    s.close()
    again = DirectFileStore(root=root, namespace="m", staging_bytes=1 << 20, direct=DirectMode.ON, segment_bytes=slot)
    ok, out = get(again, pks[2:7])
    assert ok == [True] * 5 and all(torch.equal(out[i], data[2 + i]) for i in range(5))
    again.close()
