"""Continuous-batching scheduler: queue policy only.

Waiting / running queues, admission order, the prefill-or-decode choice, chunking within
the compiled prefill shapes, and whom to preempt when the KV manager has no memory
(the newest running sequence; it is recomputed when readmitted). Every question about
blocks goes to the :class:`~jax_kvcached.engine.kv_manager.KVManager`.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable

from jax_kvcached.engine.kv_manager import KVManager
from jax_kvcached.engine.runner import StepInput
from jax_kvcached.engine.sequence import Sequence
from jax_kvcached.memory.errors import PoolExhausted


@dataclasses.dataclass
class SchedulerOutput:
    """One step's plan: the sequences that run (in row order) with their inputs, and the
    requests rejected while planning it (they can never fit; each with its error)."""

    sequences: list[Sequence]
    inputs: list[StepInput]
    prefill: bool = False
    rejected: list[Sequence] = dataclasses.field(default_factory=list)


class Scheduler:
    def __init__(
        self,
        kv: KVManager,
        max_batch: int,
        prefill_chunk: int,
        max_model_len: int,
        prefill_fits: Callable[[int, int], bool] | None = None,
    ) -> None:
        self.kv = kv
        # Whether a prefill step of (sequences, longest chunk) has a compiled shape.
        self.prefill_fits = prefill_fits or (lambda rows, tokens: True)
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
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

    def _step_len(self, seq: Sequence, prefill: bool) -> int:
        """New tokens seq feeds this step: a prefill chunk, or its one decode token."""
        return min(seq.num_tokens - seq.num_computed, self.prefill_chunk) if prefill else 1

    def _done_when_pending_arrives(self, seq: Sequence) -> bool:
        """Its pending token ends it by length: nothing more to compute for it."""
        return seq.num_pending > 0 and (
            seq.num_output >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len
        )

    def schedule(self) -> SchedulerOutput:
        """The next step: a prefill batch if any running sequence needs one, else decode.

        A decode input whose token is still being sampled names the row of the step that
        samples it (``StepInput.src``): the device feeds it, the host does not wait for it.
        """
        rejected: list[Sequence] = []
        self.shrink_to_limit()
        self._admit(rejected)
        prefill = [s for s in self.running if s.num_computed < s.num_tokens - 1]
        group = prefill if prefill else list(self.running)
        seqs: list[Sequence] = []
        longest = 0
        for seq in group:
            if seq not in self.running or self._done_when_pending_arrives(seq):
                continue  # (preempted while growing an earlier one)
            n = self._step_len(seq, bool(prefill))
            if prefill:
                if seqs and not self.prefill_fits(len(seqs) + 1, max(longest, n)):
                    break  # the prefill token budget is full: the rest go next step
                longest = max(longest, n)
            if not self._grow(seq, seq.num_computed + n):
                continue
            seqs.append(seq)
        # Growing a later sequence may have preempted an earlier one.
        seqs = [s for s in seqs if s in self.running]
        inputs: list[StepInput] = []
        for seq in seqs:
            n = self._step_len(seq, bool(prefill))
            start = seq.num_computed
            known = len(seq.token_ids)
            if start + n <= known:
                inputs.append(StepInput(seq.token_ids[start : start + n], start, list(seq.blocks)))
            else:  # a decode step on the token the in-flight step samples
                assert n == 1 and start == known and seq.last_row >= 0, "one token in flight"
                inputs.append(StepInput([0], start, list(seq.blocks), src=seq.last_row))
        return SchedulerOutput(seqs, inputs, bool(prefill), rejected)
