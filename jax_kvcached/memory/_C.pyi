"""Type stubs of the nanobind module ``jax_kvcached.memory._C`` (ffi/module.cc)."""

from typing import Any

import numpy as np
import numpy.typing as npt

class KVCacheError(RuntimeError): ...
class BackendError(KVCacheError): ...
class PoolExhausted(KVCacheError): ...

def cuda_compiled() -> bool:
    """Whether this build has the CUDA backend and handlers."""

def cuda_mem_info(device: int) -> tuple[int, int]:
    """(free, total) bytes of a CUDA device."""

class PagePool:
    def __init__(
        self,
        backend: str,
        page_size: int,
        budget_pages: int,
        min_reserved: int,
        max_reserved: int,
        device: int = 0,
    ) -> None: ...
    @property
    def backend_name(self) -> str: ...
    @property
    def page_size(self) -> int: ...
    @property
    def granularity(self) -> int: ...
    @property
    def device_id(self) -> int: ...
    @property
    def committed_bytes(self) -> int: ...
    def set_budget(self, budget_pages: int) -> None: ...
    def set_reserve(self, min_reserved: int, max_reserved: int) -> None: ...
    def trim(self) -> None: ...
    def stats(self) -> dict[str, int]:
        """page_size, budget_pages, in_use_pages, reserved_pages, min_reserved_pages,
        max_reserved_pages, creates, releases, reuses."""

class KVBuffer:
    def __init__(
        self,
        pool: PagePool,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: int,
        num_pages: int,
        device_ordinal: int = -1,
        local_id: int = -1,
        layer_group: list[int] = ...,
        planes_per_layer: int = 2,  # 1: a latent cache (MLA), no V plane
    ) -> None: ...
    @property
    def device_ordinal(self) -> int:
        """The ordinal XLA passes its device's FFI calls (they find the buffer by it)."""
    @property
    def local_id(self) -> int:
        """Its device's local hardware id (its DLPack export carries it)."""
    @property
    def base(self) -> int: ...
    @property
    def total_bytes(self) -> int: ...
    @property
    def plane_bytes(self) -> int: ...
    @property
    def page_size(self) -> int: ...
    @property
    def num_pages(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def blocks_per_page(self) -> int: ...
    @property
    def block_bytes(self) -> int: ...
    @property
    def pages_per_kv_page(self) -> int: ...
    def map_pages(self, page_ids: npt.NDArray[np.int32], group: int = 0) -> None: ...
    def unmap_pages(
        self, page_ids: npt.NDArray[np.int32], synchronize: bool = True, group: int = 0
    ) -> None:
        """Unmaps pages; synchronize=False when every read of them is known to be done."""
    def is_mapped(self, page: int, group: int = 0) -> bool: ...
    @property
    def num_mapped_pages(self) -> int:
        """KV pages mapped, every group together."""
    def group_mapped_pages(self, group: int) -> int:
        """KV pages mapped in one group."""
    @property
    def num_mapped_physical_pages(self) -> int: ...
    @property
    def num_groups(self) -> int: ...
    def group_pages_per_kv_page(self, group: int) -> int: ...
    def mapped_pages(self, group: int = 0) -> list[int]: ...
    def copy_to_host(
        self, blocks: npt.NDArray[np.int32], slots: npt.NDArray[np.int64], arena: HostArena
    ) -> int:
        """Enqueues copies of blocks of the arena's group (its planes) into host slots;
        returns a ticket."""
    def copy_from_host(
        self, arena: HostArena, slots: npt.NDArray[np.int64], blocks: npt.NDArray[np.int32]
    ) -> None:
        """Copies host slots into blocks of the arena's group (its planes); returns when done."""
    def copies_done(self, ticket: int) -> bool:
        """Whether the copies of a ticket are done (raises if one failed)."""
    def take_device_error(self) -> tuple[int, int]:
        """Reads and clears the device error record of write_kv_async: (code, slot)."""
    def device_page_map(self, layer: int = 0) -> list[int]:
        """One byte per KV page as kernels see it for one layer (1: mapped)."""
    def close(self) -> None: ...
    @property
    def closed(self) -> bool: ...
    @property
    def dlpack_device(self) -> tuple[int, int]: ...
    def dlpack(self) -> Any:
        """A DLPack capsule over the whole virtual buffer (zero-copy)."""

class HostArena:
    """Host memory for num_slots copies of one block of each plane of one KV cache group
    of ``buffer`` (page-locked on CUDA)."""

    def __init__(self, buffer: KVBuffer, num_slots: int, group: int = 0) -> None: ...
    @property
    def num_slots(self) -> int: ...
    @property
    def group(self) -> int: ...
    @property
    def num_planes(self) -> int: ...
    @property
    def block_bytes(self) -> int: ...
    @property
    def slot_bytes(self) -> int: ...
    @property
    def total_bytes(self) -> int: ...
    @property
    def pinned(self) -> bool: ...
    def read_slot(self, slot: int) -> bytes:
        """The bytes of one slot, every plane in order."""

def register_buffers(shards: list[KVBuffer], key: str = "") -> int:
    """Registers a KV cache's buffers (one per device) and returns its handle."""

def unregister_buffer(handle: int) -> None: ...
def lookup_ok(handle: int) -> bool: ...
def bench_backend(
    backend: str, page_size: int, iters: int, device: int = 0
) -> dict[str, list[float]]: ...

# platform ("cpu", "cuda") -> op name -> PyCapsule of the XLA FFI handler
handlers: dict[str, dict[str, Any]]

def handler_metadata(handler: Any) -> dict[str, Any]:
    """What a handler capsule declares to XLA: api_version, traits,
    command_buffer_compatible."""

def quant_isa() -> str:
    """The instruction set quant_matmul uses on this CPU (portable, avx2, avx512_vnni)."""

def set_quant_isa(name: str) -> None:
    """Forces quant_matmul's instruction set (auto: the best this CPU has); KVCacheError
    when the CPU lacks it."""

def grouped_isa() -> str:
    """The instruction set grouped_matmul uses on this CPU (portable, avx512)."""

def set_grouped_isa(name: str) -> None:
    """Forces grouped_matmul's instruction set (auto: the best this CPU has); KVCacheError
    when the CPU lacks it."""
