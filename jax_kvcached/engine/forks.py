"""Forks: ``n`` samples of one prompt computed once.

A request added with ``fork_of`` (an active request with the same prompt and cache keys
whose prompt is not computed yet) waits here for its parent. Once the step that computes
the parent's prompt is dispatched, each fork takes the parent's prompt blocks in every
KV cache group (:meth:`KVManager.fork`: shared full blocks, a copy of the partial one,
ordered after that step) and runs; without room in the batch or memory it is admitted
on its own, as is every fork of a parent that is aborted or rejected.
"""

from __future__ import annotations

from collections.abc import Callable

from jax_kvcached.engine.kv_manager import KVManager
from jax_kvcached.engine.scheduler import Scheduler
from jax_kvcached.engine.sequence import Sequence


class Forks:
    """The forks of one engine waiting for their parents.

    Args:
      kv: the engine's KV manager (shares and copies the blocks).
      scheduler: where forks run (or wait, admitted on their own).
      copy_block: ``(src, dst, group)``: copies a block on the device after every step
        dispatched so far; returns the fence that orders later frees after the copy.
    """

    def __init__(
        self,
        kv: KVManager,
        scheduler: Scheduler,
        copy_block: Callable[[int, int, int], object],
    ) -> None:
        self._kv = kv
        self._scheduler = scheduler
        self._copy_block = copy_block
        self._waiting: dict[int, list[Sequence]] = {}  # parent id -> its forks
        self.forks = 0  # children that took their parent's prompt blocks
        self.fallbacks = 0  # children admitted on their own (batch or memory full)

    def wait(self, parent: Sequence | None, seq: Sequence) -> bool:
        """Queues ``seq`` behind ``parent`` when it can fork it (the same prompt and keys,
        prompt not computed yet, not finished); False: it cannot."""
        if (
            parent is None
            or parent.finish_reason is not None
            or parent.num_computed >= parent.num_prompt
            or parent.prompt != seq.prompt
            or parent.extra != seq.extra
        ):
            return False
        self._waiting.setdefault(parent.request_id, []).append(seq)
        return True

    def waits_for(self, parent_id: int) -> bool:
        """Whether forks wait for request ``parent_id``."""
        return parent_id in self._waiting

    def abort(self, seq: Sequence) -> bool:
        """Drops ``seq`` if it is a fork still waiting for its parent."""
        for kids in self._waiting.values():
            if seq in kids:
                kids.remove(seq)
                seq.finish_reason = "abort"
                return True
        return False

    def orphan(self, parent_id: int) -> None:
        """The forks waiting for a parent that will not compute its prompt (aborted or
        rejected) are admitted on their own."""
        for kid in self._waiting.pop(parent_id, []):
            self._scheduler.add(kid)
            self.fallbacks += 1

    def take(self, parent: Sequence, max_batch: int) -> None:
        """The parent's prompt is computed (by the step just dispatched): its forks share
        its blocks and copy the partial one, ordered after that step."""
        for kid in self._waiting.pop(parent.request_id, []):
            copies = None
            if len(self._scheduler.running) < max_batch:
                copies = self._kv.fork(parent, kid)
            if copies is None:  # no room in the batch or memory: on its own, later
                self._scheduler.add(kid)
                self.fallbacks += 1
                continue
            fence = None
            for group, src, dst in copies:
                fence = self._copy_block(src, dst, group)
            if fence is not None:
                self._kv.set_fence(fence)
            self._scheduler.add_running(kid)
            self.forks += 1
