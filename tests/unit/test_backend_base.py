"""Pure tests of transfer/backends/base.py: descriptors, range checks, the scoped registration
contract (with a tiny in-test fake backend), and create_backend's errors."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from kvstage.transfer.backends import (
    ArrivedTag,
    Backend,
    BackendError,
    MemRegion,
    RangeIndex,
    Registration,
    WriteHandle,
    WriteState,
    check_write_request,
    create_backend,
    descriptor_array,
)


# --------------------------------------------------------------------------- descriptor_array
def test_descriptor_array_from_rows_and_arrays():
    arr = descriptor_array([(1, 2, 0), (3, 4, 1)])
    assert arr.dtype == np.uint64 and arr.shape == (2, 3)
    assert arr.tolist() == [[1, 2, 0], [3, 4, 1]]
    strided = np.arange(12, dtype=np.int64).reshape(2, 6)[:, ::2]  # not contiguous
    out = descriptor_array(strided)
    assert out.flags["C_CONTIGUOUS"] and out.tolist() == [[0, 2, 4], [6, 8, 10]]
    assert descriptor_array(np.zeros((0, 3))).shape == (0, 3)


@pytest.mark.parametrize("bad", [[1, 2, 3], [(1, 2)], np.zeros((2, 4)), np.zeros((2, 3, 1))])
def test_descriptor_array_rejects_bad_shapes(bad):
    with pytest.raises(ValueError, match="N x 3"):
        descriptor_array(bad)


# --------------------------------------------------------------------------- RangeIndex
def test_range_index_inside_and_outside():
    idx = RangeIndex([(1000, 100), (1100, 50), (5000, 10), (7000, 0)])  # first two merge
    assert len(idx) == 2
    rows = descriptor_array(
        [
            (1000, 150, 0),  # spans the merged pair: inside
            (1149, 1, 0),  # last byte: inside
            (1149, 2, 0),  # one past the end
            (999, 1, 0),  # before
            (5000, 10, 0),  # exactly the second range
            (5005, 10, 0),  # overhangs it
            (7000, 1, 0),  # zero-length ranges register nothing
            (2**64 - 8, 16, 0),  # wraps around
        ]
    )
    assert idx.outside(rows).tolist() == [2, 3, 5, 6, 7]


def test_range_index_empty_and_overlapping():
    assert RangeIndex().outside(descriptor_array([(1, 1, 0), (2, 2, 0)])).tolist() == [0, 1]
    idx = RangeIndex([(100, 50), (120, 10), (140, 30)])  # overlapping: one span 100..170
    assert len(idx) == 1
    assert idx.outside(descriptor_array([(100, 70, 0), (100, 71, 0)])).tolist() == [1]


# --------------------------------------------------------------------------- check_write_request
def test_check_write_request_accepts_and_normalises():
    s, d, t = check_write_request([(1, 8, 0)], np.array([[2, 8, 0]]), bytearray(b"t"))
    assert s.dtype == d.dtype == np.uint64 and t == b"t" and isinstance(t, bytes)


@pytest.mark.parametrize(
    "src,dst,tag,match",
    [
        ([(1, 8, 0)], [(2, 9, 0)], b"t", "length mismatch at row 0"),
        ([(1, 8, 0), (9, 8, 0)], [(2, 8, 0)], b"t", "length mismatch: 2 source rows but 1"),
        (np.zeros((0, 3)), np.zeros((0, 3)), b"t", "at least one"),
        ([(1, 0, 0)], [(2, 0, 0)], b"t", "row 0 has length 0"),
        ([(1, 8, 0)], [(2, 8, 0)], "text", "tag must be bytes"),
        ([(1, 8, 0)], [(2, 8, 0)], b"", "tag must not be empty"),
        ([(1, 8)], [(2, 8, 0)], b"t", "bad descriptors"),
    ],
)
def test_check_write_request_errors(src, dst, tag, match):
    with pytest.raises(BackendError, match=match):
        check_write_request(src, dst, tag)


# --------------------------------------------------------------------------- scoped registration
class FakeBackend(Backend):
    """Just enough of a backend to exercise the base class's scoped-registration contract."""

    kind = "fake"

    def __init__(self, fail_register: bool = False):
        self.active: dict[int, Registration] = {}
        self.calls: list[str] = []
        self.fail_register = fail_register

    @property
    def name(self) -> str:
        return "fake"

    def identity(self) -> bytes:
        return b"fake"

    def register(self, regions):
        self.calls.append("register")
        if self.fail_register:
            raise BackendError("no")
        reg = Registration(tuple(regions))
        self.active[id(reg)] = reg
        return reg

    def deregister(self, registration):
        self.calls.append("deregister")
        if not registration.active:
            return
        registration.active = False
        del self.active[id(registration)]

    def connect(self, peer_identity):
        return "peer"

    def disconnect(self, peer):
        pass

    def post_write(self, peer, src, dst, tag, *, dst_kind=None):
        return WriteHandle(peer=peer, nbytes=0, ndesc=0, state=WriteState.DONE)

    def poll_write(self, handle):
        return handle.state

    def release_write(self, handle):
        pass

    def drain_tags(self):
        return [ArrivedTag("peer", b"t")]

    def close(self):
        for reg in list(self.active.values()):
            self.deregister(reg)


def test_registered_deregisters_on_normal_exit():
    be = FakeBackend()
    with be.registered([MemRegion(addr=4096, length=4096)]) as reg:
        assert reg.active and len(be.active) == 1
    assert not reg.active and be.active == {}


def test_registered_deregisters_on_error_and_reraises():
    be = FakeBackend()
    with pytest.raises(KeyError):
        with be.registered([MemRegion(addr=4096, length=4096)]) as reg:
            raise KeyError("inside")
    assert not reg.active and be.active == {}
    be.deregister(reg)  # idempotent
    assert be.calls == ["register", "deregister", "deregister"]


def test_registered_failure_to_register_propagates_without_deregister():
    be = FakeBackend(fail_register=True)
    with pytest.raises(BackendError):
        with be.registered([MemRegion(addr=4096, length=4096)]):
            pytest.fail("body must not run")
    assert be.calls == ["register"]


def test_memregion_defaults():
    r = MemRegion(addr=1, length=2)
    assert (r.device, r.kind) == (0, "DRAM")


# --------------------------------------------------------------------------- create_backend
def test_create_backend_unknown_kind():
    with pytest.raises(ValueError, match="kind must be one of"):
        create_backend("rdma-magic", "x")


@pytest.mark.parametrize(
    "kind,module,package",
    [("mooncake", "mooncake.engine", "mooncake-transfer-engine"), ("nixl", "nixl._api", "nixl-cu12")],
)
def test_create_backend_names_the_missing_package(monkeypatch, kind, module, package):
    # Make the library unimportable (None in sys.modules makes `import` raise ImportError) and
    # forget any already-imported implementation module; nothing real is constructed.
    monkeypatch.setitem(sys.modules, module, None)
    monkeypatch.delitem(sys.modules, f"kvstage.transfer.backends.{kind}_backend", raising=False)
    with pytest.raises(BackendError, match=package):
        create_backend(kind, "x")
