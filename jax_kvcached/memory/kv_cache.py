"""KVCache: one tenant's virtual KV buffer, its zero-copy view and its block allocator."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_kvcached.memory import _C
from jax_kvcached.memory.errors import KVCacheError
from jax_kvcached.memory.kv_group import (
    KVCacheGroup,
    check_layer_groups,
    kv_planes,
    latent_planes,
)
from jax_kvcached.memory.ledger import Ledger
from jax_kvcached.memory.shards import ShardedBuffer

# dtype -> code understood by the C++ core (kv_buffer.h: DType)
_DTYPE_CODES = {jnp.dtype(jnp.float32): 0, jnp.dtype(jnp.float16): 1, jnp.dtype(jnp.bfloat16): 2}


def dtype_code(dtype: Any) -> int:
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        raise ValueError(f"unsupported KV dtype {dtype!r}") from None
    if dt not in _DTYPE_CODES:
        supported = ", ".join(str(d) for d in _DTYPE_CODES)
        raise ValueError(f"unsupported KV dtype {dt}; supported: {supported}")
    return _DTYPE_CODES[dt]


class _DLPackExport:
    """Hands one fresh DLPack capsule of the buffer to ``jax.dlpack.from_dlpack``."""

    def __init__(self, buffer: _C.KVBuffer) -> None:
        self._buffer = buffer

    def __dlpack__(self, stream: Any = None, **kwargs: Any) -> Any:
        return self._buffer.dlpack()

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._buffer.dlpack_device


@jax.tree_util.register_pytree_node_class
class KVCache:
    """A fixed virtual KV range of shape
    ``(num_layers, planes, num_blocks, block_size, num_kv_heads, head_dim)``: ``planes``
    2 (K and V), or 1 for a latent cache (``latent``: MLA's one compressed latent per token
    and layer, ``num_kv_heads`` 1, ``head_dim`` the latent's width; attention reads it as
    both keys and values).

    Physical pages are mapped only behind blocks in use. Layers may be split into KV
    cache groups (``layer_groups``: each layer's group id), each with its own block ids
    and block table over its layers' planes (``cache.groups[g]``); one group by default.
    Create it with
    :meth:`jax_kvcached.Pool.create_kv_cache`; how much it may map is the ``ledger``'s
    answer for tenant ``name``.

    On a pool over a mesh the KV heads are split over the mesh's ``kv_axis``: each device
    holds ``shard_kv_heads`` of them in its own virtual buffer, the view is one global
    array sharded over the heads, and blocks, pages and the accounting (per device) are
    the same on every device. FFI ops take per-shard operands (call them inside
    ``jax.shard_map``); each device's call finds its own buffer. A latent cache is not
    split: every device holds the whole latent (its attention heads are split), as vLLM
    and SGLang keep MLA's cache under tensor parallelism.

    A KVCache is a pytree whose one leaf is its view: pass it to a jitted function as an
    argument and its view enters the program as the buffer itself (no copy), so the ops
    inside read and write the memory the pages are mapped in. Closed over instead, the
    view would be a constant of the program, a snapshot; the ops refuse that at trace
    time.
    """

    def __init__(
        self,
        ledger: Ledger,
        name: str,
        buffer: ShardedBuffer,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: Any,
        block_size: int,
        *,
        backend: str,
        devices: tuple[Any, ...],
        mesh: jax.sharding.Mesh | None = None,
        kv_axis: str | None = None,
        on_close: Callable[[KVCache], None] | None = None,
        layer_groups: Sequence[int] | None = None,
        latent: bool = False,
    ) -> None:
        self.ledger = ledger
        self.latent = bool(latent)
        self.planes_per_layer = 1 if self.latent else 2
        self.backend = backend  # "host" or "cuda"
        self.devices = tuple(devices)  # every device of the view (all processes)
        self.device = self.devices[0]  # the first (the only one without a mesh)
        self.mesh = mesh
        self.kv_axis = kv_axis
        self.tensor_parallel = len(self.devices) if mesh is not None else 1
        self.name = name
        self._on_close = on_close
        self._buffer = buffer
        # A handle stable across processes (per name and creation order): compiled steps
        # carry it as an attribute, so a restart hits the persistent compilation cache.
        self.handle: int = _C.register_buffers(list(buffer.shards), f"kv_cache:{name}")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        # Per device (the pool checked that they split before creating the buffers); a
        # latent cache is replicated.
        self.shard_kv_heads = num_kv_heads if self.latent else num_kv_heads // self.tensor_parallel
        self.head_dim = head_dim
        self.dtype = jnp.dtype(dtype)
        self.block_size = block_size
        self.num_pages: int = buffer.num_pages
        self.blocks_per_page: int = buffer.blocks_per_page
        self.num_blocks: int = buffer.num_blocks
        self.pages_per_kv_page: int = buffer.pages_per_kv_page  # every plane (all groups)
        self.shape = (num_layers, self.planes_per_layer, self.num_blocks, block_size,
                      num_kv_heads, head_dim)  # fmt: skip
        self.block_bytes: int = buffer.block_bytes  # per device
        self.page_size: int = buffer.page_size
        self._view: jax.Array | None = None
        self._closed = False
        self._origin = self  # the cache itself (a bound copy inside jit: the cache it binds)
        self._lock = threading.RLock()  # alloc / free / close from several threads
        # Each layer's KV cache group (kv_group.py); one group unless the buffer has more.
        self.layer_groups: tuple[int, ...] = check_layer_groups(layer_groups, num_layers)
        self.groups: tuple[KVCacheGroup, ...] = tuple(
            KVCacheGroup(
                g, tuple(i for i, x in enumerate(self.layer_groups) if x == g), name=name,
                ledger=ledger, buffer=buffer, block_size=block_size, lock=self._lock,
                check_open=self._check_open,
                planes=(latent_planes(block_size, head_dim, self.dtype) if self.latent else
                        kv_planes(block_size, self.shard_kv_heads, head_dim, self.dtype)),
            )
            for g in range(max(self.layer_groups) + 1)
        )  # fmt: skip

    # -- the view --------------------------------------------------------------------
    @property
    def sharding(self) -> jax.sharding.Sharding:
        """The view's sharding: the KV-head axis over the mesh (a latent cache:
        replicated), or the one device."""
        if self.mesh is None:
            return jax.sharding.SingleDeviceSharding(self.device)
        if self.latent:
            return jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        spec = jax.sharding.PartitionSpec(None, None, None, None, self.kv_axis, None)
        return jax.sharding.NamedSharding(self.mesh, spec)

    @property
    def shards(self) -> tuple[_C.KVBuffer, ...]:
        """This process's buffers, one per local device of the view."""
        return self._buffer.shards

    @property
    def view(self) -> jax.Array:
        """The whole virtual buffer as a zero-copy ``jax.Array`` (on a mesh: one global
        array assembled from each device's buffer, sharded over the KV heads).

        Unmapped pages read as zeros. Pass it into jitted functions as an argument; order
        reads after FFI writes with :func:`jax_kvcached.ops.after`.
        """
        self._check_open()
        if self._view is None:
            parts = []
            for shard in self._buffer.shards:
                part = jax.dlpack.from_dlpack(_DLPackExport(shard))
                if part.unsafe_buffer_pointer() != shard.base:
                    raise KVCacheError("the DLPack import copied the KV buffer (not zero-copy)")
                parts.append(part)
            if self.mesh is None:
                self._view = parts[0]
            else:
                self._view = jax.make_array_from_single_device_arrays(
                    self.shape, self.sharding, parts
                )
        return self._view

    @property
    def base_address(self) -> int:
        return self._buffer.base

    @property
    def virtual_bytes(self) -> int:
        """Virtual bytes reserved on each device."""
        return self._buffer.total_bytes

    # -- groups and blocks ------------------------------------------------------------
    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def group_of_layer(self, layer: int) -> KVCacheGroup:
        return self.groups[self.layer_groups[layer]]

    def _single(self) -> KVCacheGroup:
        """The one group (block-level calls on the cache itself need one group)."""
        if len(self.groups) != 1:
            raise KVCacheError(
                f"KV cache {self.name!r} has {len(self.groups)} KV cache groups: use "
                "cache.groups[g] for its blocks"
            )
        return self.groups[0]

    @property
    def num_used_blocks(self) -> int:
        return sum(g.num_used_blocks for g in self.groups)

    @property
    def num_mapped_pages(self) -> int:
        """KV pages mapped, every group (one group: each is ``pages_per_kv_page``
        physical pages)."""
        return self._buffer.num_mapped_pages

    @property
    def mapped_pages(self) -> int:
        """Physical pages mapped on each device, every group."""
        return self._buffer.num_mapped_physical_pages

    @property
    def mapped_bytes(self) -> int:
        """Physical bytes mapped on each device (the same on every device)."""
        return self.mapped_pages * self.page_size

    def mapped_pages_per_device(self) -> list[int]:
        """Physical pages mapped on each of this process's devices, read from each
        device's own buffer (equal, as the shards map in lockstep)."""
        return self._buffer.physical_pages_per_shard()

    @property
    def num_free_blocks(self) -> int:
        """Blocks :meth:`alloc` can hand out now (one group)."""
        return self._single().num_free_blocks

    @property
    def capacity_blocks(self) -> int:
        """The most blocks this cache could hold under the pool's current limits (one
        group)."""
        return self._single().capacity_blocks

    @property
    def min_blocks_per_page(self) -> int:
        """Every usable page but page 0 holds at least this many blocks."""
        return self.groups[0].min_blocks_per_page

    @property
    def over_limit_pages(self) -> int:
        """Physical pages mapped above this cache's memory limit (to give back)."""
        return self.ledger.over_limit_pages(self.name)

    def alloc(self, n: int) -> np.ndarray:
        """Allocates ``n`` blocks and returns their ids (int32). Maps pages on demand.

        Raises :class:`PoolExhausted` (and allocates nothing) when the budget or the
        virtual range cannot serve the request. A cache of several groups allocates
        through ``cache.groups[g]``.
        """
        return self._single().alloc(n)

    def free(self, block_ids: Iterable[int] | np.ndarray, *, after: Any = None) -> None:
        """Frees blocks; pages left empty are unmapped and their memory goes back to the pool.

        ``after``: arrays (any pytree) of computations that may still read these blocks,
        typically the last step's outputs or token. The unmap waits until they are ready,
        so it never races with an in-flight read. With ``after=None`` the caller
        guarantees that no dispatched computation still reads the blocks.
        """
        self._single().free(block_ids, after=after)

    def check_writable(self, block_ids: Iterable[int]) -> None:
        """Raises ValueError unless every block is allocated (so its page is mapped):
        the host-side check of a step's written blocks (see ``ops.write_kv_async``)."""
        self._single().check_writable(block_ids)

    def mapped_page_ids(self) -> list[int]:
        """The KV pages mapped now, ascending (by the allocator or by FFI ops)."""
        return self._single().mapped_page_ids()

    def is_page_mapped(self, page: int) -> bool:
        return self._single().is_page_mapped(page)

    def device_page_map(self, layer: int = 0) -> list[int]:
        """The device-side page map ``ops.write_kv_async`` checks for one layer (1 =
        mapped in the layer's group)."""
        return list(self._buffer.device_page_map(layer))

    @property
    def buffer(self) -> ShardedBuffer:
        """The buffers, mapped in lockstep (low level: bypasses the allocator and the
        ledger; for tools and tests of the core's own checks)."""
        return self._buffer

    def take_device_error(self) -> tuple[int, int]:
        """The device error record of ``ops.write_kv_async`` (code, slot), cleared."""
        return self._buffer.take_device_error()

    def is_allocated(self, block_id: int) -> bool:
        return self._single().is_allocated(block_id)

    def page_of(self, block_id: int) -> int:
        """The KV page that holds ``block_id``."""
        return self._single().page_of(block_id)

    def page_blocks(self, page: int) -> range:
        """The block ids KV page ``page`` holds (a block straddling two pages is in none)."""
        return self._single().page_blocks(page)

    def used_blocks_per_page(self, pages: Iterable[int]) -> dict[int, int]:
        """Allocated blocks in each of ``pages``."""
        return self._single().used_blocks_per_page(pages)

    def slot_mapping(self, block_table: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Slots (``block * block_size + offset``) for token positions of one sequence."""
        positions = np.asarray(positions, dtype=np.int64)
        table = np.asarray(block_table, dtype=np.int64)
        idx = positions // self.block_size
        if positions.size and (positions.min() < 0 or idx.max() >= table.size):
            raise ValueError("a position lies outside the block table")
        return (table[idx] * self.block_size + positions % self.block_size).astype(np.int32)

    # -- lifecycle -------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        phys = self.mapped_pages
        out = {
            "used_blocks": self.num_used_blocks,
            "num_blocks": self.num_blocks - 1,  # the null block is never handed out
            "mapped_kv_pages": self.num_mapped_pages,
            "mapped_pages": phys,
            "mapped_bytes": phys * self.page_size,
            "mapped_pages_per_device": self.mapped_pages_per_device(),
            "tensor_parallel": self.tensor_parallel,
            "virtual_bytes": self.virtual_bytes,
        }
        if len(self.groups) == 1:
            out["free_blocks"] = self.num_free_blocks
            out["capacity_blocks"] = self.capacity_blocks
        else:
            out["groups"] = [g.stats() for g in self.groups]
        return out

    @property
    def closed(self) -> bool:
        if self._origin is not self:  # a bound copy: the cache it binds
            return self._origin.closed
        return self._closed

    def close(self) -> None:
        """Unmaps every page and unregisters the handle. Views stay valid and read zeros."""
        if self._origin is not self:
            return self._origin.close()
        with self._lock:
            if self._closed:
                return
            _C.unregister_buffer(self.handle)
            self._buffer.close()
            self._closed = True
        if self._on_close is not None:
            self._on_close(self)

    def _check_open(self) -> None:
        if self.closed:
            raise KVCacheError(f"KV cache {self.name!r} is closed")

    # -- as a jit argument: a pytree whose one leaf is the view -------------------------
    def with_view(self, view: Any) -> KVCache:
        """This cache with ``view`` as its view (inside a jitted function: the function's
        traced argument), everything else shared: what a KVCache passed to a jitted
        function is inside it."""
        bound = copy.copy(self)
        bound.__dict__.update(_view=view)
        return bound

    def tree_flatten(self) -> tuple[tuple[jax.Array], KVCache]:
        return (self.view,), self._origin

    @classmethod
    def tree_unflatten(cls, origin: KVCache, leaves: Sequence[Any]) -> KVCache:
        return origin.with_view(leaves[0])

    def __repr__(self) -> str:
        return (
            f"KVCache({self.name!r}, layers={self.num_layers}, kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, dtype={self.dtype}, block_size={self.block_size}, "
            f"tp={self.tensor_parallel}, {'latent, ' if self.latent else ''}"
            f"blocks={self.num_blocks}, used={self.num_used_blocks})"
        )
