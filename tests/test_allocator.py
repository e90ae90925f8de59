"""BlockAllocator on its own: placement, page emptying, straddling blocks, failure."""

import pytest

from jax_kvcached.memory.allocator import BlockAllocator
from jax_kvcached.memory.errors import PoolExhausted


class Mapper:
    def __init__(self, fail: bool = False) -> None:
        self.calls: list[list[int]] = []
        self.fail = fail

    def __call__(self, pages: list[int]) -> None:
        if self.fail:
            raise PoolExhausted("no room")
        self.calls.append(list(pages))


def test_never_hands_out_block_0_and_maps_pages_lowest_first():
    a = BlockAllocator(num_pages=4, page_bytes=4096, block_bytes=1024)  # 4 blocks a page
    m = Mapper()
    ids = a.allocate(5, m)
    assert 0 not in ids and len(set(ids)) == 5
    assert m.calls == [[0, 1]]  # page 0 holds 3 usable blocks, page 1 the other 2
    assert a.num_mapped_pages == 2 and a.num_used == 5
    assert sorted(ids) == [1, 2, 3, 4, 5]


def test_best_fit_fills_the_fullest_page_and_pages_empty_whole():
    a = BlockAllocator(num_pages=4, page_bytes=4096, block_bytes=1024)
    m = Mapper()
    first = a.allocate(3, m)  # page 0 full
    second = a.allocate(4, m)  # page 1 full
    a.free(second[:3])  # page 1 has 3 free, page 0 none
    third = a.allocate(1, m)  # fits page 1: no new page
    assert a.page_of(third[0]) == 1 and m.calls == [[0], [1]]
    assert a.free(first) == [0]  # page 0 empty: the caller unmaps it
    a.pages_unmapped([0])
    assert a.num_mapped_pages == 1
    assert a.free([second[3], third[0]]) == [1]


def test_a_failed_mapping_changes_nothing():
    a = BlockAllocator(num_pages=4, page_bytes=4096, block_bytes=1024)
    with pytest.raises(PoolExhausted):
        a.allocate(2, Mapper(fail=True))
    assert a.num_used == 0 and a.num_mapped_pages == 0
    assert a.allocate(2, Mapper()) == [1, 2]


def test_straddling_blocks_are_never_handed_out():
    a = BlockAllocator(num_pages=3, page_bytes=4096, block_bytes=1536)  # 2.67 blocks a page
    assert [list(a.page_blocks(p)) for p in range(3)] == [[0, 1], [3, 4], [6, 7]]
    ids = a.allocate(a.capacity(0) + a.capacity(1) + a.capacity(2), Mapper())
    assert sorted(ids) == [1, 3, 4, 6, 7]  # blocks 2 and 5 straddle two pages
    for b in ids:  # every handed-out block lies wholly inside one page
        assert b * 1536 // 4096 == ((b + 1) * 1536 - 1) // 4096
    with pytest.raises(PoolExhausted, match="virtual range exhausted"):
        a.allocate(1, Mapper())


def test_bad_frees_are_refused_and_change_nothing():
    a = BlockAllocator(num_pages=2, page_bytes=4096, block_bytes=1024)
    ids = a.allocate(2, Mapper())
    with pytest.raises(ValueError, match="twice"):
        a.free([ids[0], ids[0]])
    with pytest.raises(ValueError, match="not allocated"):
        a.free([ids[0], 7])
    assert a.num_used == 2 and all(a.is_used(b) for b in ids)
    with pytest.raises(ValueError, match="not an empty mapped page"):
        a.pages_unmapped([0])
