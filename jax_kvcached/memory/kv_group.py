"""KVCacheGroup: the blocks of one KV cache group (layers that share a block table).

A KV cache's layers are split into groups (an all-full-attention model has one). Each
group describes what it stores per layer as *planes* (:class:`PlaneSpec`: a name and one
block's shape and dtype; attention layers hold a K and a V plane) and owns its block-id
space over its layers' planes of the one virtual buffer: a KV page of the group maps one
physical page per plane of each of its layers, its
allocator places the group's blocks best-fit, and its pages are charged to the cache's one
tenant in the pool's ledger. Block ``b`` of one group and block ``b`` of another are
different memory; block 0 is every group's null block.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np

from jax_kvcached.memory.allocator import BlockAllocator
from jax_kvcached.memory.errors import PoolExhausted
from jax_kvcached.memory.ledger import Ledger
from jax_kvcached.memory.shards import ShardedBuffer


@dataclasses.dataclass(frozen=True)
class PlaneSpec:
    """One plane of a layer: its name and the shape and dtype of one block in it (per
    device: a split cache's heads are each device's)."""

    name: str  # "k", "v" (a latent plane, a state slot: other kinds of group)
    block_shape: tuple[int, ...]  # e.g. (block_size, kv_heads, head_dim)
    dtype: np.dtype

    @property
    def block_bytes(self) -> int:
        return int(np.prod(self.block_shape)) * np.dtype(self.dtype).itemsize


def kv_planes(block_size: int, kv_heads: int, head_dim: int, dtype: Any) -> tuple[PlaneSpec, ...]:
    """The planes of an attention layer: K and V, each ``(block_size, kv_heads,
    head_dim)`` a block."""
    shape = (block_size, kv_heads, head_dim)
    return PlaneSpec("k", shape, np.dtype(dtype)), PlaneSpec("v", shape, np.dtype(dtype))


def latent_planes(block_size: int, dim: int, dtype: Any) -> tuple[PlaneSpec, ...]:
    """The plane of a latent-attention layer (MLA): one compressed latent of ``dim``
    values per token (``kv_lora_rank + qk_rope_head_dim``), ``(block_size, 1, dim)`` a
    block; attention reads it as the keys and its first ``kv_lora_rank`` values as the
    values, so there is no V plane."""
    return (PlaneSpec("latent", (block_size, 1, dim), np.dtype(dtype)),)


class KVCacheGroup:
    """One group's blocks: allocation, freeing (pages unmapped when they empty), queries.

    Made by :class:`~jax_kvcached.memory.kv_cache.KVCache`; reach it as ``cache.groups[g]``.
    """

    def __init__(
        self,
        index: int,
        layers: tuple[int, ...],
        *,
        name: str,
        ledger: Ledger,
        buffer: ShardedBuffer,
        block_size: int,
        lock: threading.RLock,
        check_open: Any,
        planes: tuple[PlaneSpec, ...],
    ) -> None:
        self.index = index
        self.layers = layers
        # Each layer's planes (every layer of a group stores alike).
        self.planes: tuple[PlaneSpec, ...] = planes
        if any(p.block_bytes != buffer.block_bytes for p in planes):
            raise ValueError(
                f"group {index}'s planes {planes} do not match the buffer's "
                f"{buffer.block_bytes}-byte blocks"
            )
        self.name = name  # the cache's tenant name in the ledger
        self.ledger = ledger
        self.block_size = block_size
        self._buffer = buffer
        self._lock = lock
        self._check_open = check_open
        # Physical pages per KV page: one per plane of each layer.
        self.pages_per_kv_page: int = len(planes) * len(layers)
        self.page_size: int = buffer.page_size
        self.block_bytes: int = buffer.block_bytes  # per device and plane
        self.blocks_per_page: int = buffer.blocks_per_page
        self.num_blocks: int = buffer.num_blocks
        self._allocator = BlockAllocator(buffer.num_pages, buffer.page_size, buffer.block_bytes)
        # Every usable page but page 0 holds at least this many blocks.
        self.min_blocks_per_page: int = self._allocator.min_blocks_per_page

    # -- figures ---------------------------------------------------------------------
    @property
    def num_used_blocks(self) -> int:
        return self._allocator.num_used

    @property
    def num_mapped_pages(self) -> int:
        """KV pages of this group mapped (each ``pages_per_kv_page`` physical pages)."""
        return self._buffer.group_mapped_pages(self.index)

    @property
    def mapped_pages(self) -> int:
        """Physical pages this group has mapped on each device."""
        return self.num_mapped_pages * self.pages_per_kv_page

    @property
    def mapped_bytes(self) -> int:
        """Physical bytes this group has mapped on each device."""
        return self.mapped_pages * self.page_size

    @property
    def num_free_blocks(self) -> int:
        """Blocks :meth:`alloc` can hand out now: free blocks of mapped pages plus what the
        tenant's room in the pool can still map for this group."""
        new_pages = self.ledger.room_pages(self.name) // self.pages_per_kv_page
        return self._allocator.free_in_mapped + self._allocator.unmapped_capacity(new_pages)

    @property
    def capacity_blocks(self) -> int:
        """The most blocks this group could hold under the pool's current limits (were
        the tenant's whole room this group's)."""
        kv_pages = self.ledger.capacity_pages(self.name) // self.pages_per_kv_page
        return self._allocator.capacity_of_pages(kv_pages)

    def pages_for_blocks(self, n: int) -> int:
        """Physical pages that hold ``n`` more blocks of this group (whole KV pages)."""
        return -(-n // self.min_blocks_per_page) * self.pages_per_kv_page

    # -- blocks ----------------------------------------------------------------------
    def alloc(self, n: int) -> np.ndarray:
        """Allocates ``n`` blocks and returns their ids (int32), mapping pages on demand.
        Raises :class:`PoolExhausted` (and allocates nothing) when the budget or the
        virtual range cannot serve the request."""
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
            raise TypeError(f"alloc() takes an int, got {type(n).__name__}")
        n = int(n)
        if n < 0:
            raise ValueError(f"alloc(): n must be >= 0, got {n}")
        with self._lock:
            self._check_open()
            # Another tenant may take the pool's last pages between this check and the
            # mapping; the mapping then raises PoolExhausted and nothing changes.
            available = self.num_free_blocks
            if n > available:
                where = f" (group {self.index})" if self.index else ""
                raise PoolExhausted(
                    f"KV cache {self.name!r}{where}: {n} blocks requested, {available} available"
                )
            ids = self._allocator.allocate(n, self._map)
        return np.asarray(ids, dtype=np.int32)

    def _map(self, pages: list[int]) -> None:
        ids = np.asarray(pages, dtype=np.int32)
        self.ledger.charge(
            self.name,
            len(pages) * self.pages_per_kv_page,
            lambda: self._buffer.map_pages(ids, group=self.index),
        )

    def free(self, block_ids: Iterable[int] | np.ndarray, *, after: Any = None) -> None:
        """Frees blocks; pages left empty are unmapped and their memory goes back to the
        pool. ``after``: arrays of computations that may still read these blocks (the
        unmap waits for them); None: the caller guarantees none does."""
        arr = np.asarray(block_ids)
        if arr.size and (arr.dtype == np.bool_ or arr.dtype.kind not in "iu"):
            raise TypeError(f"free() takes integer block ids, got {arr.dtype} {arr.ravel()[:4]}")
        ids = arr.astype(np.int64).reshape(-1).tolist()
        with self._lock:
            self._check_open()
            empty = self._allocator.free(ids)
            if empty:
                if after is not None:
                    # The fence: every read of these blocks is done, so the unmap need not
                    # wait for the whole device (no cuCtxSynchronize on CUDA).
                    jax.block_until_ready(after)
                pages = np.asarray(empty, dtype=np.int32)
                self._buffer.unmap_pages(pages, synchronize=after is None, group=self.index)
                self._allocator.pages_unmapped(empty)
        if empty:
            self.ledger.released(self.name)

    def check_writable(self, block_ids: Iterable[int]) -> None:
        """Raises ValueError unless every block is allocated (so its page is mapped)."""
        for b in block_ids:
            if not self.is_allocated(b):
                where = f" group {self.index}" if self.index else ""
                raise ValueError(f"block {int(b)} of {self.name!r}{where} is not allocated")

    def is_allocated(self, block_id: int) -> bool:
        return self._allocator.is_used(int(block_id))

    def page_of(self, block_id: int) -> int:
        """The KV page that holds ``block_id``."""
        return self._allocator.page_of(int(block_id))

    def page_blocks(self, page: int) -> range:
        """The block ids KV page ``page`` holds (a block straddling two pages is in none)."""
        return self._allocator.page_blocks(int(page))

    def used_blocks_per_page(self, pages: Iterable[int]) -> dict[int, int]:
        """Allocated blocks in each of ``pages``."""
        return {int(p): self._allocator.used_in_page(int(p)) for p in pages}

    def mapped_page_ids(self) -> list[int]:
        """This group's KV pages mapped now, ascending."""
        return list(self._buffer.mapped_pages(group=self.index))

    def is_page_mapped(self, page: int) -> bool:
        return bool(self._buffer.is_mapped(int(page), group=self.index))

    def stats(self) -> dict[str, Any]:
        return {
            "layers": list(self.layers),
            "used_blocks": self.num_used_blocks,
            "free_blocks": self.num_free_blocks,
            "mapped_kv_pages": self.num_mapped_pages,
            "mapped_pages": self.mapped_pages,
            "mapped_bytes": self.mapped_bytes,
            "pages_per_kv_page": self.pages_per_kv_page,
            "planes": {p.name: list(p.block_shape) for p in self.planes},
        }

    def __repr__(self) -> str:
        return (
            f"KVCacheGroup({self.name!r}, {self.index}, layers={len(self.layers)}, "
            f"used={self.num_used_blocks})"
        )


def check_layer_groups(layer_groups: Any, num_layers: int) -> tuple[int, ...]:
    """Each layer's group id, validated: one per layer, ids 0..G-1 each used."""
    if layer_groups is None:
        return (0,) * num_layers
    try:
        ids = tuple(int(g) for g in layer_groups)
    except (TypeError, ValueError):
        raise ValueError(f"layer_groups must be a sequence of ints, got {layer_groups!r}") from None
    if len(ids) != num_layers:
        raise ValueError(f"layer_groups has {len(ids)} entries for {num_layers} layers")
    if set(ids) != set(range(max(ids) + 1)):
        raise ValueError(f"layer_groups must use every group id 0..G-1, got {sorted(set(ids))}")
    return ids
