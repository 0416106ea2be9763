"""Host staging memory (HostMemory) and StagingBuffer: alignment, pre-faulting, lifetime, huge pages."""

from __future__ import annotations

import gc
import logging

import numpy as np
import pytest
import torch

from kvstage.staging.buffers import StagingBuffer
from kvstage.staging.host_memory import BASE_PAGE_SIZE, HUGEPAGE_ENV, HostMemory, parse_hugepage_size


def smaps_entry(addr: int) -> dict[str, int]:
    """The /proc/self/smaps fields (kB) of the mapping that starts at `addr`."""
    fields: dict[str, int] = {}
    found = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:  # a mapping header "start-end perms ..."
                if found:
                    break
                found = int(head.split("-")[0], 16) == addr
            elif found and line.split()[-1] == "kB":
                fields[head.rstrip(":")] = int(line.split()[1])
    assert found, f"no mapping at {addr:#x} in /proc/self/smaps"
    return fields


def hugepages_free(size_kb: int) -> int:
    try:
        with open(f"/sys/kernel/mm/hugepages/hugepages-{size_kb}kB/free_hugepages") as f:
            return int(f.read())
    except OSError:
        return 0


@pytest.fixture(autouse=True)
def no_hugepage_env(monkeypatch):
    monkeypatch.delenv(HUGEPAGE_ENV, raising=False)


# ----------------------------------------------------------------------------- HostMemory

@pytest.mark.parametrize("request_size, mapped", [(1, 4096), (4096, 4096), (4097, 8192), (3 * 4096 + 1, 4 * 4096),
                                                  (1 << 20, 1 << 20)])
def test_alignment_and_rounding(request_size, mapped):
    with HostMemory(request_size) as mem:
        assert mem.addr % 4096 == 0
        assert mem.addr == mem.tensor.data_ptr()
        assert mem.nbytes == mapped == mem.tensor.numel()
        assert mem.requested_nbytes == request_size
        assert mem.page_size == BASE_PAGE_SIZE and not mem.hugepages
        assert mem.tensor.dtype == torch.uint8 and mem.tensor.dim() == 1


def test_zero_filled_and_writable():
    with HostMemory(3 * 4096 + 5) as mem:
        assert int(torch.count_nonzero(mem.tensor)) == 0
        mem.tensor[:] = 7
        assert int(mem.tensor.sum()) == 7 * mem.nbytes


def test_prefaulted():
    with HostMemory(8 << 20) as mem:
        entry = smaps_entry(mem.addr)
        assert entry["Size"] * 1024 == mem.nbytes
        assert entry["Rss"] * 1024 == mem.nbytes  # every page resident before any use


def test_zero_copy_view():
    with HostMemory(4096) as mem:
        view = mem.tensor[100:200]
        view.fill_(3)
        assert mem.tensor[150].item() == 3 and view.data_ptr() == mem.addr + 100
        del view


def test_close_is_idempotent():
    mem = HostMemory(4096)
    mem.close()
    mem.close()
    assert mem.closed
    with pytest.raises(ValueError, match="closed"):
        _ = mem.tensor


@pytest.mark.parametrize("make_view", [
    lambda t: t[10:20],
    lambda t: t.view(torch.int32),
    lambda t: t.numpy(),
    lambda t: memoryview(t.numpy()),
], ids=["slice", "dtype-view", "numpy", "memoryview"])
def test_close_with_live_view_raises_and_memory_stays_valid(make_view):
    mem = HostMemory(8192)
    view = make_view(mem.tensor)
    with pytest.raises(BufferError, match="live views"):
        mem.close()
    assert not mem.closed
    mem.tensor.fill_(42)  # still mapped and usable, through both the object and the view
    assert int(np.asarray(view).reshape(-1).view(np.uint8)[0]) == 42
    del view
    mem.close()
    assert mem.closed


def test_view_outlives_dropped_object():
    mem = HostMemory(4096)
    view = mem.tensor[:16]
    del mem
    gc.collect()
    view.fill_(5)  # the mapping is unmapped only when the last view is gone
    assert view.sum().item() == 80


def test_bad_sizes():
    with pytest.raises(ValueError, match="nbytes must be > 0"):
        HostMemory(0)
    with pytest.raises(TypeError, match="nbytes must be an int"):
        HostMemory(4096.0)


# ----------------------------------------------------------------------------- huge pages

def test_parse_hugepage_size():
    assert parse_hugepage_size(None) is None
    assert parse_hugepage_size("") is None
    assert parse_hugepage_size("0") is None
    assert parse_hugepage_size("off") is None
    assert parse_hugepage_size("2MB") == 2 << 20
    assert parse_hugepage_size("2mb") == 2 << 20
    assert parse_hugepage_size("1GB") == 1 << 30
    with pytest.raises(ValueError, match=HUGEPAGE_ENV):
        parse_hugepage_size("4MB")


def test_bad_env_value_raises(monkeypatch):
    monkeypatch.setenv(HUGEPAGE_ENV, "64KB")
    with pytest.raises(ValueError, match=f"{HUGEPAGE_ENV}='64KB'"):
        HostMemory(4096)


@pytest.mark.parametrize("setting, size_kb", [("2MB", 2048), ("1GB", 1 << 20)])
def test_hugepages_fall_back_with_one_warning(monkeypatch, caplog, setting, size_kb):
    if hugepages_free(size_kb) > 0:
        pytest.skip(f"this machine has free {setting} huge pages; the fallback cannot be provoked")
    monkeypatch.setenv(HUGEPAGE_ENV, setting)
    with caplog.at_level(logging.WARNING, logger="kvstage.staging.host_memory"):
        with HostMemory(5000) as mem:
            assert not mem.hugepages and mem.page_size == BASE_PAGE_SIZE
            assert mem.nbytes == 8192 and mem.addr % 4096 == 0
            assert smaps_entry(mem.addr)["Rss"] * 1024 == mem.nbytes
    records = [r for r in caplog.records if r.name == "kvstage.staging.host_memory"]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    msg = records[0].getMessage()
    assert "\n" not in msg
    assert f"{HUGEPAGE_ENV}={setting}" in msg and "huge pages unavailable" in msg and "falling back" in msg


def test_hugepages_when_available(monkeypatch):
    if hugepages_free(2048) < 2:
        pytest.skip("no free 2 MB huge pages on this machine")
    with HostMemory(3 << 20, hugepage_size="2MB") as mem:
        assert mem.hugepages and mem.page_size == 2 << 20
        assert mem.nbytes == 4 << 20 and mem.addr % (2 << 20) == 0


def test_argument_overrides_env(monkeypatch, caplog):
    monkeypatch.setenv(HUGEPAGE_ENV, "2MB")
    with caplog.at_level(logging.WARNING, logger="kvstage.staging.host_memory"):
        with HostMemory(4096, hugepage_size="off") as mem:
            assert not mem.hugepages
    assert not [r for r in caplog.records if r.name == "kvstage.staging.host_memory"]


# ----------------------------------------------------------------------------- StagingBuffer

def test_staging_buffer_host():
    with StagingBuffer.host(10_000) as buf:
        assert buf.kind == "DRAM" and buf.device == 0
        assert buf.nbytes == 12288 and buf.addr % 4096 == 0
        assert buf.tensor.data_ptr() == buf.addr and buf.tensor.dtype == torch.uint8
        region = buf.region(4096, 100)
        assert region.data_ptr() == buf.addr + 4096 and region.numel() == 100
        assert buf.region(buf.nbytes, 0).numel() == 0
        del region


def test_staging_buffer_mem_region():
    from kvstage.transfer.backends.base import MemRegion

    with StagingBuffer.host(4096) as buf:
        mr = buf.mem_region()
        assert mr == MemRegion(addr=buf.addr, length=4096, device=0, kind="DRAM")


@pytest.mark.parametrize("offset, nbytes, exc, match", [
    (0, 4097, ValueError, "exceeds the buffer of 4096 bytes"),
    (4000, 100, ValueError, "exceeds"),
    (-1, 10, ValueError, "offset must be >= 0"),
    (0, -5, ValueError, "nbytes must be >= 0"),
    (1.0, 10, TypeError, "offset must be an int"),
])
def test_staging_buffer_region_bounds(offset, nbytes, exc, match):
    with StagingBuffer.host(4096) as buf:
        with pytest.raises(exc, match=match):
            buf.region(offset, nbytes)


def test_staging_buffer_close():
    buf = StagingBuffer.host(4096)
    region = buf.region(0, 64)
    with pytest.raises(BufferError, match="live views"):
        buf.close()
    assert not buf.closed
    buf.region(0, 8).fill_(1)  # still usable after the refused close
    assert region[:8].sum().item() == 8
    del region
    buf.close()
    buf.close()
    assert buf.closed
    with pytest.raises(ValueError, match="closed"):
        buf.region(0, 1)
    with pytest.raises(ValueError, match="closed"):
        buf.mem_region()


def test_staging_buffer_cuda_validates_before_touching_cuda():
    with pytest.raises(ValueError, match="nbytes"):
        StagingBuffer.cuda(0, 0)
    with pytest.raises(ValueError, match="device_index"):
        StagingBuffer.cuda(4096, -1)
    assert not torch.cuda.is_initialized()


def test_staging_buffer_wraps_tensor():
    t = torch.zeros(128, dtype=torch.uint8)
    buf = StagingBuffer(t, "DRAM", 0)
    assert buf.addr == t.data_ptr() and buf.nbytes == 128
    buf.close()
    with pytest.raises(ValueError, match="kind"):
        StagingBuffer(t, "HBM", 0)
    with pytest.raises(ValueError, match="uint8"):
        StagingBuffer(t.view(torch.int8), "DRAM", 0)
