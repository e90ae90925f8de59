"""The sleep mailbox of a process group: what the two words of a tenant's row mean.

The memory layer carries a *status* word each tenant publishes and a *request* word other
processes post to it (:mod:`jax_kvcached.memory.group_channel`). For the serving layer
the status is the model's sleep level (0 awake, 1 or 2 asleep) and a request is a sleep
at level 1 or 2 or a wake (:data:`WAKE`), posted by ``jax-kvcached ctl sleep`` / ``ctl
wake`` and cleared by the model's server once carried out or refused.
"""

from __future__ import annotations

from typing import Any

from jax_kvcached.memory.tenant_record import TenantRecord

WAKE = 3  # a request: wake (1 and 2: sleep at that level)


def sleep_request(level: int | None) -> int:
    """The request word of a sleep at ``level`` (1 or 2), or of a wake (None)."""
    if level is None:
        return WAKE
    if level not in (1, 2):
        raise ValueError(f"a sleep level is 1 or 2, got {level!r}")
    return level


def state(r: TenantRecord) -> str:
    """A tenant's sleep state as ``ctl list`` shows it (``*``: a change asked, not yet
    done)."""
    text = f"asleep{r.status}" if r.status else "awake"
    return text + ("*" if r.request else "")


def record_fields(r: TenantRecord) -> dict[str, Any]:
    """A group record for ``/admin/memory``: its words as ``sleep_level`` and
    ``sleep_request``."""
    out = {k: v for k, v in r.__dict__.items() if k not in ("status", "request")}
    out.update(sleep_level=r.status, sleep_request=r.request)
    return out
