"""Digests of written bytes (verify): both sides digest the same logical bytes, and any flipped
byte changes the digest; the tag carries it; the setting is validated."""

import numpy as np
import pytest
import torch
import xxhash

from kvstage import EngineConfig
from kvstage.staging.digests import digest, gathered_digest
from kvstage.staging.gather_scatter import Gatherer
from kvstage.transfer.protocol.tags import TagCodec, TagKind, make_tag


def cache(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (8 * 4, 4, 16), generator=g, dtype=torch.uint8) for _ in range(3)]


def test_a_direct_write_digest_matches_the_landed_bytes_only_when_equal():
    src, dst = cache(1), cache(2)
    src_pages, dst_pages = np.array([3, 0, 5]), np.array([1, 7, 2])
    for s, d in zip(src, dst):  # the write: pages and heads 1..3 of each tensor
        d.view(8, 4, 4, 16)[dst_pages, :, 1:3] = s.view(8, 4, 4, 16)[src_pages, :, 1:3]
    n = 3 * 3 * 4 * 2 * 16
    sent = gathered_digest(Gatherer(), src, None, src_pages, 4, (1, 3), {}, (), n)
    # xxh3-64 of the bytes in the staged order: [layer][token][head] (MLA-like: K only)
    order = b"".join(s.view(8, 4, 4, 16)[src_pages, :, 1:3].contiguous().numpy().tobytes() for s in src)
    assert len(order) == n and sent == xxhash.xxh3_64_intdigest(order)
    assert gathered_digest(Gatherer(), dst, None, dst_pages, 4, (1, 3), {}, (), n) == sent
    dst[2].view(8, 4, 4, 16)[7, 3, 2, 5] ^= 1  # one bit of one landed byte
    assert gathered_digest(Gatherer(), dst, None, dst_pages, 4, (1, 3), {}, (), n) != sent
    with pytest.raises(ValueError, match="the write has"):
        gathered_digest(Gatherer(), dst, None, dst_pages, 4, (1, 3), {}, (), n + 1)


def test_digest_is_xxh3_of_the_bytes():
    data = torch.arange(100, dtype=torch.uint8)
    assert digest(data) == xxhash.xxh3_64_intdigest(bytes(range(100)))
    assert digest(data) != digest(torch.flip(data, (0,)))


def test_the_tag_carries_the_digest():
    codec = TagCodec(b"k")
    tag = make_tag(TagKind.STAGED, room=1, session=2, epoch=3, src=4, writer=0, chunk=0, piece=0, page_start=0,
                   num_pages=1, nbytes=10, ring_start=0, layers=range(2))
    assert codec.decode(codec.encode(tag)).digest == 0
    import msgspec
    sealed = msgspec.structs.replace(tag, digest=2**64 - 1)
    assert codec.decode(codec.encode(sealed)).digest == 2**64 - 1


def test_verify_setting(monkeypatch):
    base = dict(role="decode", engine_id="e", bootstrap="127.0.0.1:1")
    monkeypatch.delenv("KVSTAGE_VERIFY", raising=False)
    assert EngineConfig(**base).resolved().verify is False
    monkeypatch.setenv("KVSTAGE_VERIFY", "1")
    assert EngineConfig(**base).resolved().verify is True
    assert EngineConfig(**base, verify=False).resolved().verify is False
    monkeypatch.setenv("KVSTAGE_VERIFY", "maybe")
    with pytest.raises(ValueError, match="KVSTAGE_VERIFY"):
        EngineConfig(**base).resolved()
    with pytest.raises(ValueError, match="verify"):
        EngineConfig(**base, verify="sometimes").resolved()
