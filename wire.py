"""Signed, versioned msgspec frames: the wire format of every kvstage socket.

The rendezvous server and the rank-to-rank control plane both speak it, so it is a module of its
own: it imports neither torch nor the server, and both the pure protocol (transfer/protocol/)
and bootstrap/ import it.

A frame is two zmq parts: ``[payload, mac]``. ``payload`` is a msgpack-encoded msgspec Struct
from a tagged union (its type tag in field ``t``, its version in field ``v``). ``mac`` is
HMAC-SHA256 of the payload, truncated to 16 bytes, keyed with the shared secret when one is
configured (authentication) or with a fixed public key otherwise (integrity only: a corrupted
frame is refused rather than misread). Decoding anything else raises exactly one error type,
`WireError`. Never pickle.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Generic, TypeVar

import msgspec

WIRE_VERSION = 7   # 2: layer ranges in AllocRequest and tags (layer-wise sending); 3: HelloAck.costs (path choice);
                   # 4: HelloAck.credits and credit tags (ring credits); 5: Hello.pp_size/stage_* (decode PP);
                   # 6: Hello.dcp_size/dcp_rank (decode context parallel) and the EngineBeat message (engine-pair leases);
                   # 7: Tag.pages_mask (KV page sharding)
MAC_BYTES = 16
DEFAULT_MAX_FRAME = 4 << 20  # bytes; a NIXL agent's metadata is a few KiB
TOKEN_ENV = "KVSTAGE_AUTH_TOKEN"
INTEGRITY_KEY = b"kvstage-integrity-v1"  # public: detects corruption, proves nothing about the sender


class WireError(ValueError):
    """A frame that is malformed, truncated, oversized, of the wrong version or badly signed."""

    def __init__(self, kind: str, detail: str):
        super().__init__(f"{kind}: {detail}")
        self.kind = kind  # "malformed" | "oversized" | "version" | "auth" | "integrity"


class Message(msgspec.Struct, tag_field="t", kw_only=True, frozen=True):
    """Base of every wire message: a type tag (`t`, the class name) and a version (`v`)."""

    v: int = WIRE_VERSION


M = TypeVar("M", bound=Message)


class _Versioned(msgspec.Struct):
    """Just the version of any message: read first, so a newer peer gets "version", not
    "malformed", even when its messages have other fields."""

    v: int = WIRE_VERSION


def load_token(token: str | None = None, token_file: str | os.PathLike[str] | None = None) -> bytes | None:
    """The shared secret: explicit value, else a file's first line, else $KVSTAGE_AUTH_TOKEN.

    Returns None when none is configured (authentication off).
    """
    if token is None and token_file is not None:
        token = Path(token_file).read_text().strip()
    if token is None:
        token = os.environ.get(TOKEN_ENV) or None
    if token is None:
        return None
    if not token:
        raise ValueError("the auth token is empty")
    return token.encode()


def sign(token: bytes | None, payload: bytes) -> bytes:
    """The MAC of a payload: keyed by the token, or by the public integrity key without one."""
    return hmac.new(token if token is not None else INTEGRITY_KEY, payload, hashlib.sha256).digest()[:MAC_BYTES]


def verify(token: bytes | None, payload: bytes, mac: bytes) -> None:
    """Raise WireError unless `mac` is the payload's MAC under `token` (or the integrity key)."""
    if len(mac) != MAC_BYTES or not hmac.compare_digest(mac, sign(token, payload)):
        if token is not None:
            raise WireError("auth", "missing or wrong token")
        raise WireError("integrity", "the frame's checksum does not match (corrupted, or signed with a token "
                                     "this side does not have)")


class Codec(Generic[M]):
    """Encodes and decodes the messages of one channel (a union of Message subclasses)."""

    def __init__(self, types: Sequence[type[M]], token: bytes | None = None,
                 max_frame: int = DEFAULT_MAX_FRAME):
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(_union(types))
        self._version = msgspec.msgpack.Decoder(_Versioned)
        self.token = token
        self.max_frame = max_frame

    def encode(self, msg: M) -> list[bytes]:
        payload = self._encoder.encode(msg)
        if len(payload) > self.max_frame:
            raise WireError("oversized", f"{type(msg).__name__} is {len(payload)} bytes (max {self.max_frame})")
        return [payload, sign(self.token, payload)]

    def decode(self, parts: Sequence[bytes | Any]) -> M:
        """Verify and decode ``[payload, mac]``; raise WireError on anything wrong."""
        if len(parts) != 2:
            raise WireError("malformed", f"expected 2 frame parts, got {len(parts)}")
        payload, mac = (bytes(p) for p in parts)
        if len(payload) > self.max_frame:
            raise WireError("oversized", f"{len(payload)} bytes (max {self.max_frame})")
        verify(self.token, payload, mac)
        try:
            version = self._version.decode(payload).v
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise WireError("malformed", str(exc)) from None
        if version != WIRE_VERSION:
            raise WireError("version", f"version {version}, this build speaks {WIRE_VERSION}")
        try:
            msg: M = self._decoder.decode(payload)
            return msg
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise WireError("malformed", str(exc)) from None


def prebuild_struct_info(namespace: dict[str, Any]) -> tuple[type, ...]:
    """Make msgspec build the decoding info of every Struct class a module defines, now.

    msgspec builds a Struct type's info (and the lookups of its enum and literal fields) lazily,
    on the type's first decode or convert, and two threads making that first use at once can
    crash the process with SIGSEGV (msgspec 0.22; docs/development.md has the reproduction).
    Every module that defines messages calls this on its last line, so the import, which
    Python's import lock runs once, builds them before any thread can use them.
    """
    module = namespace["__name__"]
    types = tuple(v for v in namespace.values()
                  if isinstance(v, type) and issubclass(v, msgspec.Struct) and v.__module__ == module)
    for t in types:
        msgspec.msgpack.Decoder(t)
    PREBUILT.update(types)
    return types


PREBUILT: set[type] = set()  # every Struct class prebuild_struct_info saw (the tests check it is all of them)


def _union(types: Sequence[type]) -> Any:
    if not types:
        raise ValueError("a codec needs at least one message type")
    u: Any = types[0]
    for t in types[1:]:
        u = u | t
    return u


prebuild_struct_info(globals())
