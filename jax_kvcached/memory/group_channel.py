"""GroupChannel: how a pool's tenants talk to the other processes of a process group.

Each tenant has two words in the group's shared memory: a *status* it publishes and a
*request* other processes post to it (until it clears it). The memory layer carries them
and gives them no meaning (the serving layer's sleep mailbox does:
``serve/sleep_mailbox.py``). A pool alone has a :class:`GroupChannel` that publishes
nothing and receives nothing; a pool of a group has a :class:`SharedGroupChannel`.
"""

from __future__ import annotations

from jax_kvcached.memory.shared_ledger import SharedLedger
from jax_kvcached.memory.tenant_record import TenantRecord


class GroupChannel:
    """A pool alone: nobody to talk to."""

    group: str | None = None

    def publish(self, name: str, status: int) -> None:
        """Tenant ``name`` publishes ``status`` (alone: no one reads it)."""

    def request(self, name: str) -> int:
        """The request posted to tenant ``name`` (0: none)."""
        return 0

    def clear(self, name: str) -> None:
        """Tenant ``name`` took (or refused) its request."""

    def records(self) -> list[TenantRecord] | None:
        """Every tenant of the group, all its processes (None: not in a group)."""
        return None


class SharedGroupChannel(GroupChannel):
    """A pool of a process group: the words live in the group's shared ledger."""

    def __init__(self, ledger: SharedLedger) -> None:
        self._ledger = ledger
        self.group = ledger.group

    def publish(self, name: str, status: int) -> None:
        self._ledger.publish_status(name, status)

    def request(self, name: str) -> int:
        return self._ledger.request_of(name)

    def clear(self, name: str) -> None:
        self._ledger.clear_request(name)

    def records(self) -> list[TenantRecord] | None:
        return self._ledger.records()
