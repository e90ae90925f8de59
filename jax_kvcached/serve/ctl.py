"""``jax-kvcached ctl``: a process group's tenants, live (like kvcached's ``kvctl``).

``list`` shows every tenant of the group (pid, mapped, reserved, limit, guarantee, hit
rate, awake or asleep); ``limit NAME SIZE`` / ``guarantee NAME SIZE`` change a running
process's tenant (it shrinks to a lower limit at its next steps); ``sleep NAME`` /
``wake NAME`` ask its server to put it to sleep or wake it (and wait until it has);
``watch`` repeats ``list``; ``cleanup`` removes the segments of groups (the named one, or
every one) that no live process uses.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from jax_kvcached.memory.config import ipc_name_from_env
from jax_kvcached.memory.shared_ledger import SharedLedger
from jax_kvcached.memory.shm_segment import groups, remove_if_unused
from jax_kvcached.memory.tenant_record import TenantRecord
from jax_kvcached.serve.sleep_mailbox import sleep_request, state

MiB = 1 << 20


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def table(ledger: SharedLedger, records: list[TenantRecord]) -> str:
    """The group's summary line and one row per tenant."""
    ps = ledger.page_size
    mapped = sum(r.mapped_pages for r in records)
    reserves = {r.member: r.reserved_pages for r in records}  # one reserve per pool
    reserved = sum(reserves.values())
    budget = ledger.budget_pages
    lines = [
        f"group {ledger.group}: budget {fmt_bytes(budget * ps)}, mapped {fmt_bytes(mapped * ps)}"
        f", reserved {fmt_bytes(reserved * ps)}, free "
        f"{fmt_bytes((budget - mapped - reserved) * ps)}, {len(records)} tenants",
        f"{'NAME':<16} {'PID':>7} {'MAPPED':>10} {'RESERVED':>10} {'LIMIT':>10} "
        f"{'GUARANTEE':>10} {'HIT%':>5} {'GIVEN':>10} {'STATE':>7}",
    ]
    for r in records:
        hit = "-" if r.hit_rate is None else f"{100 * r.hit_rate:.0f}"
        limit = None if r.limit_pages is None else r.limit_pages * ps
        lines.append(
            f"{r.name[:16]:<16} {r.pid:>7} {fmt_bytes(r.mapped_pages * ps):>10} "
            f"{fmt_bytes(r.reserved_pages * ps):>10} {fmt_bytes(limit):>10} "
            f"{fmt_bytes(r.guarantee_pages * ps):>10} {hit:>5} {fmt_bytes(r.given_pages * ps):>10}"
            f" {state(r):>7}"
        )
    return "\n".join(lines)


def _sleep_or_wake(
    ledger: SharedLedger, name: str, level: int | None, timeout: float, out: TextIO
) -> int:
    """Asks ``name``'s server to sleep (at ``level``) or wake (None), then waits up to
    ``timeout`` seconds for its state to change."""
    ledger.post_request(name, sleep_request(level))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = next((r for r in ledger.records() if r.name == name), None)
        if r is None:
            raise KeyError(f"tenant {name!r} left the group")
        if not r.request:  # carried out, or refused (see its server's log)
            if bool(r.status) == (level is not None):
                print(f"{name}: {state(r)}", file=out)
                return 0
            break
        time.sleep(0.05)
    r = next((r for r in ledger.records() if r.name == name), None)
    now = state(r) if r else "gone"
    print(f"{name}: still {now} after {timeout:g} s (its server may be busy)", file=out)
    return 1


def _group(group: str | None) -> str:
    group = group or ipc_name_from_env()
    if group is None:
        have = groups()
        raise ValueError(
            "give --group NAME or set KVCACHED_IPC_NAME"
            + (f"; groups on this machine: {', '.join(have)}" if have else "; no group exists")
        )
    return group


def run_ctl(
    action: str,
    group: str | None,
    name: str | None = None,
    size: str | None = None,
    *,
    interval: float = 1.0,
    count: int | None = None,
    out: TextIO | None = None,
    level: int = 1,
    timeout: float = 60.0,
) -> int:
    """Runs one ``ctl`` action; ValueError / KeyError for bad groups, names and sizes."""
    out = out or sys.stdout  # (read now: a default bound at import would go stale)
    if action == "cleanup":
        return cleanup(group, out)
    ledger = SharedLedger.attach(_group(group))
    try:
        if action == "list":
            print(table(ledger, ledger.records()), file=out)
        elif action in ("limit", "guarantee"):
            assert name is not None and size is not None
            if action == "limit":
                value = None if size.lower() in ("none", "unlimited") else size
                res = ledger.set_limit(name, value)
                what = f"limit of {name!r}: {fmt_bytes(res.limit_bytes) if value else 'none'}"
                if res.over_limit_bytes:
                    what += (
                        f" ({fmt_bytes(res.over_limit_bytes)} above it: given back at its "
                        "next steps)"
                    )
            else:
                res = ledger.set_guarantee(name, size)
                what = f"guarantee of {name!r}: {fmt_bytes(res.guarantee_bytes)}"
                if res.guarantee_shortfall_bytes:
                    what += f" ({fmt_bytes(res.guarantee_shortfall_bytes)} held by others now)"
            print(f"{what}; mapped {fmt_bytes(res.mapped_bytes)}", file=out)
        elif action in ("sleep", "wake"):
            assert name is not None
            return _sleep_or_wake(ledger, name, level if action == "sleep" else None, timeout, out)
        elif action == "watch":
            n = 0
            while count is None or n < count:
                if n:
                    time.sleep(interval)
                frame = table(ledger, ledger.records())
                print(("\x1b[H\x1b[2J" if out.isatty() else "") + frame, file=out, flush=True)
                n += 1
        else:
            raise ValueError(f"unknown ctl action {action!r}")
    finally:
        ledger.close()
    return 0


def cleanup(group: str | None, out: TextIO | None = None) -> int:
    """Removes the shared-memory segment of ``group`` (None: every group on this machine)
    when no live process has a tenant in it; keeps and names the others."""
    out = out or sys.stdout
    names = [group] if group else (groups() if ipc_name_from_env() is None else [_group(None)])
    if not names:
        print("no group on this machine", file=out)
    for g in names:
        live = remove_if_unused(g)
        if live:
            print(f"kept group {g}: {live} live tenants", file=out)
        else:
            print(f"removed group {g} (no live tenant)", file=out)
    return 0
