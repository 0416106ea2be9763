"""THE staging handler: allocates and registers through the backend's callbacks, scoped."""

import pytest
import torch

from kvstage.staging.handler import StagingHandler
from kvstage.transfer.protocol.ring import Watermark


class FakeBackend:
    """Only the two callbacks a backend plugs in (the real ones are tested in test_backends)."""

    def __init__(self, fail_register=False):
        self.live, self.calls, self.fail_register = [], [], fail_register

    def register(self, regions):
        self.calls.append(("register", [r.length for r in regions]))
        if self.fail_register:
            raise RuntimeError("registration refused")
        reg = object()
        self.live.append(reg)
        return reg

    def deregister(self, reg):
        self.calls.append(("deregister",))
        self.live.remove(reg)


def handler(role, backend, **kw):
    return StagingHandler(role, backend.register, backend.deregister, epoch=9, device=torch.device("cpu"), **kw)


def test_prefill_buffers_registered_once_and_released():
    b = FakeBackend()
    with handler("prefill", b, workers=3, buffer_bytes=1 << 20) as h:
        assert len(h.buffers) == 3 and h.buffer_bytes == 1 << 20
        assert b.calls == [("register", [1 << 20] * 3)] and len(b.live) == 1
        assert all(buf.addr % 4096 == 0 and buf.kind == "DRAM" for buf in h.buffers)
    assert b.live == [] and h.buffers == []


def test_decode_ring_and_allocator():
    b = FakeBackend()
    with handler("decode", b, ring_bytes=(1 << 20) + 100) as h:
        assert h.ring.nbytes >= 1 << 20 and h.allocator.size == h.ring.nbytes
        view = h.ring_view(4096, 256)
        assert view.numel() == 256
        del view
    assert b.live == [] and h.ring is None


def test_registration_failure_frees_everything():
    b = FakeBackend(fail_register=True)
    h = handler("prefill", b, workers=2, buffer_bytes=1 << 16)
    with pytest.raises(RuntimeError, match="registration refused"):
        h.open()
    assert b.live == [] and h.buffers == []


def test_exception_inside_the_scope_deregisters():
    b = FakeBackend()
    with pytest.raises(KeyError):
        with handler("decode", b, ring_bytes=1 << 16):
            raise KeyError("boom")
    assert b.live == [] and b.calls[-1] == ("deregister",)


def test_remote_watermarks_per_decode_peer():
    h = handler("prefill", FakeBackend())
    assert not h.region_free(5, 0, 10)            # unknown peer: never free
    h.subscribe(5, epoch=77, ring_size=1000)
    assert h.region_free(5, 0, 1000) and not h.region_free(5, 500, 600)
    assert h.on_watermark(5, 77, Watermark(0, 500)) and h.region_free(5, 500, 1000)
    assert not h.on_watermark(5, 78, Watermark(9, 0)), "another epoch (a restarted ring) is ignored"
    h.unsubscribe(5)
    assert not h.region_free(5, 0, 1)
