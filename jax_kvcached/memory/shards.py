"""ShardedBuffer: one KV cache's virtual buffers on several devices, mapped in lockstep.

A tensor-parallel KV cache holds a slice of the KV heads on each device: one C++
``KVBuffer`` per (local) device, all with the same layout and page count. One block
allocator serves them all, so block ``b`` means the same slots on every device, and every
map / unmap happens on every shard or on none: a shard that fails to map makes the
others unmap what they mapped in that call before the error propagates.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jax_kvcached.memory import _C
from jax_kvcached.memory.errors import KVCacheError


class ShardedBuffer:
    """The buffers of one KV cache, one per device (a single-device cache has one)."""

    def __init__(self, shards: Sequence[_C.KVBuffer]) -> None:
        # Same layout, distinct devices, one backend: the registry checks all of it when
        # the cache registers its shards (_C.register_buffers).
        if not shards:
            raise ValueError("a sharded buffer needs at least one shard")
        first = shards[0]
        self.shards: tuple[_C.KVBuffer, ...] = tuple(shards)
        # Layout, identical on every shard.
        self.num_pages: int = first.num_pages
        self.num_blocks: int = first.num_blocks
        self.blocks_per_page: int = first.blocks_per_page
        self.block_bytes: int = first.block_bytes
        self.page_size: int = first.page_size
        self.pages_per_kv_page: int = first.pages_per_kv_page
        self.total_bytes: int = first.total_bytes  # per device
        self.num_groups: int = first.num_groups

    @property
    def base(self) -> int:
        """The first shard's base address (the only one for a single-device cache)."""
        return self.shards[0].base

    def map_pages(self, page_ids: np.ndarray, group: int = 0) -> None:
        """Maps KV pages of one group on every shard, or on none (the error of the shard
        that failed propagates after the others have unmapped them again)."""
        ids = np.ascontiguousarray(page_ids, dtype=np.int32)
        done: list[_C.KVBuffer] = []
        try:
            for s in self.shards:
                s.map_pages(ids, group=group)
                done.append(s)
        except BaseException:
            for s in done:
                s.unmap_pages(ids, group=group)
            raise

    def unmap_pages(self, page_ids: np.ndarray, synchronize: bool = True, group: int = 0) -> None:
        """Unmaps KV pages on every shard (each shard validates the ids before changing
        anything, so a bad id fails on the first shard with nothing unmapped)."""
        ids = np.ascontiguousarray(page_ids, dtype=np.int32)
        errors = []
        for i, s in enumerate(self.shards):
            try:
                s.unmap_pages(ids, synchronize=synchronize, group=group)
            except Exception as e:
                if i == 0:
                    raise
                errors.append(e)
        if errors:  # the shards disagree: a bug in the core, never silently
            raise KVCacheError(f"unmapping pages failed on {len(errors)} shard(s): {errors[0]}")

    @property
    def num_mapped_pages(self) -> int:
        """KV pages mapped on each device, every group (the same on every shard)."""
        return self.shards[0].num_mapped_pages

    @property
    def num_mapped_physical_pages(self) -> int:
        """Physical pages mapped on each device, every group."""
        return self.shards[0].num_mapped_physical_pages

    def group_mapped_pages(self, group: int) -> int:
        """KV pages of one group mapped on each device."""
        return self.shards[0].group_mapped_pages(group)

    def mapped_pages(self, group: int = 0) -> list[int]:
        return list(self.shards[0].mapped_pages(group))

    def mapped_pages_per_shard(self) -> list[int]:
        """KV pages mapped on each shard, in shard order (all equal in lockstep)."""
        return [s.num_mapped_pages for s in self.shards]

    def physical_pages_per_shard(self) -> list[int]:
        """Physical pages mapped on each shard, every group, in shard order."""
        return [s.num_mapped_physical_pages for s in self.shards]

    def is_mapped(self, page: int, group: int = 0) -> bool:
        return all(s.is_mapped(page, group) for s in self.shards)

    def device_page_map(self, layer: int = 0) -> list[int]:
        return list(self.shards[0].device_page_map(layer))

    def take_device_error(self) -> tuple[int, int]:
        """The first shard's recorded device error (code, slot), every shard cleared."""
        found = (0, 0)
        for s in self.shards:
            err = s.take_device_error()
            if err[0] and not found[0]:
                found = err
        return found

    def close(self) -> None:
        for s in self.shards:
            s.close()
