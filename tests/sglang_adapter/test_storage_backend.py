"""kvstage as SGLang's HiCache L3 backend, loaded by SGLang's own factory ("dynamic" backend) and
driven with SGLang's real host pools on CPU, over a loop-mounted ext4 image (O_DIRECT)."""

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolName, PoolTransfer
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.storage import StorageBackendFactory

from kvstage.storage.file_store import PageKey

PAGE = 64


@pytest.fixture(scope="module")
def ext4(tmp_path_factory):
    from loop_ext4 import loop_ext4
    with loop_ext4(tmp_path_factory.mktemp("ext4"), size_mb=96) as mnt:
        yield mnt


def host_pool(layout):
    kv = MHATokenToKVPool(1024, PAGE, torch.bfloat16, 2, 64, 2, "cpu", False, start_layer=0, end_layer=1)
    return MHATokenToKVPoolHost(kv.get_device_pool_infos()[0].buffer_info, 2, 0, PAGE, layout, pin_memory=False,
                                device_capacity_tokens=kv.size, start_layer=0, end_layer=1,
                                write_back_staging=kv.hicache_write_back_staging)


def backend(path, pool, model="m", **extra):
    config = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                  is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                                  model_name=model, extra_config={
                                      "backend_name": "kvstage", "module_path": "kvstage.adapters.sglang.storage",
                                      "class_name": "KvstageHiCacheStorage", "interface_v1": 1,
                                      "kvstage_path": str(path), "kvstage_direct": "on", **extra})
    b = StorageBackendFactory.create_backend("dynamic", config, pool)
    b.register_mem_pool_host(pool)
    return b


def fill(pool, idx, seed):
    g = torch.Generator().manual_seed(seed)
    for s in range(0, idx.numel(), PAGE):
        page = pool.get_dummy_flat_data_page()
        page.copy_(torch.randn(page.shape, generator=g).to(page.dtype))
        pool.set_from_flat_data_page(int(idx[s]), page)


def pages_of(pool, idx):
    return [pool.get_data_page(int(idx[s]), flat=True).clone() for s in range(0, idx.numel(), PAGE)]


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_batch_round_trip_through_sglang_factory(ext4, layout):
    pool = host_pool(layout)
    b = backend(ext4 / layout, pool)
    assert type(b).__name__ == "KvstageHiCacheStorage"
    src = pool.alloc(8 * PAGE)
    fill(pool, src, seed=3)
    keys = [f"{layout}-{i}" for i in range(8)]
    assert b.batch_set_v1(keys, src) == [True] * 8
    assert b.store.stats.writes == 1                  # one O_DIRECT write for the batch
    assert b.batch_exists(keys + ["absent"]) == 8
    dst = pool.alloc(8 * PAGE)
    assert b.batch_get_v1(keys, dst) == [True] * 8
    assert b.store.stats.reads == 1
    for a, c in zip(pages_of(pool, src), pages_of(pool, dst)):
        assert torch.equal(a, c)
    # another model on the same directory: a miss, never its bytes
    assert backend(ext4 / layout, host_pool(layout), model="other").batch_exists(keys) == 0
    b.close()


def test_corrupt_page_is_a_miss_and_server_side_errors_are_misses(ext4):
    pool = host_pool("page_first")
    b = backend(ext4 / "corrupt", pool)
    src = pool.alloc(4 * PAGE)
    fill(pool, src, seed=4)
    keys = [f"c{i}" for i in range(4)]
    b.batch_set_v1(keys, src)
    (path,) = list(b.store.dir.glob("*.kvb"))
    with open(path, "r+b") as f:                      # one byte of page 1
        f.seek(b._anchor.page_bytes + 5)
        x = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([x[0] ^ 1]))
    dst = pool.alloc(4 * PAGE)
    before = pages_of(pool, dst)
    assert b.batch_get_v1(keys, dst) == [True, False, True, True]
    assert torch.equal(pages_of(pool, dst)[1], before[1])     # the bad page's bytes never landed
    assert b.stats()["pages_corrupt"] == 1
    assert b.batch_get_v1(keys, dst[:PAGE]) == [False] * 4    # too few indices: a miss, not an exception
    assert "host indices" in b.stats()["last_error"]
    b.close()


def test_prefetch_shrinks_to_the_free_host_memory(ext4):
    pool = host_pool("page_first")
    b = backend(ext4 / "budget", pool, kvstage_prefetch_reserve=0.25)
    src = pool.alloc(16 * PAGE)
    fill(pool, src, seed=5)
    keys = [f"p{i}" for i in range(16)]
    assert b.batch_set_v1(keys, src) == [True] * 16
    pool.free(src)
    assert b.batch_exists(keys) == 16
    spare = (pool.available_size() - int(pool.size * 0.25)) // PAGE
    held = pool.alloc((spare - 5) * PAGE)           # 5 pages spare beyond the L2 reserve
    assert held is not None
    assert b.batch_exists(keys) == 5
    s = b.stats()
    assert (s["prefetch_shrunk"], s["prefetch_pages_requested"], s["prefetch_pages_granted"]) == (1, 32, 21)
    # SGLang asks batch by batch (prefix_keys: the hashes before the batch) and allocates after
    # the last answer: the second batch gets what the first one left
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo
    assert b.batch_exists(keys[:3], HiCacheStorageExtraInfo(prefix_keys=[])) == 3
    assert b.batch_exists(keys[3:8], HiCacheStorageExtraInfo(prefix_keys=keys[:3])) == 2
    assert b.batch_exists(keys[3:8], HiCacheStorageExtraInfo(prefix_keys=["elsewhere"])) == 5
    b.close()


def test_hybrid_pools_share_one_batch_and_are_evicted_together(ext4):
    kv, state = host_pool("page_first"), host_pool("layer_first")
    page_file = 16 * 65536 + 4096      # 8 KV + 8 state pages (2 layers x K,V x 64 tokens x 2 heads x 64 x bf16), footer
    from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry
    group = HostPoolGroup([PoolEntry(PoolName.KV, kv, None, lambda i: i, is_primary_index_anchor=True),
                           PoolEntry(PoolName.MAMBA, state, None, lambda i: i)])
    b = backend(ext4 / "hybrid", group, kvstage_capacity_gb=(2 * page_file) / (1 << 30))   # as SGLang does:
    b.register_mem_host_pool_v2(kv, PoolName.KV)                                            # the group, then
    b.register_mem_host_pool_v2(state, PoolName.MAMBA)                                      # each pool
    ki, si = kv.alloc(8 * PAGE), state.alloc(8 * PAGE)
    fill(kv, ki, seed=6), fill(state, si, seed=7)
    first = [f"x{i}" for i in range(8)]
    res = b.batch_set_v2([PoolTransfer(name=PoolName.KV, host_indices=ki, keys=first),
                          PoolTransfer(name=PoolName.MAMBA, host_indices=si, keys=first)])
    assert res == {PoolName.KV: [True] * 8, PoolName.MAMBA: [True] * 8}
    assert b.store.stats.writes == 1                 # both kinds in one batch file
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy
    hit = b.batch_exists_v2(first, [PoolTransfer(name=PoolName.MAMBA, keys=first[-1:],
                                                 hit_policy=PoolHitPolicy.TRAILING_PAGES)])
    assert hit.kv_hit_pages == 8
    kd, sd = kv.alloc(8 * PAGE), state.alloc(8 * PAGE)
    got = b.batch_get_v2([PoolTransfer(name=PoolName.KV, host_indices=kd, keys=first),
                          PoolTransfer(name=PoolName.MAMBA, host_indices=sd, keys=first)])
    assert got == {PoolName.KV: [True] * 8, PoolName.MAMBA: [True] * 8}
    assert all(torch.equal(a, c) for a, c in zip(pages_of(state, si), pages_of(state, sd)))
    # two more batches: the first one goes, its KV pages and its states together
    for n in range(2):
        more = [f"y{n}-{i}" for i in range(8)]
        b.batch_set_v2([PoolTransfer(name=PoolName.KV, host_indices=ki, keys=more),
                        PoolTransfer(name=PoolName.MAMBA, host_indices=si, keys=more)])
    assert b.store.stats.batches_evicted >= 1
    kinds = {p.kind for p in b._pools.values()}
    assert len(kinds) == 2
    assert not any(b.store.contains(PageKey(k, key)) for k in kinds for key in first)
    assert all(b.store.contains(PageKey(k, f"y1-{i}")) for k in kinds for i in range(8))
    b.close()


def test_mooncake_store_behind_the_same_backend(tmp_path):
    from kvstage.support.mooncake_master import mooncake_master
    pool = host_pool("page_first")
    with mooncake_master(tmp_path) as (master, metadata):
        b = backend(tmp_path, pool, kvstage_store="mooncake", kvstage_mooncake_master=master,
                    kvstage_mooncake_metadata=metadata, kvstage_mooncake_segment_gb=0.0625, kvstage_staging_mb=4)
        src, dst = pool.alloc(8 * PAGE), pool.alloc(8 * PAGE)
        fill(pool, src, seed=8)
        keys = [f"mc{i}" for i in range(8)]
        assert b.batch_set_v1(keys, src) == [True] * 8
        assert b.store.stats.writes == 1                  # one batch_put_from
        assert b.batch_exists(keys + ["absent"]) == 8
        assert b.batch_get_v1(keys, dst) == [True] * 8
        assert all(torch.equal(a, c) for a, c in zip(pages_of(pool, src), pages_of(pool, dst)))
        # written in place from the pool, read back by the staged path: the same objects
        kind = b._anchor.kind
        flat = {}
        assert b.store.get([PageKey(kind, k) for k in keys], [b._anchor.page_bytes] * 8,
                           lambda i, page: flat.__setitem__(i, page.clone())) == [True] * 8
        assert torch.equal(flat[2].view(pool.dtype), pool.get_data_page(int(src[2 * PAGE]), flat=True))
        # an object whose page does not match its trailer: a miss on the in-place read
        raw = bytearray(b.store._store.get(b.store._key(PageKey(kind, keys[0]))))
        raw[7] ^= 0x40
        assert b.store._store.put(b.store._key(PageKey(kind, "bad")), bytes(raw)) == 0
        assert b.batch_get_v1([keys[1], "bad"], dst) == [True, False]
        assert b.stats()["pages_corrupt"] == 1
        # trailers checked in one step per batch: bad pages first and last are misses, and
        # each good page between them is matched with its own trailer
        assert b.store._store.put(b.store._key(PageKey(kind, "bad2")), bytes(raw)) == 0
        assert b.batch_get_v1(["bad", keys[2], keys[3], "bad2"], dst) == [False, True, True, False]
        assert b.stats()["pages_corrupt"] == 3
        assert all(torch.equal(pool.get_data_page(int(dst[at * PAGE]), flat=True),
                               pool.get_data_page(int(src[i * PAGE]), flat=True)) for at, i in ((1, 2), (2, 3)))
        b.close()


def test_a_store_that_cannot_be_opened_fails_the_attach_with_its_reason(tmp_path):
    from kvstage.storage.file_store import StoreError
    (tmp_path / "a-file").write_text("not a directory")
    b = backend(tmp_path / "a-file" / "kv", host_pool("page_first"))
    with pytest.raises(StoreError, match="cannot be made"):
        b.on_host_pools_registered()          # SGLang calls it at attach: the attach fails, named
    assert b.batch_exists(["k"]) == 0          # a data call never raises: a miss
    assert not b.exists("k")
