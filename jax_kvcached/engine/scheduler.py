"""Continuous-batching scheduler: queue policy only.

Waiting / running queues, admission order, each step's token budget (vLLM v1's chunked
prefill: every running decode first, one token each, then chunks of the prompts still
being prefilled, so a long prompt never stalls the running streams), and whom to preempt
when the KV manager has no memory (the newest running sequence; it is recomputed when
readmitted). Every question about
blocks goes to the :class:`~jax_kvcached.engine.kv_manager.KVManager`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from jax_kvcached.engine.kv_manager import KVManager
from jax_kvcached.engine.sched_output import Scheduled, SchedulerOutput
from jax_kvcached.engine.sequence import Sequence
from jax_kvcached.memory.errors import PoolExhausted


class Scheduler:
    def __init__(
        self,
        kv: KVManager,
        max_batch: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        max_prefill_tokens: int | None = None,
        decode_budget: Callable[[int], int] | None = None,
    ) -> None:
        # (the budgets come resolved and checked: EngineConfig, then StepShapes' defaults)
        self.kv = kv
        self.max_batch = max_batch
        self.max_num_batched_tokens = max_num_batched_tokens
        # A step with no decode row keeps no stream waiting: it may take bigger chunks.
        self.max_prefill_tokens = max(max_prefill_tokens or 0, max_num_batched_tokens)
        # Tokens of a step with that many decode rows (within max_num_batched_tokens).
        self.decode_budget = decode_budget
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> bool:
        """Runs a sequence that already holds its blocks (a fork); False when the batch
        is full."""
        if len(self.running) >= self.max_batch:
            return False
        self.running.append(seq)
        return True

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _admit(self, rejected: list[Sequence]) -> None:
        while self.waiting and len(self.running) < self.max_batch:
            seq = self.waiting[0]
            if seq.num_pending:  # preempted while a step sampled for it: wait for it
                return
            try:
                cached = self.kv.admit(seq)
            except PoolExhausted as e:
                # It can never fit: drop it so the requests behind it still run.
                self.waiting.popleft()
                seq.finish_reason, seq.error = "error", e
                rejected.append(seq)
                continue
            if cached is None:  # memory is busy: admit in order, later
                return
            self.waiting.popleft()
            self.running.append(seq)

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Gives seq blocks for num_tokens, preempting later sequences if needed."""
        while not self.kv.grow(seq, num_tokens):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def preempt(self, seq: Sequence) -> None:
        """Frees seq's blocks; it is recomputed from its tokens when readmitted."""
        self.running.remove(seq)
        self.kv.release(seq)
        seq.num_computed = 0
        seq.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def shrink_to_limit(self) -> None:
        """Gives back what is mapped above the cache's memory limit: idle cached prefixes
        first (the KV manager), then the newest running sequences (preempted)."""
        while not self.kv.shrink_to_limit() and self.running:
            self.preempt(self.running[-1])

    def abort(self, seq: Sequence) -> bool:
        """Drops a waiting or running sequence (its blocks are released)."""
        if seq in self.running:
            self.finish(seq, "abort")
            return True
        if seq in self.waiting:
            self.waiting.remove(seq)
            seq.finish_reason = "abort"
            return True
        return False

    def finish(self, seq: Sequence, reason: str) -> None:
        """Ends a running sequence, or one preempted while a step sampled for it."""
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
            self.kv.release(seq)
        else:
            self.waiting.remove(seq)

    def _done_when_pending_arrives(self, seq: Sequence) -> bool:
        """Its pending token ends it by length: nothing more to compute for it."""
        return seq.num_pending > 0 and (
            seq.num_output >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len
        )

    @staticmethod
    def prefilling(seq: Sequence) -> bool:
        """More than its last known token is still to be computed (a prompt, or a
        sequence recomputed after preemption)."""
        return seq.num_computed < seq.num_tokens - 1

    def schedule(self) -> SchedulerOutput:
        """The next step, within ``max_num_batched_tokens``: every running decode (one
        token each), then chunks of the sequences still prefilling, fewest tokens left
        first. A
        step without decode rows takes up to ``max_prefill_tokens``; with ``decode_budget``
        a step with D decode rows takes at most ``decode_budget(D)``.

        A decode row whose token is still being sampled reaches past the host's tokens
        (:attr:`Scheduled.fed_by_device`): the device feeds it, the host does not wait.
        """
        rejected: list[Sequence] = []
        self.shrink_to_limit()
        self._admit(rejected)
        decodes = [s for s in self.running if not self.prefilling(s)]
        # Prompts with the fewest tokens left go first (stable: arrival order among
        # equals): a short request is not held behind a long prompt's many chunks, and the
        # long one still takes what they leave of the step.
        prefills = sorted((s for s in self.running if self.prefilling(s)),
                          key=lambda s: s.num_tokens - s.num_computed)  # fmt: skip
        budget = self.max_num_batched_tokens if decodes else self.max_prefill_tokens
        if decodes and self.decode_budget is not None:
            budget = max(len(decodes), min(budget, self.decode_budget(len(decodes))))
        plan: list[tuple[Sequence, int]] = []
        for seq in decodes + prefills:
            if budget <= 0:
                break
            if seq not in self.running or self._done_when_pending_arrives(seq):
                continue  # (preempted while growing an earlier one)
            n = min(seq.num_tokens - seq.num_computed, budget) if self.prefilling(seq) else 1
            if not self._grow(seq, seq.num_computed + n):
                continue
            plan.append((seq, n))
            budget -= n
        # Growing a later sequence may have preempted an earlier one.
        plan = [(s, n) for s, n in plan if s in self.running]
        return SchedulerOutput([Scheduled(s, s.num_computed, n) for s, n in plan], rejected,
                               sum(not self.prefilling(s) for s, _ in plan))  # fmt: skip
