"""The tenant ledger of a process group: one device budget shared by several processes.

Several processes (one engine each, typically) join a group by name (``KVCACHED_IPC_NAME``,
``Pool(..., group=)``, ``serve --group``). Each process creates and maps its own physical
pages (on CUDA: its own ``cuMemCreate`` allocations); the group's segment
(:mod:`shm_segment`) only *accounts*: the budget, and per tenant its process, mapped and
reserved pages, limit and guarantee. It implements the :class:`~.ledger.Ledger` interface,
so a :class:`~jax_kvcached.memory.kv_cache.KVCache` does not know whether its ledger is
local or shared.

- A charge is one atomic step: under the group's lock the room is computed from every
  row, the pages are mapped, and the row is updated before the lock is released (no
  check-then-allocate race between processes).
- Room counts every process's mapped pages and reserve (created, unmapped pages) and the
  other tenants' unmet guarantees; the group's physical pages never exceed its budget.
- Pressure: a tenant short of memory first asks this process's other tenants (as the
  local ledger does), then sets ``request_pages`` on other processes' tenants that hold
  memory above their guarantee, and waits (bounded) while they give idle cached prefixes
  back: each engine honours a request at its next step (:meth:`poll`), and a watcher
  thread per process answers for idle engines. Over-limit tenants (``ctl limit``) shrink
  the same way.
- A row whose process died is swept: when a charge finds no room, and every
  ``SWEEP_S`` by each member's watcher.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable

from jax_kvcached.memory.errors import KVCacheError, PoolExhausted
from jax_kvcached.memory.ledger import (
    MemoryLimit,
    Reclaimer,
    Usage,
    guarantee_to_pages,
    limit_result,
    limit_to_pages,
    reclaim_in_order,
)
from jax_kvcached.memory.shm_segment import Segment, start_time
from jax_kvcached.memory.tenant_record import TenantRecord, read_records

log = logging.getLogger("jax_kvcached.memory.shared_ledger")

WATCH_S = 0.02  # how often a member's watcher looks at its own rows
SWEEP_S = 0.5  # how often it sweeps dead processes' rows and republishes its own


@dataclasses.dataclass
class _Own:
    """A tenant of this process."""

    row: int
    usage: Usage
    reclaimer: Reclaimer | None = None


class SharedLedger:
    """The ledger of a group's tenants, kept in shared memory.

    Args:
      group: the group's name.
      page_size: bytes per physical page (every member's must match).
      budget_pages: the group's budget when this process creates it; a group that exists
        keeps its budget (:attr:`budget_pages`). None: join only (must exist).
      fixed: ``budget_pages`` was asked for explicitly: a group with another budget is
        an error while it has live tenants (without, it takes the new budget).
      reserved: this process's reserved pages now (its page pools').
      trim: gives this process's reserved pages back to the OS / driver.
      wait_s: how long :meth:`reclaim` waits for other processes to give memory back.
      watch: run the watcher thread once a tenant registers (off for observers).
    """

    def __init__(
        self,
        group: str,
        page_size: int | None = None,
        budget_pages: int | None = None,
        *,
        fixed: bool = False,
        reserved: Callable[[], int] | None = None,
        trim: Callable[[], None] | None = None,
        wait_s: float = 1.0,
        watch: bool = True,
    ) -> None:
        self.segment = Segment(
            group, create=budget_pages is not None, page_size=page_size, budget_pages=budget_pages
        )
        self.group = group
        self.page_size = self.segment.page_size
        self._reserved = reserved or (lambda: 0)
        self._trim = trim
        self.wait_s = float(wait_s)
        self._watch = watch
        self._pid = os.getpid()
        self._start = start_time(self._pid)
        self._member = int.from_bytes(os.urandom(7), "little") + 1  # this ledger's rows
        self._own: dict[str, _Own] = {}
        self._lock = threading.RLock()  # this process's view of its own tenants
        self._closed = False
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        if fixed and budget_pages is not None and budget_pages != self.budget_pages:
            try:
                self._rebudget(budget_pages)
            except BaseException:
                self.segment.close()
                raise

    def _rebudget(self, pages: int) -> None:
        with self.segment.locked():
            self.segment.sweep()
            live = self.segment.used_rows()
            if live:
                ps = self.page_size
                raise ValueError(
                    f"group {self.group!r} has a budget of {self.budget_pages * ps} bytes and "
                    f"{len(live)} live tenants; this pool asked for {pages * ps}: give the "
                    f"same memory limit, or none to join with the group's"
                )
            log.info("group %r: no live tenant, budget now %d pages", self.group, pages)
            self.segment.header["budget_pages"] = pages

    @classmethod
    def attach(cls, group: str) -> SharedLedger:
        """An observer of an existing group (``ctl``): reads and sets limits and
        guarantees, registers nothing. KeyError if the group does not exist."""
        return cls(group, watch=False)

    @property
    def budget_pages(self) -> int:
        return self.segment.budget_pages

    # -- rows ------------------------------------------------------------------------------
    def _row(self, name: str) -> int:
        own = self._own.get(name)
        if own is not None:
            return own.row
        row = self.segment.find(name)
        if row is None:
            have = sorted(self.segment.name_of(i) for i in self.segment.used_rows())
            raise KeyError(f"no tenant named {name!r} in group {self.group!r}; have {have}")
        return row

    def _mapped(self, name: str, row: int) -> int:
        own = self._own.get(name)
        return own.usage() if own is not None else self.segment.get(row, "mapped_pages")

    def _limit(self, row: int) -> int:
        lim = self.segment.get(row, "limit_pages")
        return self.budget_pages if lim < 0 else lim

    def _guaranteed_to_others(self, row: int) -> int:
        seg = self.segment
        return sum(seg.get(i, "guarantee_pages") for i in seg.used_rows() if i != row)

    def _publish(self) -> None:
        """Writes this process's tenants' mapped pages and reserve (under the lock): the
        reserve first, so a reader never sees fewer physical pages than there are."""
        seg, reserved, now = self.segment, self._reserved(), time.time_ns()
        for own in self._own.values():
            seg.set(own.row, "reserved_pages", reserved)
        for own in self._own.values():
            seg.set(own.row, "mapped_pages", own.usage())
            seg.set(own.row, "updated_ns", now)

    def _totals(self, name: str | None) -> tuple[int, int, int]:
        """(mapped pages of every tenant, reserves of other pools, unmet guarantees
        of tenants other than ``name``)."""
        seg = self.segment
        mapped = held = 0
        reserves: dict[int, int] = {}  # per member (each pool has one reserve)
        for i in seg.used_rows():
            n = seg.name_of(i)
            m = self._mapped(n, i)
            mapped += m
            member = seg.get(i, "member")
            if member != self._member:
                reserves[member] = max(reserves.get(member, 0), seg.get(i, "reserved_pages"))
            if n != name:
                held += max(0, seg.get(i, "guarantee_pages") - m)
        return mapped, sum(reserves.values()), held

    # -- tenants ---------------------------------------------------------------------------
    def register(self, name: str, pages_per_kv_page: int, usage: Usage) -> None:
        with self._lock, self.segment.locked():
            self._check_open()
            self.segment.sweep()
            row = self.segment.find(name)
            if row is not None:
                pid = self.segment.get(row, "pid")
                raise ValueError(
                    f"a tenant named {name!r} is already registered in group {self.group!r} "
                    f"(pid {pid})"
                )
            row = self.segment.add_row(
                name,
                {
                    "pid": self._pid,
                    "start_time": self._start,
                    "member": self._member,
                    "pages_per_kv_page": pages_per_kv_page,
                    "limit_pages": -1,
                    "idle_pages": -1,  # until its engine says
                    "updated_ns": time.time_ns(),
                },
            )
            self._own[name] = _Own(row, usage)
            self._publish()
        if self._watch and self._watcher is None:
            self._watcher = threading.Thread(
                target=self._watch_loop, name=f"kvcached-group-{self.group}", daemon=True
            )
            self._watcher.start()

    def unregister(self, name: str) -> None:
        with self._lock:
            own = self._own.pop(name, None)
            if own is None or self.segment.closed:
                return
            with self.segment.locked():
                self.segment.drop_row(own.row)
                self._publish()

    def tenants(self) -> list[str]:
        """This process's tenants."""
        with self._lock:
            return list(self._own)

    def mapped_pages(self, name: str) -> int:
        with self._lock, self.segment.locked():
            return self._mapped(name, self._row(name))

    # -- room ------------------------------------------------------------------------------
    def _room(self, name: str) -> int:
        row = self._row(name)
        mapped, reserves, held = self._totals(name)
        room = self.budget_pages - mapped - reserves - held
        return max(0, min(room, self._limit(row) - self._mapped(name, row)))

    def room_pages(self, name: str) -> int:
        with self._lock, self.segment.locked():
            return self._room(name)

    def capacity_pages(self, name: str) -> int:
        with self._lock, self.segment.locked():
            row = self._row(name)
            return max(
                0, min(self._limit(row), self.budget_pages - self._guaranteed_to_others(row))
            )

    def over_limit_pages(self, name: str) -> int:
        with self._lock:
            own = self._own.get(name)
            if own is None or self._closed:
                return 0
            lim = self.segment.get(own.row, "limit_pages")  # one aligned read: no lock
            return 0 if lim < 0 else max(0, own.usage() - lim)

    def charge(self, name: str, pages: int, do_map: Callable[[], None]) -> None:
        with self._lock, self.segment.locked():
            self._check_open()
            room = self._room(name)
            if pages > room and self.segment.sweep():  # contention: a dead process?
                room = self._room(name)
            if pages > room:
                raise PoolExhausted(
                    f"KV cache {name!r}: {pages} pages needed, {room} within its room in "
                    f"group {self.group!r}"
                )
            do_map()
            self._publish()

    def released(self, name: str) -> None:
        """Publishes what ``name`` unmapped (others see the room at once)."""
        with self._lock:
            if self._closed or name not in self._own:
                return
            with self.segment.locked():
                self._publish()

    # -- limits and guarantees ---------------------------------------------------------
    def _result(self, name: str) -> MemoryLimit:
        row, seg = self._row(name), self.segment
        all_mapped, reserves, held = self._totals(name)
        lim = seg.get(row, "limit_pages")
        return limit_result(
            name, self.page_size, self._mapped(name, row), None if lim < 0 else lim,
            self.budget_pages, seg.get(row, "guarantee_pages"),
            self.budget_pages - all_mapped - reserves, held,
        )  # fmt: skip

    def set_limit(self, name: str, limit: int | str | None) -> MemoryLimit:
        """Any tenant of the group (``ctl`` sets other processes'); ``None``: the budget.
        Rounded down to whole KV pages; ValueError below the guarantee."""
        with self._lock, self.segment.locked():
            row, seg = self._row(name), self.segment
            pages = limit_to_pages(
                name, limit, self.page_size, seg.get(row, "pages_per_kv_page"),
                seg.get(row, "guarantee_pages"), self.budget_pages,
            )  # fmt: skip
            seg.set(row, "limit_pages", -1 if pages is None else pages)
            return self._result(name)

    def set_guarantee(self, name: str, guarantee: int | str) -> MemoryLimit:
        """Rounded up to whole KV pages; ValueError above the tenant's limit or when the
        group's guarantees together exceed its budget."""
        with self._lock, self.segment.locked():
            row, seg = self._row(name), self.segment
            pages = guarantee_to_pages(
                name, guarantee, self.page_size, seg.get(row, "pages_per_kv_page"),
                self._limit(row), self._guaranteed_to_others(row), self.budget_pages,
                f"group {self.group!r}'s budget",
            )  # fmt: skip
            seg.set(row, "guarantee_pages", pages)
            return self._result(name)

    def limit_of(self, name: str) -> MemoryLimit:
        with self._lock, self.segment.locked():
            return self._result(name)

    def records(self) -> list[TenantRecord]:
        """Every tenant of the group, by name (this process's with fresh usage)."""
        with self._lock, self.segment.locked():
            return read_records(self.segment, self._mapped)

    # -- the status and request words (a channel: serve/ gives them their meaning) ---------
    def publish_status(self, name: str, status: int) -> None:
        """This process's tenant ``name`` publishes ``status`` (for ``ctl`` and the other
        processes)."""
        own = self._own.get(name)
        if own is not None and not self._closed:
            self.segment.set(own.row, "status", int(status))

    def post_request(self, name: str, request: int) -> None:
        """Posts ``request`` (> 0) to tenant ``name`` of any process; it stays until its
        owner clears it. KeyError: no such tenant."""
        if isinstance(request, bool) or not isinstance(request, int) or request <= 0:
            raise ValueError(f"a request is a positive int, got {request!r}")
        with self._lock, self.segment.locked():
            self.segment.set(self._row(name), "request", request)

    def request_of(self, name: str) -> int:
        """The request posted to this process's tenant ``name`` (0: none)."""
        own = self._own.get(name)
        if own is None or self._closed:
            return 0
        return self.segment.get(own.row, "request")

    def clear_request(self, name: str) -> None:
        """This process's tenant ``name`` took (or refused) its request."""
        own = self._own.get(name)
        if own is not None and not self._closed:
            self.segment.set(own.row, "request", 0)

    def sweep(self) -> list[str]:
        """Frees the rows of dead processes now; returns their tenants' names."""
        with self._lock, self.segment.locked():
            return self.segment.sweep()

    # -- reclaim ---------------------------------------------------------------------------
    def set_reclaimer(self, name: str, reclaim: Reclaimer | None) -> None:
        """``None`` for a tenant already gone (its pool closed first) is a no-op."""
        with self._lock:
            own = self._own.get(name)
            if own is None:
                if reclaim is None:
                    return
                raise KeyError(f"no KV cache named {name!r} in this process")
            own.reclaimer = reclaim

    def reclaim(self, name: str, pages: int) -> int:
        """Asks this process's other tenants, then other processes' tenants above their
        guarantee, for up to ``pages`` pages; waits up to ``wait_s`` for the latter.
        Returns the pages ``name``'s room grew by."""
        with self._lock, self.segment.locked():
            before = self._room(name)
            local = [
                (o.usage() - self.segment.get(o.row, "guarantee_pages"), n, o.reclaimer)
                for n, o in self._own.items()
                if n != name
            ]
        freed = reclaim_in_order(local, pages)
        if freed >= pages:
            return freed
        asked = self._ask(pages - freed)
        if not asked:
            return max(freed, self.room_pages(name) - before)
        deadline = time.monotonic() + self.wait_s
        while time.monotonic() < deadline:
            self._serve_all()  # a peer may be waiting on us too
            if self.room_pages(name) - before >= pages:
                break
            if all(self.segment.get(i, "request_pages") == 0 for i in asked):
                break
            time.sleep(0.002)
        return max(0, self.room_pages(name) - before)

    def _ask(self, pages: int) -> list[int]:
        """Sets requests on other pools' tenants (other processes, as a rule), those
        furthest above their guarantee first (mapped + their pool's reserve); returns the
        rows asked."""
        with self._lock, self.segment.locked():
            seg = self.segment
            seg.sweep()
            rows = []
            for i in seg.used_rows():
                if seg.get(i, "member") == self._member:
                    continue
                reserved = seg.get(i, "reserved_pages")
                above = seg.get(i, "mapped_pages") + reserved - seg.get(i, "guarantee_pages")
                idle = seg.get(i, "idle_pages")
                if idle >= 0:  # its engine said what it could give: ask no more
                    above = min(above, idle + reserved)
                if above > 0:
                    rows.append((above, i))
            asked, left = [], pages
            for above, i in sorted(rows, reverse=True):
                if left <= 0:
                    break
                ask = min(left, above)
                seg.set(i, "request_pages", max(seg.get(i, "request_pages"), ask))
                asked.append(i)
                left -= ask
            return asked

    def poll(
        self, name: str, hit_tokens: int = 0, query_tokens: int = 0, idle_pages: int = -1
    ) -> None:
        """Called by ``name``'s engine at each step: publishes its prefix-cache counters
        and the pages it could give back now (others ask it for no more), and honours
        what the group asked of it (memory back, a limit below its use). Cheap when there
        is nothing to do: a few shared-memory reads and writes."""
        own = self._own.get(name)
        if own is None or self._closed:
            return
        seg = self.segment
        seg.set(own.row, "hit_tokens", hit_tokens)
        seg.set(own.row, "query_tokens", query_tokens)
        seg.set(own.row, "idle_pages", idle_pages)
        if seg.get(own.row, "request_pages") > 0 or self.over_limit_pages(name) > 0:
            self._serve(name, own, busy_ok=False)

    def _serve(self, name: str, own: _Own, *, busy_ok: bool) -> None:
        """Gives back what is asked of ``name``: idle cached prefixes through its
        reclaimer, then this process's reserve. ``busy_ok``: the reclaimer may have
        declined because its engine is stepping; the request then stays for its step."""
        seg = self.segment
        asked = seg.get(own.row, "request_pages")
        want = max(asked, self.over_limit_pages(name))
        held = self._physical()
        freed = own.reclaimer(want) if own.reclaimer is not None else 0
        if asked and self._trim is not None:
            self._trim()  # unmapped pages went to the reserve: give them back for real
        given = max(0, held - self._physical())
        with self._lock, seg.locked():
            if self._closed or self._own.get(name) is not own:
                return
            self._publish()
            if asked and (freed or given or not busy_ok):
                seg.set(own.row, "request_pages", 0)
                seg.set(own.row, "given_pages", seg.get(own.row, "given_pages") + given)

    def _physical(self) -> int:
        """Pages this pool holds: its tenants' mapped pages and its reserve."""
        return sum(o.usage() for o in list(self._own.values())) + self._reserved()

    def _serve_all(self) -> None:
        for name, own in list(self._own.items()):
            if self.segment.get(own.row, "request_pages") > 0 or self.over_limit_pages(name):
                self._serve(name, own, busy_ok=True)

    def _watch_loop(self) -> None:
        next_sweep = 0.0
        while not self._stop.wait(WATCH_S):
            try:
                with self._lock:
                    if self._closed:
                        return
                self._serve_all()
                now = time.monotonic()
                if now >= next_sweep:
                    next_sweep = now + SWEEP_S
                    with self._lock, self.segment.locked():
                        if self.segment.sweep():
                            log.info("group %r: swept the rows of dead processes", self.group)
                        self._publish()
            except Exception:  # never let the watcher die silently
                log.exception("group %r: the watcher failed a round", self.group)

    # -- life ------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise KVCacheError("the pool is closed")

    def close(self) -> None:
        """Leaves the group: this process's rows go. The segment stays for the group's
        next members (a process without a row may still be using it)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._stop.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=5)
        with self._lock:
            with self.segment.locked():
                for own in self._own.values():
                    self.segment.drop_row(own.row)
                self._own.clear()
            self.segment.close()
