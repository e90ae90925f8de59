"""Pool: one physical KV memory budget per device, shared by all its KV caches."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import jax

from jax_kvcached.memory import _C
from jax_kvcached.memory.config import Config, parse_bytes
from jax_kvcached.memory.errors import KVCacheError
from jax_kvcached.memory.kv_cache import KVCache, dtype_code
from jax_kvcached.memory.ledger import Ledger, LocalLedger, MemoryLimit, Reclaimer

BACKENDS = ("auto", "host", "cuda")


def _host_available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("MemAvailable not found in /proc/meminfo")


def _is_gpu(device: Any) -> bool:
    return getattr(device, "platform", None) in ("gpu", "cuda")


def _resolve(backend: str, device: Any) -> tuple[str, Any]:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if device is None:
        default = jax.devices()[0]
        if backend != "host" and _is_gpu(default) and (backend == "cuda" or _C.cuda_compiled()):
            device = default
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


class Pool:
    """A physical page budget on one device, shared by every KV cache created from it.

    Args:
      memory_limit: bytes or a string like ``"8GiB"``. Default: ``KVCACHED_GPU_UTILIZATION``
        of the GPU's free memory, or ``KVCACHED_HOST_MEMORY_FRACTION`` of available RAM.
      page_size: physical page size in bytes (default ``KVCACHED_PAGE_SIZE_MB`` MiB).
      backend: ``"host"`` (Linux VM), ``"cuda"`` (driver VMM) or ``"auto"``.
      device: the JAX device the views live on (default: the first GPU for CUDA, else CPU).
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
        min_reserved_pages: int | None = None,
        max_reserved_pages: int | None = None,
        config: Config | None = None,
    ) -> None:
        cfg = config or Config.from_env()
        self.config = cfg
        self.backend, self.device = _resolve(backend, device)
        page = cfg.page_size if page_size is None else parse_bytes(page_size, "page_size")
        self.min_reserved_pages = (
            cfg.min_reserved_pages if min_reserved_pages is None else int(min_reserved_pages)
        )
        self.max_reserved_pages = (
            cfg.max_reserved_pages if max_reserved_pages is None else int(max_reserved_pages)
        )
        if not 0 <= self.min_reserved_pages <= self.max_reserved_pages:
            raise ValueError("need 0 <= min_reserved_pages <= max_reserved_pages")
        if memory_limit is None:
            if self.backend == "cuda":
                free, _ = _C.cuda_mem_info(self.device.id)
                limit = int(free * cfg.gpu_utilization)
            else:
                limit = int(_host_available_bytes() * cfg.host_memory_fraction)
        else:
            limit = parse_bytes(memory_limit, "memory_limit")
        if limit < page:
            raise ValueError(
                f"memory_limit ({limit} bytes) is smaller than one page ({page} bytes)"
            )
        dev_id = self.device.id if self.backend == "cuda" else 0
        self._pool = _C.PagePool(self.backend, page, limit // page, 0, 0, dev_id)
        self.page_size: int = self._pool.page_size
        self._caches: dict[str, KVCache] = {}
        # Who may map how much: the tenants' limits, guarantees and reclaimers.
        self.ledger: Ledger = LocalLedger(self.page_size, self._budget_pages, self._in_use_pages)
        self._lock = threading.RLock()  # cache creation and removal
        self._closed = False
        self._apply_reserve()

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
    ) -> KVCache:
        """Creates a KV cache whose virtual range can grow to the whole pool budget.

        ``memory_limit`` / ``memory_guarantee``: see :meth:`set_memory_limit` and
        :meth:`set_memory_guarantee`.
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
        with self._lock:
            self._check_open()
            if name in self._caches:
                raise ValueError(f"a KV cache named {name!r} already exists in this pool")
            group = 2 * num_layers
            num_pages = self.budget_pages // group
            if num_pages == 0:
                raise ValueError(
                    f"the pool budget ({self.budget_pages} pages) cannot hold one KV page of "
                    f"{name!r}, which needs {group} pages (one per layer for K and V)"
                )
            buffer = _C.KVBuffer(
                self._pool, num_layers, num_kv_heads, head_dim, block_size, code, num_pages
            )
            cache = KVCache(
                self.ledger, name, buffer, num_layers, num_kv_heads, head_dim, dtype,
                block_size, backend=self.backend, device=self.device, on_close=self._forget,
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
        self._pool.set_reserve(self.min_reserved_pages * group, self.max_reserved_pages * group)

    @property
    def caches(self) -> dict[str, KVCache]:
        return dict(self._caches)

    def __getitem__(self, name: str) -> KVCache:
        return self._caches[name]

    # -- budget ----------------------------------------------------------------------
    def _budget_pages(self) -> int:
        return self._pool.stats()["budget_pages"]

    def _in_use_pages(self) -> int:
        return self._pool.stats()["in_use_pages"]

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
        self._pool.trim()

    def stats(self) -> dict[str, Any]:
        """Pool-wide and per-cache page and byte counts."""
        s = self._pool.stats()
        ps = self.page_size
        return {
            "backend": self.backend,
            "device": str(self.device),
            "page_size": ps,
            "budget_pages": s["budget_pages"],
            "budget_bytes": s["budget_pages"] * ps,
            "mapped_pages": s["in_use_pages"],
            "mapped_bytes": s["in_use_pages"] * ps,
            "reserved_pages": s["reserved_pages"],
            "reserved_bytes": s["reserved_pages"] * ps,
            "max_reserved_pages": s["max_reserved_pages"],
            "free_pages": s["budget_pages"] - s["in_use_pages"],
            "committed_bytes": self._pool.committed_bytes,
            "creates": s["creates"],
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
            self._closed = True
        self.ledger.close()
        for cache in list(self._caches.values()):
            cache.close()
        self._pool.set_reserve(0, 0)

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        s = self._pool.stats()
        return (
            f"Pool(backend={self.backend!r}, device={self.device}, page_size={self.page_size}, "
            f"budget_pages={s['budget_pages']}, mapped_pages={s['in_use_pages']}, "
            f"caches={list(self._caches)})"
        )
