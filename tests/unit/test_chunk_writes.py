"""The writes of one chunk towards one decode rank (transfer/protocol/prefill/chunk_writes.py): direct
parts split by descriptor count, staged writes per granted piece, the pools on the write that
ends at the request's last page, and grants that do not match the chunk refused with a reason."""

import itertools

import numpy as np
import pytest

from kvstage.transfer.protocol.actions import PeerKey
from kvstage.transfer.protocol.head_mapping import Assignment
from kvstage.transfer.protocol.messages import AllocGrant, Piece
from kvstage.transfer.protocol.prefill.chunk_writes import ChunkWrites, direct_writes, granted_writes
from kvstage.transfer.protocol.prefill.flows import Chunk
from kvstage.transfer.protocol.tags import TagKind

PEER = PeerKey("d", 0, 77)
HEAD_PAGE = 100          # bytes of one page of the chunk's layers, one head
POOLS = ("a pool copy",)  # stands for the request's PoolCopy tuple: only passed through


class _Copy:
    nbytes = 9


def writes(*, page_start: int = 0, pages: int = 10, pools_at: int | None = None, heads=(1, 3)) -> ChunkWrites:
    a = Assignment(prefill_rank=0, decode_rank=0, src_heads=heads, dst_heads=(2, 4), writer_index=1, num_writers=2)
    chunk = Chunk(index=0, page_start=page_start, pages=np.arange(100, 100 + pages), layers=range(2, 4))
    return ChunkWrites(room=5, me=11, writer=3, peer=PEER, session=6, assignment=a, chunk=chunk, wire=4,
                       head_page_bytes=HEAD_PAGE, pools_at=pools_at)


def test_a_direct_chunk_is_split_by_descriptor_count_and_the_last_part_carries_the_pools():
    asked = []

    def pools():
        asked.append(1)
        return (_Copy(),)

    ops = direct_writes(writes(page_start=4, pools_at=14), dst_pages=np.arange(500, 520), ranges_per_page=4,
                        max_ranges=12, pools=pools, op_ids=itertools.count(1))
    assert [op.src_pages.tolist() for op in ops] == [[100, 101, 102], [103, 104, 105], [106, 107, 108], [109]]
    assert [op.dst_pages.tolist() for op in ops] == [[504, 505, 506], [507, 508, 509], [510, 511, 512], [513]]
    assert [op.tag.page_start for op in ops] == [4, 7, 10, 13] and [op.piece for op in ops] == [0, 1, 2, 3]
    assert [op.nbytes for op in ops] == [3 * 2 * HEAD_PAGE] * 3 + [2 * HEAD_PAGE + 9]
    assert [len(op.pools) for op in ops] == [0, 0, 0, 1] and asked == [1]
    assert all(op.tag.kind is TagKind.DIRECT and op.tag.epoch == PEER.incarnation and op.tag.chunk == 4 for op in ops)
    assert [op.op_id for op in ops] == [1, 2, 3, 4] and not any(op.staged for op in ops)


def test_a_direct_chunk_that_does_not_end_the_request_carries_no_pools():
    ops = direct_writes(writes(pools_at=20), dst_pages=np.arange(10), ranges_per_page=1, max_ranges=1000,
                        pools=lambda: pytest.fail("asked for pools"), op_ids=itertools.count(1))
    assert len(ops) == 1 and ops[0].pools == () and ops[0].nbytes == 10 * 2 * HEAD_PAGE


def test_granted_pieces_become_one_write_each_at_this_writers_offset():
    grant = AllocGrant(src=1, dst=2, room=5, session=6, chunk=4, epoch=9,
                       pieces=[Piece(0, 0, 6, 1000, 6 * 4 * HEAD_PAGE), Piece(1, 6, 4, 4000, 4 * 4 * HEAD_PAGE + 50)])
    ops = granted_writes(writes(pools_at=10), grant, last_part=lambda kv: (kv * 2, (_Copy(),)),
                         op_ids=itertools.count(7))
    assert not isinstance(ops, str)
    assert [op.src_pages.tolist() for op in ops] == [list(range(100, 106)), list(range(106, 110))]
    assert [op.writer_offset for op in ops] == [6 * HEAD_PAGE * 2, 4 * HEAD_PAGE * 2]   # after heads 0, 1
    assert [op.nbytes for op in ops] == [6 * HEAD_PAGE * 2, 4 * HEAD_PAGE * 2 + 9]
    assert [len(op.pools) for op in ops] == [0, 1]
    assert [(op.tag.kind, op.tag.epoch, op.tag.ring_start, op.ring_start) for op in ops] == [
        (TagKind.STAGED, 9, 1000, 1000), (TagKind.STAGED, 9, 4000, 4000)]
    assert all(op.staged and op.dst_pages is None for op in ops)


@pytest.mark.parametrize("pieces,why", [
    ([Piece(0, 0, 6, 0, 10**6)], "does not cover it"),
    ([Piece(0, 1, 9, 0, 10**6)], "does not match the chunk"),                   # a gap before it
    ([Piece(0, 0, 6, 0, 10**6), Piece(1, 6, 5, 0, 10**6)], "does not match"),   # past the chunk's pages
    ([Piece(0, 0, 10, 0, 10 * 2 * HEAD_PAGE)], "does not match"),               # this part outside the region
    ([Piece(0, 0, 0, 0, 10**6), Piece(1, 0, 10, 0, 10**6)], "does not match"),  # an empty piece
])
def test_a_grant_that_does_not_fit_the_chunk_is_refused_with_nothing_made(pieces, why):
    ids = itertools.count(1)
    grant = AllocGrant(src=1, dst=2, room=5, session=6, chunk=4, epoch=9, pieces=pieces)
    out = granted_writes(writes(), grant, last_part=None, op_ids=ids)
    assert isinstance(out, str) and why in out and "chunk 4" in out, out


def test_a_room_refusing_a_grant_fails_and_keeps_no_write_of_it():
    """The room (prefill/room.py) fails on a grant that does not fit, and holds none of its
    pieces as in flight: nothing was posted, so it releases at once."""
    import torch

    from kvstage.transfer.config import Timeouts
    from kvstage.transfer.layout import KVLayout
    from kvstage.transfer.poll import KVPoll
    from kvstage.transfer.protocol.actions import StatusChanged
    from kvstage.transfer.protocol.messages import RoomMeta
    from kvstage.transfer.protocol.prefill.room import PrefillRoom

    layout = KVLayout(num_layers=2, total_kv_heads=2, head_dim=4, dtype=torch.uint8, page_size=2, tp_size=1,
                      tp_rank=0, mla=False)
    room = PrefillRoom(room=7, num_pages=4, layout=layout, me=1000, now=0.0, timeouts=Timeouts(),
                       op_ids=itertools.count(1))
    room.add_meta(PEER, 1, RoomMeta(src=PEER.incarnation, dst=1000, room=7, session=6, num_pages=4, staged=True), 1.0)
    room.add_chunk(np.arange(4), True, 1.0)
    big = 10**6
    grant = AllocGrant(src=PEER.incarnation, dst=1000, room=7, session=6, chunk=0, epoch=9,
                       pieces=[Piece(0, 0, 2, 0, big), Piece(1, 3, 1, 0, big)])   # page 2 left out
    out = room.on_grant(PEER, grant, 2.0)
    assert room.state is KVPoll.Failed and "does not match the chunk" in room.failure, room.failure
    assert room.ops == {} and any(isinstance(a, StatusChanged) and a.released for a in out), out
