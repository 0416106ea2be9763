"""A staged chunk's pieces (transfer/protocol/decode/chunk_pieces.py): they tile the chunk's pages in
order, none holds more pages than the plan's piece size, each one's ring region holds its pages
of every writer, and the request's last piece also every writer's state pool block."""

from kvstage.transfer.protocol.decode.chunk_pieces import PiecesRefused, chunk_pieces
from kvstage.transfer.protocol.decode.plan import RoomPlan
from kvstage.transfer.protocol.decode.tracker import RoomTracker
from kvstage.transfer.protocol.ring import RingAllocator

PAGE = {0: 256, 1: 512}            # two writers' bytes per page (all of one layer)
POOLS = {0: 1024, 1: 256}          # their pool blocks, with the last page


def plan(ring_size: int, buffer_bytes: int = 1 << 20) -> RoomPlan:
    return RoomPlan(writers=(), staged=True, head_page_bytes=256, max_piece_pages=4, piece_bytes=4 * 512,
                    ring_size=ring_size, ring_align=256, buffer_bytes=buffer_bytes)


def test_pieces_tile_the_chunk_and_the_last_region_holds_the_pool_blocks():
    tracker = RoomTracker(10, PAGE, POOLS)
    ring = RingAllocator(1 << 16, 256)
    pieces = chunk_pieces(tracker, plan(ring.size), ring, page_start=0, num_pages=10, layers=range(1))
    assert not isinstance(pieces, PiecesRefused)
    assert [(p.page_start, p.num_pages) for p in pieces] == [(0, 4), (4, 4), (8, 2)]
    sizes = [p.region.nbytes for p in pieces]
    assert sizes == [4 * 768, 4 * 768, 2 * 768 + 1280]        # 768 B a page of both writers, 1280 B of pools


def test_a_chunk_before_the_last_carries_no_pool_bytes():
    tracker = RoomTracker(10, PAGE, POOLS)
    ring = RingAllocator(1 << 16, 256)
    pieces = chunk_pieces(tracker, plan(ring.size), ring, page_start=0, num_pages=6, layers=range(1))
    assert not isinstance(pieces, PiecesRefused)
    assert [p.region.nbytes for p in pieces] == [4 * 768, 2 * 768]


def test_the_last_piece_shrinks_until_its_pages_and_pool_blocks_fit_the_ring():
    tracker = RoomTracker(4, PAGE, POOLS)
    ring = RingAllocator(4096, 256)                 # 4 pages (3072 B) + pools (1280 B) would not fit
    pieces = chunk_pieces(tracker, plan(ring.size), ring, page_start=0, num_pages=4, layers=range(1))
    assert not isinstance(pieces, PiecesRefused)
    assert [(p.page_start, p.num_pages) for p in pieces] == [(0, 1), (1, 3)]
    assert pieces[-1].region.nbytes == 3 * 768 + 1280


def test_no_room_for_one_page_beside_the_pool_blocks_is_refused_with_the_sizes():
    tracker = RoomTracker(1, PAGE, POOLS)
    ring = RingAllocator(1792, 256)                 # 768 + 1280 > 1792
    refused = chunk_pieces(tracker, plan(ring.size), ring, page_start=0, num_pages=1, layers=range(1))
    assert isinstance(refused, PiecesRefused)
    assert "1280 bytes" in refused.reason and "1792 bytes" in refused.reason
