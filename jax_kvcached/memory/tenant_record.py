"""A group's tenants as their rows in the shared segment say: what ``ctl``, ``top`` and
the sleep mailbox read (:meth:`SharedLedger.records
<jax_kvcached.memory.shared_ledger.SharedLedger.records>`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from jax_kvcached.memory.shm_segment import Segment


@dataclasses.dataclass(frozen=True)
class TenantRecord:
    """One tenant of a group as its row says (mapped pages of other processes are as
    last published: at their last charge, release or watcher round)."""

    name: str
    pid: int
    member: int  # its pool (a process may hold several pools of one group)
    pages_per_kv_page: int
    mapped_pages: int
    reserved_pages: int  # its pool's reserve (shared by that pool's tenants)
    limit_pages: int | None
    guarantee_pages: int
    request_pages: int
    given_pages: int
    idle_pages: int  # what its engine could give back at its last step (-1: unknown)
    hit_tokens: int
    query_tokens: int
    updated_ns: int
    status: int = 0  # what its owner publishes (serve/: its sleep level)
    request: int = 0  # posted by another process, not yet cleared by the owner (0: none)

    @property
    def hit_rate(self) -> float | None:
        return self.hit_tokens / self.query_tokens if self.query_tokens else None



_COPIED = ("pid", "member", "pages_per_kv_page", "reserved_pages", "guarantee_pages",
           "request_pages", "given_pages", "idle_pages", "hit_tokens", "query_tokens",
           "updated_ns", "status", "request")  # fmt: skip


def read_records(seg: Segment, mapped: Callable[[str, int], int]) -> list[TenantRecord]:
    """Every used row of ``seg`` (its lock held by the caller), by name; ``mapped(name,
    row)``: the tenant's mapped pages (fresh for the caller's own tenants)."""
    out = []
    for i in seg.used_rows():
        name = seg.name_of(i)
        lim = seg.get(i, "limit_pages")
        out.append(TenantRecord(name=name, mapped_pages=mapped(name, i),
                                limit_pages=None if lim < 0 else lim,
                                **{f: seg.get(i, f) for f in _COPIED}))  # fmt: skip
    return sorted(out, key=lambda r: r.name)
