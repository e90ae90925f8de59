"""Per-tenant memory limits and guarantees inside one Pool.

Counted in physical pages; a tenant maps whole KV pages (``pages_per_kv_page`` physical
pages each), so byte values are rounded down to whole KV pages of that tenant.

- limit: the most a tenant may have mapped (default: the whole pool budget).
- guarantee: what the others may never take from it. While a tenant has less than its
  guarantee mapped, the difference is held back from every other tenant's room.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

# reclaim(num_physical_pages) -> physical pages given back (idle cached prefixes).
Reclaimer = Callable[[int], int]


@dataclasses.dataclass
class Tenant:
    pages_per_kv_page: int
    limit_pages: int | None = None
    guarantee_pages: int = 0
    reclaimer: Reclaimer | None = None

    def round_down(self, pages: int) -> int:
        return pages - pages % self.pages_per_kv_page


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
