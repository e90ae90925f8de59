"""The tenant ledger: who may map how much of one device's physical page budget.

Counted in physical pages; a tenant maps whole KV pages (``pages_per_kv_page`` physical
pages each), so byte values are rounded to whole KV pages of that tenant.

- limit: the most a tenant may have mapped (default: the whole budget).
- guarantee: what the others may never take from it. While a tenant has less than its
  guarantee mapped, the difference is held back from every other tenant's room.
- reclaimer: how a tenant gives idle memory back when another one needs it.

:class:`Ledger` is the narrow interface a :class:`~jax_kvcached.memory.kv_cache.KVCache`
and a :class:`~jax_kvcached.memory.pool.Pool` use. :class:`LocalLedger` keeps it for the
tenants of one process; :class:`~jax_kvcached.memory.shared_ledger.SharedLedger` keeps it
in shared memory for the tenants of several processes (mapping stays per process, the
ledger only accounts). The one write that
needs atomicity is :meth:`Ledger.charge`: checking a tenant's room and mapping happen
under the ledger's lock, so two tenants never both take the last pages.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Protocol

from jax_kvcached.memory.config import parse_bytes
from jax_kvcached.memory.errors import KVCacheError, PoolExhausted

# reclaim(num_physical_pages) -> physical pages given back (idle cached prefixes).
# Must not block: a busy tenant returns 0.
Reclaimer = Callable[[int], int]
# usage() -> physical pages the tenant has mapped now (its buffer is the truth).
Usage = Callable[[], int]


@dataclasses.dataclass(frozen=True)
class MemoryLimit:
    """What :meth:`Pool.set_memory_limit` / :meth:`Pool.set_memory_guarantee` applied.

    ``over_limit_bytes`` > 0: the tenant has more mapped than its new limit. It cannot grow
    until it is below; an Engine gives the excess back at its next step (idle cached
    prefixes first, then by preempting its newest requests).
    ``guarantee_shortfall_bytes`` > 0: part of the guarantee is mapped by other tenants
    now; they cannot grow into it and it becomes this tenant's as they release pages.
    """

    name: str
    limit_bytes: int | None
    guarantee_bytes: int
    mapped_bytes: int
    over_limit_bytes: int
    guarantee_shortfall_bytes: int

    @property
    def applied(self) -> bool:
        """True when the new settings hold right now (nothing to give back or wait for)."""
        return self.over_limit_bytes == 0 and self.guarantee_shortfall_bytes == 0


def limit_to_pages(
    name: str,
    limit: int | str | None,
    page_size: int,
    pages_per_kv_page: int,
    guarantee: int,
    budget: int,
) -> int | None:
    """A tenant's limit in physical pages, rounded down to whole KV pages (None: the
    budget); ValueError below its guarantee (pages), above the ``budget`` (pages), or
    between 0 and one KV page (which would round to a silent 0: give 0 to mean it)."""
    if limit is None:
        return None
    nbytes = parse_bytes(limit, "memory limit", allow_zero=True)
    kv_page = page_size * pages_per_kv_page
    if nbytes > budget * page_size:
        raise ValueError(
            f"memory limit of {name!r} ({nbytes} bytes) exceeds the budget "
            f"({budget * page_size} bytes); none means the whole budget"
        )
    pages = nbytes // page_size
    pages -= pages % pages_per_kv_page
    if pages < guarantee:
        raise ValueError(
            f"memory limit of {name!r} ({pages * page_size} bytes in whole KV pages) is "
            f"below its guarantee ({guarantee * page_size})"
        )
    if 0 < nbytes < kv_page:
        raise ValueError(
            f"memory limit of {name!r} ({nbytes} bytes) is below one KV page of it "
            f"({kv_page} bytes: {pages_per_kv_page} pages of {page_size}): limits count whole "
            "KV pages; give at least one, or 0 to stop it mapping"
        )
    return pages


def guarantee_to_pages(
    name: str,
    guarantee: int | str,
    page_size: int,
    pages_per_kv_page: int,
    limit: int,
    others: int,
    budget: int,
    budget_what: str,
) -> int:
    """A tenant's guarantee in physical pages, rounded up to whole KV pages; ValueError
    above its ``limit`` or when it and the ``others``' guarantees exceed ``budget`` (all
    in pages; ``budget_what`` names the budget in the message)."""
    nbytes = parse_bytes(guarantee, "memory guarantee", allow_zero=True)
    pages = -(-nbytes // page_size)
    pages = -(-pages // pages_per_kv_page) * pages_per_kv_page
    if pages > limit:
        raise ValueError(
            f"memory guarantee of {name!r} ({pages * page_size} bytes) exceeds its limit "
            f"({limit * page_size})"
        )
    if others + pages > budget:
        raise ValueError(
            f"guarantees would total {(others + pages) * page_size} bytes, more than "
            f"{budget_what} ({budget * page_size})"
        )
    return pages


def limit_result(
    name: str,
    page_size: int,
    mapped: int,
    limit: int | None,
    budget: int,
    guarantee: int,
    free: int,
    held: int,
) -> MemoryLimit:
    """A tenant's :class:`MemoryLimit` from its pages: ``limit`` None means the
    ``budget``; ``free`` is the budget's unmapped pages, of which ``held`` are other
    tenants' unmet guarantees (held back from this tenant first)."""
    effective = budget if limit is None else limit
    shortfall = max(0, (guarantee - mapped) - max(0, free - held))
    return MemoryLimit(
        name=name,
        limit_bytes=None if limit is None else limit * page_size,
        guarantee_bytes=guarantee * page_size,
        mapped_bytes=mapped * page_size,
        over_limit_bytes=max(0, mapped - effective) * page_size,
        guarantee_shortfall_bytes=shortfall * page_size,
    )


def reclaim_in_order(candidates: list[tuple[int, str, Reclaimer | None]], pages: int) -> int:
    """Asks ``(pages above guarantee, name, reclaimer)`` candidates for up to ``pages``
    pages, those furthest above their guarantee first (ties by name); only memory above
    a guarantee is asked for. Returns the pages freed."""
    freed = 0
    for above, _, reclaimer in sorted(candidates, key=lambda x: (x[0], x[1]), reverse=True):
        if freed >= pages or above <= 0 or reclaimer is None:
            continue
        freed += reclaimer(min(pages - freed, above))
    return freed


class Ledger(Protocol):
    """The accounting interface of one device budget shared by named tenants."""

    page_size: int

    @property
    def budget_pages(self) -> int: ...

    def register(self, name: str, pages_per_kv_page: int, usage: Usage) -> None:
        """Adds a tenant (no limit, no guarantee); ValueError if the name is taken."""

    def unregister(self, name: str) -> None:
        """Removes a tenant (its pages are unmapped by then)."""

    def tenants(self) -> list[str]: ...

    def mapped_pages(self, name: str) -> int: ...

    def room_pages(self, name: str) -> int:
        """Pages ``name`` may map now: free pages less the others' unmet guarantees,
        within its own limit."""

    def capacity_pages(self, name: str) -> int:
        """The most pages ``name`` could ever map under the current limits."""

    def over_limit_pages(self, name: str) -> int:
        """Pages ``name`` has mapped above its limit (to give back)."""

    def charge(self, name: str, pages: int, do_map: Callable[[], None]) -> None:
        """Runs ``do_map`` (which maps ``pages`` pages for ``name``) if its room allows,
        atomically with the check; raises PoolExhausted (nothing mapped) otherwise."""

    def set_limit(self, name: str, limit: int | str | None) -> MemoryLimit: ...

    def set_guarantee(self, name: str, guarantee: int | str) -> MemoryLimit: ...

    def limit_of(self, name: str) -> MemoryLimit: ...

    def set_reclaimer(self, name: str, reclaim: Reclaimer | None) -> None: ...

    def reclaim(self, name: str, pages: int) -> int:
        """Asks the other tenants for up to ``pages`` idle pages for ``name``; returns
        the pages freed."""

    def released(self, name: str) -> None:
        """``name`` unmapped pages (a shared ledger publishes it to the group)."""

    def poll(
        self, name: str, hit_tokens: int = 0, query_tokens: int = 0, idle_pages: int = -1
    ) -> None:
        """Called by ``name``'s engine at each step with its prefix-cache counters and
        the pages it could give back now: a shared ledger publishes them and honours
        what other processes asked of it there."""

    def close(self) -> None:
        """No charge succeeds afterwards (KVCacheError)."""


@dataclasses.dataclass
class _Tenant:
    pages_per_kv_page: int
    usage: Usage
    limit_pages: int | None = None
    guarantee_pages: int = 0
    reclaimer: Reclaimer | None = None


class LocalLedger:
    """The ledger of one process's tenants of one device budget.

    Args:
      page_size: bytes per physical page.
      budget_pages: the device budget in pages now.
      in_use: pages mapped now by every tenant together (the page pool's count, which
        also sees pages mapped by FFI ops inside jitted code).
    """

    def __init__(
        self, page_size: int, budget_pages: Callable[[], int], in_use: Callable[[], int]
    ) -> None:
        self.page_size = page_size
        self._budget_pages = budget_pages
        self._in_use = in_use
        self._tenants: dict[str, _Tenant] = {}
        self._lock = threading.RLock()  # charges, limit changes, registration
        self._closed = False

    @property
    def budget_pages(self) -> int:
        return self._budget_pages()

    # -- tenants -----------------------------------------------------------------------
    def register(self, name: str, pages_per_kv_page: int, usage: Usage) -> None:
        with self._lock:
            if name in self._tenants:
                raise ValueError(f"a tenant named {name!r} is already registered")
            self._tenants[name] = _Tenant(pages_per_kv_page, usage)

    def unregister(self, name: str) -> None:
        with self._lock:
            self._tenants.pop(name, None)

    def tenants(self) -> list[str]:
        with self._lock:
            return list(self._tenants)

    def _tenant(self, name: str) -> _Tenant:
        t = self._tenants.get(name)
        if t is None:
            raise KeyError(f"no KV cache named {name!r} in this pool; have {sorted(self._tenants)}")
        return t

    def mapped_pages(self, name: str) -> int:
        return self._tenant(name).usage()

    # -- room ----------------------------------------------------------------------------
    def _limit_pages(self, t: _Tenant) -> int:
        return self.budget_pages if t.limit_pages is None else t.limit_pages

    def _held_for_others(self, name: str) -> int:
        return sum(
            max(0, t.guarantee_pages - t.usage()) for n, t in self._tenants.items() if n != name
        )

    def _guaranteed_to_others(self, name: str) -> int:
        return sum(t.guarantee_pages for n, t in self._tenants.items() if n != name)

    def room_pages(self, name: str) -> int:
        with self._lock:
            t = self._tenant(name)
            room = self.budget_pages - self._in_use() - self._held_for_others(name)
            return max(0, min(room, self._limit_pages(t) - t.usage()))

    def capacity_pages(self, name: str) -> int:
        with self._lock:
            t = self._tenant(name)
            others = self._guaranteed_to_others(name)
            return max(0, min(self._limit_pages(t), self.budget_pages - others))

    def over_limit_pages(self, name: str) -> int:
        with self._lock:
            t = self._tenants.get(name)
            return 0 if t is None else max(0, t.usage() - self._limit_pages(t))

    def charge(self, name: str, pages: int, do_map: Callable[[], None]) -> None:
        with self._lock:
            if self._closed:
                raise KVCacheError("the pool is closed")
            room = self.room_pages(name)
            if pages > room:
                raise PoolExhausted(
                    f"KV cache {name!r}: {pages} pages needed, {room} within its room"
                )
            do_map()

    # -- limits and guarantees -------------------------------------------------------
    def _result(self, name: str) -> MemoryLimit:
        t = self._tenants[name]
        return limit_result(
            name, self.page_size, t.usage(), t.limit_pages, self.budget_pages,
            t.guarantee_pages, self.budget_pages - self._in_use(), self._held_for_others(name),
        )  # fmt: skip

    def set_limit(self, name: str, limit: int | str | None) -> MemoryLimit:
        """``None``: the whole budget. Rounded down to whole KV pages; ValueError below
        the guarantee."""
        with self._lock:
            t = self._tenant(name)
            t.limit_pages = limit_to_pages(
                name, limit, self.page_size, t.pages_per_kv_page, t.guarantee_pages,
                self.budget_pages,
            )  # fmt: skip
            return self._result(name)

    def set_guarantee(self, name: str, guarantee: int | str) -> MemoryLimit:
        """Rounded up to whole KV pages; ValueError above the tenant's limit or when the
        guarantees together exceed the budget."""
        with self._lock:
            t = self._tenant(name)
            t.guarantee_pages = guarantee_to_pages(
                name, guarantee, self.page_size, t.pages_per_kv_page, self._limit_pages(t),
                self._guaranteed_to_others(name), self.budget_pages, "the pool budget",
            )  # fmt: skip
            return self._result(name)

    def limit_of(self, name: str) -> MemoryLimit:
        with self._lock:
            self._tenant(name)
            return self._result(name)

    # -- reclaim -------------------------------------------------------------------------
    def set_reclaimer(self, name: str, reclaim: Reclaimer | None) -> None:
        """``None`` for a tenant already gone (its pool closed first) is a no-op."""
        with self._lock:
            if reclaim is None and name not in self._tenants:
                return
            self._tenant(name).reclaimer = reclaim

    def reclaim(self, name: str, pages: int) -> int:
        """Those furthest above their guarantee are asked first; only memory above a
        guarantee is asked for."""
        with self._lock:
            candidates = [
                (t.usage() - t.guarantee_pages, n, t.reclaimer)
                for n, t in self._tenants.items()
                if n != name
            ]
        return reclaim_in_order(candidates, pages)  # outside the lock: reclaimers take theirs

    def released(self, name: str) -> None:
        """Nothing to publish: usage is read from the buffers."""

    def poll(
        self, name: str, hit_tokens: int = 0, query_tokens: int = 0, idle_pages: int = -1
    ) -> None:
        """Nothing to honour: in one process, reclaims are direct calls."""

    def close(self) -> None:
        with self._lock:
            self._closed = True
