"""BlockAllocator: page-aware block placement inside one KV cache.

Pure bookkeeping (no mapping): the caller maps the pages it is told to map and unmaps
the pages it is told became empty. Placement is best-fit: blocks come first from the
mapped pages with the fewest free blocks, so pages fill up and empty out whole, and
only then from new pages (lowest id first). Block 0 is the null block and is never
handed out.

Blocks are laid out densely over the pages; when a block's bytes do not divide the page,
a block that straddles two pages is never handed out, so page p holds the blocks
``[ceil(p * page / block), floor((p + 1) * page / block))`` (one fewer than the most on
some pages). A page that holds no usable block is never mapped.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable


class BlockAllocator:
    def __init__(self, num_pages: int, page_bytes: int, block_bytes: int) -> None:
        if num_pages <= 0 or block_bytes <= 0 or block_bytes > page_bytes:
            raise ValueError("num_pages must be positive and a block must fit in a page")
        self.num_pages = num_pages
        self.page_bytes, self.block_bytes = page_bytes, block_bytes
        self.blocks_per_page = page_bytes // block_bytes  # the most blocks in one page
        self.uniform = page_bytes % block_bytes == 0
        self._free: list[set[int]] = [set() for _ in range(num_pages)]  # mapped pages only
        self._mapped = [False] * num_pages
        # _buckets[k]: mapped pages with exactly k free blocks, 1 <= k <= blocks_per_page.
        self._buckets: list[set[int]] = [set() for _ in range(self.blocks_per_page + 1)]
        usable = [p for p in range(num_pages) if self.capacity(p) > 0]
        self._never_mapped = num_pages - len(usable)  # e.g. page 0 holding only block 0
        self._unmapped = usable  # a heap (sorted)
        # The fewest blocks a usable page holds, page 0 aside: a lower bound for planning.
        self.min_blocks_per_page = min(
            (self.capacity(p) for p in usable if p != 0), default=self.blocks_per_page
        )
        self._cum = [0]  # _cum[k]: blocks the k lowest usable pages hold
        for p in usable:
            self._cum.append(self._cum[-1] + self.capacity(p))
        self._used: set[int] = set()
        self._free_in_mapped = 0

    def page_blocks(self, page: int) -> range:
        """The blocks page ``page`` holds (block 0 included for page 0)."""
        first = -(-page * self.page_bytes // self.block_bytes)
        return range(first, (page + 1) * self.page_bytes // self.block_bytes)

    def page_of(self, block: int) -> int:
        return block * self.block_bytes // self.page_bytes

    # -- queries ---------------------------------------------------------------------
    def capacity(self, page: int) -> int:
        return len(self.page_blocks(page)) - (1 if page == 0 else 0)

    @property
    def num_used(self) -> int:
        return len(self._used)

    @property
    def num_mapped_pages(self) -> int:
        return self.num_pages - self._never_mapped - len(self._unmapped)

    @property
    def free_in_mapped(self) -> int:
        return self._free_in_mapped

    def unmapped_capacity(self, max_new_pages: int) -> int:
        """Blocks that mapping up to ``max_new_pages`` more pages would add."""
        k = min(max_new_pages, len(self._unmapped))
        if k <= 0:
            return 0
        if not self.uniform:  # pages hold different counts: the k pages allocate() takes
            return sum(self.capacity(p) for p in heapq.nsmallest(k, self._unmapped))
        return k * self.blocks_per_page - (1 if self._unmapped[0] == 0 else 0)

    def capacity_of_pages(self, k: int) -> int:
        """Blocks ``k`` pages hold when they are the k lowest usable pages (the ones the
        allocator maps first, so what ``k`` pages of room give an empty cache)."""
        return self._cum[max(0, min(k, len(self._cum) - 1))]

    def used_in_page(self, page: int) -> int:
        if not self._mapped[page]:
            return 0
        return self.capacity(page) - len(self._free[page])

    def is_used(self, block: int) -> bool:
        return block in self._used

    def mapped_pages(self) -> list[int]:
        return [p for p in range(self.num_pages) if self._mapped[p]]

    # -- state changes ---------------------------------------------------------------
    def _set_free(self, page: int, blocks: set[int]) -> None:
        old = len(self._free[page])
        if 0 < old:
            self._buckets[old].discard(page)
        self._free[page] = blocks
        if blocks:
            self._buckets[len(blocks)].add(page)
        self._free_in_mapped += len(blocks) - old

    def allocate(self, n: int, map_pages: Callable[[list[int]], None]) -> list[int]:
        """Returns n block ids; calls ``map_pages(new_pages)`` for pages it needs mapped.

        If ``map_pages`` raises, nothing changes and the exception propagates.
        """
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        taken: list[tuple[int, list[int]]] = []  # (page, blocks) from mapped pages
        need = n
        for count in range(1, self.blocks_per_page + 1):
            if need == 0:
                break
            for page in sorted(self._buckets[count]):
                if need == 0:
                    break
                blocks = sorted(self._free[page])[: min(need, count)]
                taken.append((page, blocks))
                need -= len(blocks)
        new_pages: list[int] = []
        capacity = 0
        while capacity < need:
            if not self._unmapped:
                for page in new_pages:
                    heapq.heappush(self._unmapped, page)
                from jax_kvcached.memory.errors import PoolExhausted

                raise PoolExhausted(
                    f"KV cache virtual range exhausted: {n} blocks requested, "
                    f"{n - need + capacity} available"
                )
            page = heapq.heappop(self._unmapped)
            new_pages.append(page)
            capacity += self.capacity(page)
        if new_pages:
            try:
                map_pages(new_pages)
            except BaseException:
                for page in new_pages:
                    heapq.heappush(self._unmapped, page)
                raise
        out: list[int] = []
        for page, blocks in taken:
            self._set_free(page, self._free[page].difference(blocks))
            out.extend(blocks)
        for page in new_pages:
            self._mapped[page] = True
            all_blocks = [b for b in self.page_blocks(page) if b != 0]
            use = all_blocks[:need]
            need -= len(use)
            self._set_free(page, set(all_blocks[len(use) :]))
            out.extend(use)
        self._used.update(out)
        return out

    def check_free(self, blocks: Iterable[int]) -> list[int]:
        """Validates a free() argument: every block allocated, none twice."""
        ids = [int(b) for b in blocks]
        if len(set(ids)) != len(ids):
            raise ValueError("free(): a block id is given twice")
        for b in ids:
            if b not in self._used:
                raise ValueError(f"free(): block {b} is not allocated")
        return ids

    def free(self, blocks: Iterable[int]) -> list[int]:
        """Frees blocks; returns the pages that became empty (the caller unmaps them and
        then calls :meth:`pages_unmapped`)."""
        ids = self.check_free(blocks)
        by_page: dict[int, list[int]] = {}
        for b in ids:
            by_page.setdefault(self.page_of(b), []).append(b)
        empty = []
        for page, bs in by_page.items():
            self._set_free(page, self._free[page].union(bs))
            if len(self._free[page]) == self.capacity(page):
                empty.append(page)
        self._used.difference_update(ids)
        return sorted(empty)

    def pages_unmapped(self, pages: Iterable[int]) -> None:
        for page in pages:
            if not self._mapped[page] or len(self._free[page]) != self.capacity(page):
                raise ValueError(f"page {page} is not an empty mapped page")
            self._set_free(page, set())
            self._mapped[page] = False
            heapq.heappush(self._unmapped, page)
