"""Page-aligned, pre-faulted host memory for CPU staging buffers.

`HostMemory(nbytes)` maps private anonymous memory, asks for transparent huge pages
(``MADV_HUGEPAGE``: NIXL's shared-memory copy pins pages one by one), rounds the size up to the
page size, and writes one byte of every 4 KiB page so that every page is faulted in before the
first transfer: a copy into freshly mapped memory runs at about half of memcpy speed here (see
docs/staging_kernels.md).

Huge pages: set ``KVSTAGE_HUGEPAGE_SIZE`` to ``2MB`` or ``1GB`` (or pass ``hugepage_size=``) to
map with ``MAP_HUGETLB`` and the matching size bits. Python's `mmap` passes its flags straight to
mmap(2), so no ctypes is needed and the safety below still holds. When the kernel has no huge
pages of that size to give (none reserved in ``/proc/sys/vm/nr_hugepages``, unsupported size...),
the allocation falls back to normal pages and logs ONE warning saying why. An unknown value of
the variable is a ``ValueError``.

Lifetime and safety
-------------------
`.tensor` is a zero-copy ``torch.uint8`` view of the mapping. It (and every view derived from it:
slices, ``.view(dtype)``, numpy arrays from ``.numpy()``) keeps a buffer export of the mapping
alive through a `memoryview`, and Python's `mmap` refuses to unmap while exports exist.
Therefore:

- `close()` while any such view is still alive raises `BufferError` (the mapping stays valid and
  usable, `close()` can be retried once the views are gone); it never leaves a dangling pointer.
- Dropping the `HostMemory` object without `close()` is safe as well: the mapping is unmapped
  only when the last view is gone.
- `close()` is idempotent. After a successful `close()`, `.tensor` raises `ValueError`.

What Python cannot see: raw addresses (`.addr`) handed to a transfer backend. Deregister the
memory from every backend (and make sure no remote peer still writes into it) BEFORE `close()`.
"""

from __future__ import annotations

import gc
import logging
import mmap
import os

import torch

__all__ = ["HostMemory", "parse_hugepage_size", "HUGEPAGE_ENV", "BASE_PAGE_SIZE"]

log = logging.getLogger(__name__)

#: The environment variable that asks for huge pages ("2MB" or "1GB"; unset/""/"0"/"off": none).
HUGEPAGE_ENV = "KVSTAGE_HUGEPAGE_SIZE"

#: The normal page size of this machine (4096 on x86-64).
BASE_PAGE_SIZE = mmap.PAGESIZE

# Linux flag values (include/uapi/asm-generic/mman-common.h, linux/mman.h); Python's mmap module
# does not export them but passes any flag bits through to mmap(2).
_MAP_HUGETLB = 0x40000
_MAP_HUGE_SHIFT = 26
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)

_HUGEPAGE_SIZES = {
    "2MB": 2 << 20, "2M": 2 << 20, "2MIB": 2 << 20,
    "1GB": 1 << 30, "1G": 1 << 30, "1GIB": 1 << 30,
}
_OFF_VALUES = {"", "0", "OFF", "NONE", "NO", "FALSE"}


def parse_hugepage_size(value: str | None) -> int | None:
    """Parse a huge page size setting: "2MB" -> 2 MiB, "1GB" -> 1 GiB, unset/""/"0"/"off" -> None.

    Raises ValueError naming KVSTAGE_HUGEPAGE_SIZE for anything else.
    """
    if value is None:
        return None
    key = value.strip().upper()
    if key in _OFF_VALUES:
        return None
    try:
        return _HUGEPAGE_SIZES[key]
    except KeyError:
        raise ValueError(
            f"{HUGEPAGE_ENV}={value!r}: expected '2MB' or '1GB' (or unset/'0' for normal pages)"
        ) from None


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _hugepage_free(size: int) -> str:
    """How many huge pages of `size` the kernel has free, for the fallback message."""
    path = f"/sys/kernel/mm/hugepages/hugepages-{size // 1024}kB/free_hugepages"
    try:
        with open(path) as f:
            return f"{f.read().strip()} free"
    except OSError:
        return "size not supported by this kernel"


def _fmt_size(n: int) -> str:
    if n % (1 << 30) == 0:
        return f"{n >> 30} GiB"
    if n % (1 << 20) == 0:
        return f"{n >> 20} MiB"
    return f"{n} B"


class HostMemory:
    """An anonymous, page-aligned, pre-faulted host mapping that owns its memory.

    Attributes: `tensor` (torch.uint8, 1-D, zero-copy), `addr` (int), `nbytes` (the mapped size,
    rounded up to `page_size`), `requested_nbytes`, `page_size` (4096 or the huge page size
    actually used), `hugepages` (bool). See the module docstring for the lifetime rules.
    """

    def __init__(self, nbytes: int, *, hugepage_size: str | None = None) -> None:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int):
            raise TypeError(f"nbytes must be an int, got {type(nbytes).__name__}")
        if nbytes <= 0:
            raise ValueError(f"nbytes must be > 0, got {nbytes}")
        setting = os.environ.get(HUGEPAGE_ENV) if hugepage_size is None else hugepage_size
        huge = parse_hugepage_size(setting)

        self.requested_nbytes = nbytes
        self._mm: mmap.mmap | None = None
        self._tensor: torch.Tensor | None = None
        self.hugepages = False
        self.page_size = BASE_PAGE_SIZE

        if huge is not None:
            size = _round_up(nbytes, huge)
            flags = mmap.MAP_SHARED | _MAP_HUGETLB | (huge.bit_length() - 1) << _MAP_HUGE_SHIFT
            try:
                self._mm = mmap.mmap(-1, size, flags=flags | _MAP_POPULATE)
                self.hugepages = True
                self.page_size = huge
            except OSError as exc:
                log.warning(
                    "%s=%s: huge pages unavailable (mmap MAP_HUGETLB of %s failed: %s; %s huge pages %s); "
                    "falling back to %d-byte pages",
                    HUGEPAGE_ENV, setting, _fmt_size(size), exc.strerror or exc, _fmt_size(huge),
                    _hugepage_free(huge), BASE_PAGE_SIZE,
                )
        if self._mm is None:
            # private, and asked for transparent huge pages before the first touch below faults
            # the pages in: NIXL's shared-memory copy (cma) pins pages one by one, so 2 MiB pages
            # make it faster (docs/journal/benchmarks-2026-11.md); shared anonymous memory would need shmem THP
            size = _round_up(nbytes, BASE_PAGE_SIZE)
            self._mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)
            if hasattr(mmap, "MADV_HUGEPAGE"):
                try:
                    self._mm.madvise(mmap.MADV_HUGEPAGE)
                except OSError:  # THP disabled ("never") or unsupported: 4 KiB pages it is
                    pass
        self.nbytes = size

        # The memoryview holds the buffer export that makes mmap.close() refuse while any tensor
        # view lives (torch.frombuffer itself releases its export and keeps only a reference).
        self._tensor = torch.frombuffer(memoryview(self._mm), dtype=torch.uint8)
        self.addr = self._tensor.data_ptr()
        # Fault every page in (MAP_POPULATE is best effort and absent on some platforms): one
        # byte per 4 KiB page, writing the zero that is already there.
        self._tensor.view(-1, BASE_PAGE_SIZE)[:, 0] = 0

    @property
    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            raise ValueError("HostMemory is closed")
        return self._tensor

    @property
    def closed(self) -> bool:
        return self._mm is None

    def close(self) -> None:
        """Unmap the memory. Idempotent. Raises BufferError while views of it are still alive."""
        if self._mm is None:
            return
        self._tensor = None
        try:
            self._mm.close()
        except BufferError:
            gc.collect()  # views that only live in collectable reference cycles
            try:
                self._mm.close()
            except BufferError:
                self._tensor = torch.frombuffer(memoryview(self._mm), dtype=torch.uint8)
                raise BufferError(
                    f"HostMemory.close(): the {self.nbytes}-byte mapping at {self.addr:#x} still has "
                    "live views (tensors, numpy arrays or memoryviews of it); drop them first"
                ) from None
        self._mm = None

    def __enter__(self) -> HostMemory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"addr={self.addr:#x}"
        return f"HostMemory(nbytes={self.nbytes}, page_size={self.page_size}, {state})"
