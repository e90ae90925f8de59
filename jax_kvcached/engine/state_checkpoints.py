"""The state checkpoints of a recurrent (slot) KV cache group, as the KV manager keeps
them (:class:`~jax_kvcached.engine.kv_manager.KVManager` inherits these methods).

A checkpoint is a copy of a sequence's state slot at a block boundary, cached under the
keys ``RecurrentStateManager.keys`` of the prefix's hash. Its life:

1. :meth:`StateCheckpoints._plan_checkpoint` (from ``grow``): a step that crosses a
   checkpoint position not cached yet gets blocks for it (best effort: none when memory
   is short); the step program writes the state there.
2. :meth:`StateCheckpoints._state_computed` (from ``computed``, once the step is
   dispatched): the checkpoint joins the prefix cache (idle; evicted, spilled and
   bounded like any cached block), and the checkpoint a hit's first step read goes back.
3. :meth:`StateCheckpoints._release_state` (from ``release``): a sequence that ends or
   is preempted lets go of both.

Invariant: a sequence holds at most one unwritten checkpoint and one checkpoint it reads;
every block of either is allocated until the step that uses it is fenced.
"""

from __future__ import annotations

import logging
from typing import Any

from jax_kvcached.engine.sequence import Sequence

log = logging.getLogger("jax_kvcached.engine.kv_manager")


class StateCheckpoints:
    """The checkpoint half of the KV manager (a mixin: it reads the manager's
    ``managers``, ``prefix_caches``, ``host_tier``, fence and allocation methods)."""

    managers: list[Any]
    pools: list[Any]
    prefix_caches: list[Any]
    host_tier: Any
    block_size: int
    state_restores: int
    state_recomputes: int
    events: Any

    def _resumed(self, seq: Sequence) -> None:
        """Counts and logs how a preempted sequence of a recurrent model resumes: from a
        state checkpoint, or recomputed from token 0 (its slot was not kept)."""
        restored = seq.num_computed > 0
        self.state_restores += restored
        self.state_recomputes += not restored
        log.info("request %s resumes after a preemption: %s", seq.request_id,
                 f"state restored at token {seq.num_computed}" if restored
                 else "recomputed from token 0")  # fmt: skip

    def _plan_checkpoint(self, seq: Sequence, num_tokens: int) -> None:
        """A slot group's checkpoint for the step up to ``num_tokens`` (see
        ``RecurrentStateManager.checkpoint_at``): blocks for it when the step crosses a
        checkpoint position not cached yet. Best effort: none when memory is short."""
        if not self.caching or seq.params.prompt_logprobs:
            return
        for mgr in self.managers:
            if not mgr.holds_slot:
                continue
            c = mgr.checkpoint_at(seq.num_prompt, seq.num_computed, num_tokens)
            if seq.state_ck is not None:
                if seq.state_ck[1] == c:
                    return  # (planned by an earlier try of this step)
                self.pools[mgr.index].free_blocks(seq.state_ck[0])
                seq.state_ck = None
            if not c:
                return
            h = self._hashes(seq, c // self.block_size)[-1]
            if self._has(mgr.index, mgr.keys(h)[0]):
                return  # cached already
            blocks = self._alloc(mgr.slot_blocks, mgr.index)
            if blocks is not None:
                seq.state_ck = (blocks, c)

    def _release_state(self, seq: Sequence, group: int) -> None:
        """Lets go of a sequence's checkpoint source and unwritten checkpoint."""
        if seq.state_src:
            self.pools[group].free_blocks(seq.state_src)
            seq.state_src = []
        if seq.state_ck is not None:
            self.pools[group].free_blocks(seq.state_ck[0])
            seq.state_ck = None

    def _state_computed(self, seq: Sequence, group: int) -> None:
        """After a step of ``seq`` was dispatched: the checkpoint it read goes back to
        the cache (idle; a free waits for the step), and the checkpoint it wrote joins
        the cache."""
        pc = self.prefix_caches[group] if self.prefix_caches else None
        if seq.state_src:
            self.pools[group].free_blocks(seq.state_src)
            seq.state_src = []
        if seq.state_ck is None or seq.state_ck[1] > seq.num_computed:
            return
        blocks, c = seq.state_ck
        seq.state_ck = None
        mgr = self.managers[group]
        h = self._hashes(seq, c // self.block_size)[-1]
        keys = mgr.keys(h)
        if not all(pc.block_of(k) is None for k in keys):
            self.pools[group].free_blocks(blocks)  # (another sequence cached it first)
            return
        for j, (k, b) in enumerate(zip(keys, blocks, strict=True)):
            if self.events is not None:  # (the state after prefix h: no tokens of its own)
                self.events.describe(group, k, keys[j - 1] if j else h, ())
            pc.insert(k, b, j)
            if self.host_tier is not None:
                self.host_tier.wrote(group, b, self._fence)
        self.pools[group].free_blocks(blocks)  # idle: the cache keeps them
