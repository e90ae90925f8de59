"""Pool: one physical KV memory budget per device, shared by all its KV caches."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_kvcached.memory import _C
from jax_kvcached.memory.config import Config, parse_bytes
from jax_kvcached.memory.errors import KVCacheError, LayoutError
from jax_kvcached.memory.group_channel import GroupChannel, SharedGroupChannel
from jax_kvcached.memory.kv_cache import KVCache, dtype_code
from jax_kvcached.memory.kv_group import check_layer_groups
from jax_kvcached.memory.ledger import Ledger, LocalLedger, MemoryLimit, Reclaimer
from jax_kvcached.memory.shards import ShardedBuffer
from jax_kvcached.memory.shared_ledger import SharedLedger
from jax_kvcached.memory.shm_segment import check_group
from jax_kvcached.memory.tenant_record import TenantRecord

BACKENDS = ("auto", "host", "cuda")


def _meminfo(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not found in /proc/meminfo")


def _host_available_bytes() -> int:
    return _meminfo("MemAvailable")


def _is_gpu(device: Any) -> bool:
    return getattr(device, "platform", None) in ("gpu", "cuda")


def _resolve(backend: str, device: Any) -> tuple[str, Any]:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if device is None:
        default = jax.devices()[0]
        if backend != "host" and _is_gpu(default) and (backend == "cuda" or _C.cuda_compiled()):
            device = default
        elif backend == "auto" and _is_gpu(default):  # (never a silent move to the CPU)
            raise ValueError(
                "backend='auto': JAX has a GPU, but this build of jax-kvcached has no CUDA "
                "backend (nvcc was not found when it was built): rebuild where nvcc is "
                "present, or pass backend='host' to keep the KV cache on the CPU"
            )
        elif backend == "cuda":
            raise ValueError("backend='cuda' but JAX has no GPU device")
        else:
            device = jax.devices("cpu")[0]
    if backend == "auto":
        backend = "cuda" if _is_gpu(device) else "host"
    if backend == "host" and device.platform != "cpu":
        raise ValueError(f"backend='host' needs a CPU device, got {device}")
    if backend == "cuda":
        if not _is_gpu(device):
            raise ValueError(f"backend='cuda' needs a GPU device, got {device}")
        if not _C.cuda_compiled():
            raise _C.BackendError(
                "jax_kvcached was built without a CUDA toolkit; reinstall it with nvcc present"
            )
    return backend, device


def device_memory_bytes(backend: str = "auto", devices: Any = None) -> int:
    """The memory of each device a pool on ``devices`` (default: the default device)
    would use: a GPU's total, or the machine's RAM shared by the host devices. A pool's
    budget may exceed it (pages are mapped on demand); ``serve`` refuses that."""
    devs = list(devices) if devices else [None]
    backend, device = _resolve(backend, devs[0])
    if backend == "cuda":
        return _C.cuda_mem_info(device.local_hardware_id)[1]
    return _meminfo("MemTotal") // len(devs)


def ffi_ordinal(device: Any) -> int:
    """The device ordinal XLA passes an FFI handler running on ``device``: the global
    device id on the CPU (several processes: 0, 1, 2048, 2049...), the local ordinal on a
    GPU."""
    return device.id if device.platform == "cpu" else device.local_hardware_id


def _resolve_mesh(
    backend: str, device: Any, devices: Any, mesh: Any, kv_axis: str | None
) -> tuple[str, tuple[Any, ...], Any, str | None]:
    """(backend, devices, mesh or None, axis) of a pool; a mesh for ``devices=`` too."""
    if mesh is None and devices is None:
        backend, device = _resolve(backend, device)
        return backend, (device,), None, None
    if device is not None:
        raise ValueError("give a pool device=, devices= or mesh=, not several")
    if mesh is not None and devices is not None:
        raise ValueError("give a pool devices= or mesh=, not both")
    if mesh is None:
        devices = list(devices)
        if not devices or len(set(devices)) != len(devices):
            raise ValueError("devices= must list distinct JAX devices")
        mesh = jax.sharding.Mesh(np.array(devices), (kv_axis or "tp",))
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"mesh= takes a jax.sharding.Mesh, got {type(mesh).__name__}")
    if len(mesh.axis_names) != 1:
        raise ValueError(
            f"the pool's mesh must have one axis (the KV heads are split over it), got axes "
            f"{mesh.axis_names}"
        )
    axis = mesh.axis_names[0]
    if kv_axis is not None and kv_axis != axis:
        raise ValueError(f"kv_axis {kv_axis!r} is not the mesh's axis {axis!r}")
    devs = tuple(mesh.devices.flat)
    platforms = {d.platform for d in devs}
    if len(platforms) != 1:
        raise ValueError(f"a pool's devices must share one platform, got {sorted(platforms)}")
    backend, _ = _resolve(backend, next(d for d in devs if d.process_index == jax.process_index()))
    for d in devs:
        _resolve(backend, d)  # every device suits the backend
    return backend, devs, mesh, axis


class Pool:
    """A physical page budget per device, shared by every KV cache created from it.

    Args:
      memory_limit: bytes or a string like ``"8GiB"``. Default: ``KVCACHED_GPU_UTILIZATION``
        of the GPU's free memory, or ``KVCACHED_HOST_MEMORY_FRACTION`` of available RAM.
      page_size: physical page size in bytes (default ``KVCACHED_PAGE_SIZE_MB`` MiB).
      backend: ``"host"`` (Linux VM), ``"cuda"`` (driver VMM) or ``"auto"``.
      device: the JAX device the views live on (default: the first GPU for CUDA, else CPU).
      devices / mesh: several devices (a 1-D ``jax.sharding.Mesh``, or a list made into
        one with axis ``kv_axis``, default ``"tp"``): each holds a slice of every cache's KV
        heads in its own buffer, with the budget ``memory_limit`` on each device; blocks
        are mapped on all of them in lockstep. Over several processes
        (``jax.distributed``) each process maps its own devices' pages.
      group: share the device budget with other processes of this group (default
        ``KVCACHED_IPC_NAME``): a ledger in POSIX shared memory accounts every member's
        pages (:class:`~jax_kvcached.memory.shared_ledger.SharedLedger`). The first
        member creates the group with its ``memory_limit`` (the budget of the whole
        group); later members join with the group's budget (giving another limit is an
        error while the group has live tenants). One device per pool; a member keeps no
        pre-created pages (``min_reserved_pages`` 0), and what it reserves counts against
        the group.
      min_reserved_pages / max_reserved_pages: created-but-unmapped pages kept for fast
        reuse, counted in KV pages of the widest cache (one page per layer plane, as
        kvcached counts). Defaults: ``KVCACHED_MIN_RESERVED_PAGES`` / ``..._MAX_...``.
    """

    def __init__(
        self,
        memory_limit: int | str | None = None,
        page_size: int | str | None = None,
        backend: str = "auto",
        device: Any = None,
        *,
        devices: Any = None,
        mesh: Any = None,
        kv_axis: str | None = None,
        min_reserved_pages: int | None = None,
        max_reserved_pages: int | None = None,
        group: str | None = None,
        config: Config | None = None,
    ) -> None:
        cfg = config or Config.from_env()
        self.config = cfg
        self.backend, self.devices, self.mesh, self.kv_axis = _resolve_mesh(
            backend, device, devices, mesh, kv_axis
        )
        self.device = self.devices[0]  # the only one without a mesh
        # This process's devices: it creates their pages (all of them in one process).
        me = jax.process_index()
        self.local_devices = tuple(d for d in self.devices if d.process_index == me)
        page = cfg.page_size if page_size is None else parse_bytes(page_size, "page_size")
        self.min_reserved_pages = (
            cfg.min_reserved_pages if min_reserved_pages is None else int(min_reserved_pages)
        )
        self.max_reserved_pages = (
            cfg.max_reserved_pages if max_reserved_pages is None else int(max_reserved_pages)
        )
        group = group if group is not None else cfg.ipc_name
        if group is not None:
            check_group(group)
            if len(self.devices) > 1:
                raise ValueError("a pool in a process group has one device (no mesh)")
            if min_reserved_pages:
                raise ValueError(
                    "a pool in a process group keeps no pre-created pages: "
                    "min_reserved_pages must be 0"
                )
            self.min_reserved_pages = 0
        if not 0 <= self.min_reserved_pages <= self.max_reserved_pages:
            raise ValueError("need 0 <= min_reserved_pages <= max_reserved_pages")
        if memory_limit is None:
            limit = self._default_limit(cfg)
        else:
            limit = parse_bytes(memory_limit, "memory_limit")
        if limit < page:
            raise ValueError(
                f"memory_limit ({limit} bytes) is smaller than one page ({page} bytes)"
            )
        self.group = group
        self._pools: list[Any] = []
        if group is not None:
            ledger = SharedLedger(
                group, page, limit // page, fixed=memory_limit is not None,
                reserved=self._reserved_pages, trim=self.trim, wait_s=cfg.ipc_reclaim_wait_s,
            )  # fmt: skip
            limit = ledger.budget_pages * page
            self.channel: GroupChannel = SharedGroupChannel(ledger)
        # One page pool per local device, each with the whole per-device budget.
        cuda = self.backend == "cuda"
        self._pools = [
            _C.PagePool(self.backend, page, limit // page, 0, 0, d.local_hardware_id if cuda else 0)
            for d in self.local_devices
        ]
        self._pool = self._pools[0]
        self.page_size: int = self._pool.page_size
        self._caches: dict[str, KVCache] = {}
        # Who may map how much: the tenants' limits, guarantees and reclaimers.
        if group is None:
            ledger = LocalLedger(self.page_size, self._budget_pages, self._in_use_pages)
            self.channel = GroupChannel()  # alone: nothing to publish or receive
        self.ledger: Ledger = ledger
        self._lock = threading.RLock()  # cache creation and removal
        self._closed = False
        self._apply_reserve()

    def _default_limit(self, cfg: Config) -> int:
        if self.backend == "cuda":
            free = min(_C.cuda_mem_info(d.local_hardware_id)[0] for d in self.local_devices)
            return int(free * cfg.gpu_utilization)
        # The host's RAM backs every (forced host) device's pages.
        share = cfg.host_memory_fraction / len(self.local_devices)
        return int(_host_available_bytes() * share)

    def _reserved_pages(self) -> int:
        return max((p.stats()["reserved_pages"] for p in self._pools), default=0)

    # -- caches ----------------------------------------------------------------------
    def create_kv_cache(
        self,
        name: str,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: Any,
        block_size: int = 16,
        *,
        memory_limit: int | str | None = None,
        memory_guarantee: int | str = 0,
        layer_groups: Sequence[int] | None = None,
        latent: bool = False,
    ) -> KVCache:
        """Creates a KV cache whose virtual range can grow to the whole pool budget.

        ``memory_limit`` / ``memory_guarantee``: see :meth:`set_memory_limit` and
        :meth:`set_memory_guarantee`. ``layer_groups``: each layer's KV cache group id
        (0..G-1; default: one group), see :class:`~jax_kvcached.memory.kv_group.KVCacheGroup`.
        ``latent``: one plane per layer instead of K and V (MLA's compressed latent,
        ``num_kv_heads`` 1 and ``head_dim`` its width), replicated on a mesh.
        """
        if not isinstance(name, str) or not name:
            raise ValueError("a KV cache needs a non-empty string name")
        for what, v in (
            ("num_layers", num_layers),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("block_size", block_size),
        ):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{what} must be a positive int, got {v!r}")
        code = dtype_code(dtype)
        if latent and num_kv_heads != 1:
            raise ValueError(f"a latent KV cache has one KV head (its latent), got {num_kv_heads}")
        tp = 1 if latent else self.tensor_parallel  # (a latent cache is replicated)
        planes = 1 if latent else 2
        if num_kv_heads % tp:
            raise ValueError(
                f"{name!r} has {num_kv_heads} KV heads, which do not split over the "
                f"{tp} devices of the pool's mesh; use a tensor-parallel size that divides "
                f"{num_kv_heads}"
            )
        # Python ints: the product is exact, so a shape whose bytes would wrap in 64 bits
        # is refused here, naming the parameters, before the core sees it.
        block_bytes = block_size * (num_kv_heads // tp) * head_dim * jnp.dtype(dtype).itemsize
        if block_bytes > self.page_size:
            raise LayoutError(
                f"a KV block of {block_bytes} bytes (block_size {block_size} x KV heads per "
                f"device {num_kv_heads // tp} x head_dim {head_dim} x itemsize) is larger "
                f"than the page size of {self.page_size} bytes: lower block_size or use a "
                "larger page_size"
            )
        with self._lock:
            self._check_open()
            if name in self._caches:
                raise ValueError(f"a KV cache named {name!r} already exists in this pool")
            # Virtual pages: as many as the budget could fill with the smallest group's KV
            # pages (each group's planes span the same range).
            groups: tuple[int, ...] | None = None
            sizes = [planes * num_layers]
            if layer_groups is not None:
                groups = check_layer_groups(layer_groups, num_layers)
                sizes = [planes * groups.count(g) for g in range(max(groups) + 1)]
            group = min(sizes)
            num_pages = self.budget_pages // group
            if self.budget_pages < max(sizes):
                raise ValueError(
                    f"the pool budget ({self.budget_pages} pages) cannot hold one KV page of "
                    f"{name!r}, which needs {max(sizes)} pages (one per layer and plane)"
                )
            heads = num_kv_heads // tp
            shards = []
            for p, d in zip(self._pools, self.local_devices, strict=True):
                layout = (num_layers, heads, head_dim, block_size, code, num_pages)
                shards.append(
                    _C.KVBuffer(p, *layout, ffi_ordinal(d), d.local_hardware_id,
                                list(groups or ()), planes)
                )
            buffer = ShardedBuffer(shards)
            cache = KVCache(
                self.ledger, name, buffer, num_layers, num_kv_heads, head_dim, dtype,
                block_size, backend=self.backend, devices=self.devices, mesh=self.mesh,
                kv_axis=self.kv_axis, on_close=self._forget, layer_groups=groups, latent=latent,
            )  # fmt: skip
            self.ledger.register(name, group, lambda: cache.mapped_pages)
            self._caches[name] = cache
            try:
                self.set_memory_limit(name, memory_limit)
                self.set_memory_guarantee(name, memory_guarantee)
            except BaseException:
                cache.close()
                raise
            self._apply_reserve()
        return cache

    def _forget(self, cache: KVCache) -> None:
        with self._lock:
            if self._caches.get(cache.name) is cache:
                del self._caches[cache.name]
                self.ledger.unregister(cache.name)
                self._apply_reserve()

    def _apply_reserve(self) -> None:
        group = max((c.pages_per_kv_page for c in self._caches.values()), default=1)
        for p in self._pools:
            p.set_reserve(self.min_reserved_pages * group, self.max_reserved_pages * group)

    @property
    def caches(self) -> dict[str, KVCache]:
        return dict(self._caches)

    def __getitem__(self, name: str) -> KVCache:
        return self._caches[name]

    # -- budget ----------------------------------------------------------------------
    def _budget_pages(self) -> int:
        return self._pool.stats()["budget_pages"]

    def _in_use_pages(self) -> int:
        # The shards map in lockstep; the fullest device bounds what may still be mapped.
        return max(p.stats()["in_use_pages"] for p in self._pools)

    @property
    def tensor_parallel(self) -> int:
        """Devices every cache's KV heads are split over (1 without a mesh)."""
        return len(self.devices) if self.mesh is not None else 1

    def mapped_pages_per_device(self) -> dict[str, int]:
        """Physical pages mapped on each of this process's devices, read from each
        device's own page pool."""
        return {
            str(d): p.stats()["in_use_pages"]
            for d, p in zip(self.local_devices, self._pools, strict=True)
        }

    @property
    def budget_pages(self) -> int:
        return self._pool.stats()["budget_pages"]

    @property
    def memory_limit(self) -> int:
        return self.budget_pages * self.page_size

    # -- tenants (kept by the ledger) ----------------------------------------------
    def set_memory_limit(self, name: str, limit: int | str | None) -> MemoryLimit:
        """Sets the most physical memory the cache ``name`` may have mapped (``None``:
        the whole budget). Takes effect at once for growth; see :class:`MemoryLimit` for
        a limit below current use. Raises ValueError for a limit below the guarantee."""
        return self.ledger.set_limit(name, limit)

    def set_memory_guarantee(self, name: str, guarantee: int | str) -> MemoryLimit:
        """Sets the memory no other tenant may take from the cache ``name`` (rounded up
        to whole KV pages). Raises ValueError when it exceeds the tenant's limit or the
        guarantees together exceed the pool budget."""
        return self.ledger.set_guarantee(name, guarantee)

    def memory_limits(self) -> dict[str, MemoryLimit]:
        """Every tenant's limit, guarantee and mapped memory."""
        return {name: self.ledger.limit_of(name) for name in self.ledger.tenants()}

    def memory_limit_of(self, name: str) -> MemoryLimit:
        """One tenant's limit, guarantee and mapped memory."""
        return self.ledger.limit_of(name)

    def set_reclaimer(self, name: str, reclaim: Reclaimer | None) -> None:
        """Registers how tenant ``name`` gives idle memory back when another needs it
        (an Engine evicts idle cached prefixes). ``reclaim(pages)`` returns pages freed
        and must not block (return 0 when busy)."""
        self.ledger.set_reclaimer(name, reclaim)

    def reclaim(self, name: str, pages: int) -> int:
        """Asks the tenants other than ``name`` for up to ``pages`` idle physical pages,
        those furthest above their guarantee first. Returns the pages freed."""
        return self.ledger.reclaim(name, pages)

    def trim(self) -> None:
        """Gives every reserved (created, unmapped) page back to the OS / driver."""
        for p in self._pools:
            p.trim()

    def group_records(self) -> list[TenantRecord] | None:
        """Every tenant of the process group (all its processes), or None outside one."""
        return self.channel.records()

    def stats(self) -> dict[str, Any]:
        """Pool-wide and per-cache page and byte counts (on a mesh: per device, and
        ``mapped_pages_per_device`` / ``committed_bytes`` for each local device)."""
        s = self._pool.stats()
        ps = self.page_size
        return {
            "backend": self.backend,
            "device": str(self.device),
            "devices": [str(d) for d in self.devices],
            "tensor_parallel": self.tensor_parallel,
            "mapped_pages_per_device": self.mapped_pages_per_device(),
            "page_size": ps,
            "budget_pages": s["budget_pages"],
            "budget_bytes": s["budget_pages"] * ps,
            "mapped_pages": s["in_use_pages"],
            "mapped_bytes": s["in_use_pages"] * ps,
            "reserved_pages": s["reserved_pages"],
            "reserved_bytes": s["reserved_pages"] * ps,
            "max_reserved_pages": s["max_reserved_pages"],
            "free_pages": s["budget_pages"] - s["in_use_pages"],
            # (each device's from its own snapshot: consistent with its page counts)
            "committed_bytes": s["committed_bytes"] + sum(
                p.stats()["committed_bytes"] for p in self._pools[1:]),
            "group": self.group,
            "creates": s["creates"],
            "refills": s["refills"],
            "releases": s["releases"],
            "reuses": s["reuses"],
            "caches": {name: c.stats() for name, c in self._caches.items()},
            "limits": {n: dataclasses.asdict(r) for n, r in self.memory_limits().items()},
        }

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise KVCacheError("the pool is closed")

    def close(self) -> None:
        """Closes every cache and gives all physical memory back. The pool cannot be used
        afterwards (creating a cache or allocating raises KVCacheError)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for cache in list(self._caches.values()):
            cache.close()
        for p in self._pools:
            p.set_reserve(0, 0)
        # Last: a group's ledger counts the pages until they are unmapped.
        self.ledger.close()

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        s = self._pool.stats()
        return (
            f"Pool(backend={self.backend!r}, devices={len(self.devices)}, "
            f"page_size={self.page_size}, "
            f"budget_pages={s['budget_pages']}, mapped_pages={s['in_use_pages']}, "
            f"caches={list(self._caches)})"
        )
