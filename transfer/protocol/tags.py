"""The notification tag every backend write carries: self-describing, versioned, signed.

A tag says exactly what the write put where (room, ring epoch, chunk, piece, writer, page
range, layer range, byte length, ring position), so the decode side can validate it against what it
expects before scattering a single byte. Bytes on the wire: ``b"KS" + msgpack array + mac``,
the mac (HMAC-SHA256, 16 bytes) keyed by the shared secret, or by the public integrity key
when none is configured (see kvstage.wire).
"""

from __future__ import annotations

import enum

import msgspec

from ...wire import MAC_BYTES, WIRE_VERSION, WireError, prebuild_struct_info, sign, verify

MAGIC = b"KS"
MAX_TAG_BYTES = 512


class TagKind(enum.IntEnum):
    DIRECT = 0
    STAGED = 1
    CREDIT = 2    # staged, into a ring credit (transfer/protocol/credits.py): a piece its writer cut itself, at
                  # `ring_start` inside one of its credits; the decode room planned no place for it


class Tag(msgspec.Struct, frozen=True, array_like=True):
    v: int
    kind: TagKind
    room: int
    session: int
    epoch: int          # decode incarnation (the ring's epoch)
    src: int            # writer incarnation
    writer: int         # writer's prefill TP rank
    chunk: int
    piece: int
    page_start: int
    num_pages: int
    nbytes: int
    ring_start: int     # linear ring position of the region (staged), -1 (direct)
    layer_start: int    # the layers the write holds: [layer_start, layer_start + num_layers)
    num_layers: int
    digest: int = 0     # xxh3-64 of the bytes written, in gather order (EngineConfig(verify=True))
    group: int = 0      # direct: which of the logical write's backend writes this is (one per
    groups: int = 1     # pair of memory kinds; every group's tag is the same but for `group`)
    pages_mask: bytes = b""   # direct, from a prefill that shards its pages (page_shards.py): bit i set
                              # means page position page_start + i is in the write; empty: every one


def make_tag(kind: TagKind, *, room: int, session: int, epoch: int, src: int, writer: int,
             chunk: int, piece: int, page_start: int, num_pages: int, layers: range, nbytes: int,
             ring_start: int = -1, pages_mask: bytes = b"") -> Tag:
    return Tag(WIRE_VERSION, kind, room, session, epoch, src, writer, chunk, piece,
               page_start, num_pages, nbytes, ring_start, layers.start, len(layers), pages_mask=pages_mask)


class TagCodec:
    def __init__(self, token: bytes | None):
        self.token = token
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(Tag)

    def encode(self, tag: Tag) -> bytes:
        body = MAGIC + self._enc.encode(tag)
        return body + sign(self.token, body)

    def decode(self, data: bytes) -> Tag:
        """Parse and verify; raises WireError for anything that is not a valid tag."""
        data = bytes(data)
        if len(data) > MAX_TAG_BYTES:
            raise WireError("oversized", f"tag of {len(data)} bytes")
        if len(data) < MAC_BYTES + len(MAGIC):
            raise WireError("malformed", "too short for a kvstage tag")
        body, mac = data[:-MAC_BYTES], data[-MAC_BYTES:]
        verify(self.token, body, mac)
        if not body.startswith(MAGIC):
            raise WireError("malformed", "not a kvstage tag")
        try:
            tag = self._dec.decode(body[len(MAGIC):])
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise WireError("malformed", str(exc)) from None
        if tag.v != WIRE_VERSION:
            raise WireError("version", f"tag version {tag.v}, this build speaks {WIRE_VERSION}")
        return tag


prebuild_struct_info(globals())  # last: every Struct above is defined (see kvstage.wire)
