"""Transfer backends: the interface (base.py) and its NIXL and Mooncake implementations.

The implementations are imported lazily by ``create_backend``, so this package imports on a
machine that has only one of the two libraries (or neither).
"""

from __future__ import annotations

from .base import (
    ArrivedTag,
    Backend,
    BackendError,
    MemRegion,
    RangeIndex,
    Registration,
    WriteHandle,
    WriteState,
    check_write_request,
    descriptor_array,
)

__all__ = [
    "ArrivedTag",
    "Backend",
    "BackendError",
    "MemRegion",
    "RangeIndex",
    "Registration",
    "WriteHandle",
    "WriteState",
    "check_write_request",
    "create_backend",
    "descriptor_array",
    "BACKEND_KINDS",
]

BACKEND_KINDS = ("nixl", "mooncake")

# kind -> (module, class, the distribution that provides the library, its top-level import)
_IMPLEMENTATIONS = {
    "nixl": ("nixl_backend", "NixlBackend", "nixl-cu12 (pip install nixl-cu12==1.5.1)", "nixl"),
    "mooncake": (
        "mooncake_backend",
        "MooncakeBackend",
        "mooncake-transfer-engine-non-cuda (pip install mooncake-transfer-engine-non-cuda; "
        "it also needs Debian's libibverbs1 and libnuma1)",
        "mooncake",
    ),
}


def create_backend(kind: str, name: str, host: str = "127.0.0.1", **options: object) -> Backend:
    """Build the backend named by `kind` ("nixl" or "mooncake").

    `name` labels this endpoint (NIXL makes it unique per process life; Mooncake's peer name is
    its "host:rpc_port"), `host` is the address it binds/advertises (Mooncake; NIXL lets UCX
    pick), `options` go to the implementation's constructor. Raises ValueError for an unknown
    kind and BackendError naming the package when the library is not installed.
    """
    if kind not in _IMPLEMENTATIONS:
        raise ValueError(f"kind must be one of {BACKEND_KINDS}, got {kind!r}")
    module_name, class_name, package, top = _IMPLEMENTATIONS[kind]
    import importlib

    try:
        module = importlib.import_module(f"{__name__}.{module_name}")
    except ImportError as exc:  # the library, or a shared library it links, is missing
        raise BackendError(f"the {kind!r} backend needs {package}; importing {top!r} failed: {exc}") from exc
    cls = getattr(module, class_name)
    backend: Backend = cls(name, host, **options)
    return backend
