"""Pool: one physical KV memory budget per device, shared by all its KV caches."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import jax

from jax_kvcached import _C
from jax_kvcached.config import Config, parse_bytes
from jax_kvcached.errors import KVCacheError, PoolExhausted
from jax_kvcached.kv_cache import KVCache, dtype_code
from jax_kvcached.tenants import MemoryLimit, Reclaimer, Tenant

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
        self._tenants: dict[str, Tenant] = {}
        # Held while a cache checks its room and maps pages, and while limits change.
        self._lock = threading.RLock()
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
                self, name, buffer, num_layers, num_kv_heads, head_dim, dtype, block_size
            )
            self._caches[name] = cache
            self._tenants[name] = Tenant(group)
            try:
                self.set_memory_limit(name, memory_limit)
                self.set_memory_guarantee(name, memory_guarantee)
            except BaseException:
                del self._caches[name], self._tenants[name]
                cache.close()
                raise
            self._apply_reserve()
        return cache

    def _forget(self, cache: KVCache) -> None:
        with self._lock:
            if self._caches.get(cache.name) is cache:
                del self._caches[cache.name]
                del self._tenants[cache.name]
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
    @property
    def budget_pages(self) -> int:
        return self._pool.stats()["budget_pages"]

    @property
    def memory_limit(self) -> int:
        return self.budget_pages * self.page_size

    # -- tenants ---------------------------------------------------------------------
    def _tenant(self, name: str) -> Tenant:
        t = self._tenants.get(name)
        if t is None:
            raise KeyError(f"no KV cache named {name!r} in this pool; have {sorted(self._caches)}")
        return t

    def _limit_result(self, name: str) -> MemoryLimit:
        t, cache, ps = self._tenants[name], self._caches[name], self.page_size
        mapped = cache.mapped_pages
        s = self._pool.stats()
        free = s["budget_pages"] - s["in_use_pages"]
        # Other tenants' unmet guarantees are held back from the free pages first.
        held = self._held_for_others(cache)
        shortfall = max(0, (t.guarantee_pages - mapped) - max(0, free - held))
        return MemoryLimit(
            name=name,
            limit_bytes=None if t.limit_pages is None else t.limit_pages * ps,
            guarantee_bytes=t.guarantee_pages * ps,
            mapped_bytes=mapped * ps,
            over_limit_bytes=max(0, mapped - self._limit_pages(t)) * ps,
            guarantee_shortfall_bytes=shortfall * ps,
        )

    def _limit_pages(self, t: Tenant) -> int:
        return self.budget_pages if t.limit_pages is None else t.limit_pages

    def set_memory_limit(self, name: str, limit: int | str | None) -> MemoryLimit:
        """Sets the most physical memory the cache ``name`` may have mapped (``None``:
        the whole budget). Takes effect at once for growth; see :class:`MemoryLimit` for
        a limit below current use. Raises ValueError for a limit below the guarantee."""
        with self._lock:
            t = self._tenant(name)
            if limit is None:
                pages = None
            else:
                pages = t.round_down(
                    parse_bytes(limit, "memory limit", allow_zero=True) // self.page_size
                )
                if pages < t.guarantee_pages:
                    raise ValueError(
                        f"memory limit of {name!r} ({pages * self.page_size} bytes in whole "
                        f"KV pages) is below its guarantee ({t.guarantee_pages * self.page_size})"
                    )
            t.limit_pages = pages
            return self._limit_result(name)

    def set_memory_guarantee(self, name: str, guarantee: int | str) -> MemoryLimit:
        """Sets the memory no other tenant may take from the cache ``name`` (rounded up
        to whole KV pages). Raises ValueError when it exceeds the tenant's limit or the
        guarantees together exceed the pool budget."""
        with self._lock:
            t = self._tenant(name)
            nbytes = parse_bytes(guarantee, "memory guarantee", allow_zero=True)
            pages = -(-nbytes // self.page_size)
            pages = -(-pages // t.pages_per_kv_page) * t.pages_per_kv_page
            if pages > self._limit_pages(t):
                raise ValueError(
                    f"memory guarantee of {name!r} ({pages * self.page_size} bytes) exceeds "
                    f"its limit ({self._limit_pages(t) * self.page_size})"
                )
            others = self._guaranteed_to_others(name)
            if others + pages > self.budget_pages:
                raise ValueError(
                    f"guarantees would total {(others + pages) * self.page_size} bytes, more "
                    f"than the pool budget ({self.memory_limit})"
                )
            t.guarantee_pages = pages
            return self._limit_result(name)

    def memory_limits(self) -> dict[str, MemoryLimit]:
        """Every tenant's limit, guarantee and mapped memory."""
        with self._lock:
            return {name: self._limit_result(name) for name in self._caches}

    def memory_limit_of(self, name: str) -> MemoryLimit:
        """One tenant's limit, guarantee and mapped memory."""
        with self._lock:
            self._tenant(name)
            return self._limit_result(name)

    def _guaranteed_to_others(self, name: str) -> int:
        """Pages guaranteed to every tenant but ``name``."""
        return sum(t.guarantee_pages for n, t in self._tenants.items() if n != name)

    def _held_for_others(self, cache: KVCache) -> int:
        return sum(
            max(0, self._tenants[n].guarantee_pages - c.mapped_pages)
            for n, c in self._caches.items()
            if c is not cache
        )

    def room_pages(self, cache: KVCache) -> int:
        """Physical pages ``cache`` may map now: the pool's free pages less the other
        tenants' unmet guarantees, within its own limit."""
        s = self._pool.stats()
        room = s["budget_pages"] - s["in_use_pages"] - self._held_for_others(cache)
        t = self._tenants.get(cache.name)
        if t is not None:
            room = min(room, self._limit_pages(t) - cache.mapped_pages)
        return max(0, room)

    def capacity_pages(self, cache: KVCache) -> int:
        """The most physical pages ``cache`` could ever map under the current limits."""
        t = self._tenants[cache.name]
        others = self._guaranteed_to_others(cache.name)
        return max(0, min(self._limit_pages(t), self.budget_pages - others))

    def over_limit_pages(self, cache: KVCache) -> int:
        t = self._tenants.get(cache.name)
        return 0 if t is None else max(0, cache.mapped_pages - self._limit_pages(t))

    def _map_for(self, cache: KVCache, pages: int, do_map: Callable[[], None]) -> None:
        """Maps ``pages`` physical pages for ``cache`` if its room allows (atomically)."""
        with self._lock:
            self._check_open()
            room = self.room_pages(cache)
            if pages > room:
                raise PoolExhausted(
                    f"KV cache {cache.name!r}: {pages} pages needed, {room} within its room"
                )
            do_map()

    def set_reclaimer(self, name: str, reclaim: Reclaimer | None) -> None:
        """Registers how tenant ``name`` gives idle memory back when another needs it
        (an Engine evicts idle cached prefixes). ``reclaim(pages)`` returns pages freed
        and must not block (return 0 when busy)."""
        self._tenant(name).reclaimer = reclaim

    def reclaim(self, cache: KVCache, pages: int) -> int:
        """Asks the other tenants for up to ``pages`` idle physical pages, those furthest
        above their guarantee first; only memory above a guarantee is asked for.
        Returns the pages freed."""
        freed = 0
        order = sorted(
            (
                (c.mapped_pages - self._tenants[n].guarantee_pages, n)
                for n, c in list(self._caches.items())
                if c is not cache
            ),
            reverse=True,
        )
        for above, n in order:
            t = self._tenants.get(n)
            if freed >= pages or above <= 0 or t is None or t.reclaimer is None:
                continue
            freed += t.reclaimer(min(pages - freed, above))
        return freed

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
