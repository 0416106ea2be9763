"""kvstage's storage tier: a page store for SGLang's HiCache L3 (docs/storage.md).

- `batch_file`: the on-disk format of one batch (pure: layout, footer encoding, read runs).
- `prefetch`: how many pages a prefetch may take given the host memory the L2 pool needs (pure).
- `file_store`: `DirectFileStore`, local files written and read with O_DIRECT, one write per batch,
  and `PageStore`, the interface both stores offer the SGLang backend.
- `mooncake_store`: `MooncakePageStore`, Mooncake Store (a fleet's shared L3), one batch call each way.

The SGLang backend that drives it is `kvstage.adapters.sglang.storage.KvstageHiCacheStorage`.
"""
