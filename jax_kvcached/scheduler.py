"""Continuous-batching scheduler: waiting / running queues, admission by free blocks,
preemption by recompute when the pool is exhausted."""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable

from jax_kvcached.errors import PoolExhausted
from jax_kvcached.kv_cache import KVCache
from jax_kvcached.prefix_cache import PrefixCache, hash_blocks
from jax_kvcached.runner import StepInput
from jax_kvcached.sampling import SamplingParams


@dataclasses.dataclass(eq=False)  # identity: queues hold and remove these objects
class Sequence:
    """A request's state. ``token_ids`` is the one token list (prompt, then the sampled
    tokens the host has received); ``num_pending`` more tokens are sampled by dispatched
    steps whose results have not arrived yet."""

    request_id: int
    token_ids: list[int]
    params: SamplingParams
    on_token: Callable[[int, int, bool], None] | None = None
    num_prompt: int = -1  # set from token_ids
    num_pending: int = 0
    blocks: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V is in the cache
    finish_reason: str | None = None
    arrival: float = dataclasses.field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    preemptions: int = 0
    extra: bytes = b""  # prefix-cache extra keys (tenant, cache_salt, adapter)
    # Chained hashes of full blocks of known tokens, computed once (kept across
    # preemption); the first ``num_inserted`` of ``blocks`` are in the prefix cache.
    hashes: list[bytes] = dataclasses.field(default_factory=list)
    num_inserted: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    last_row: int = -1  # row of the newest dispatched step that samples for it

    def __post_init__(self) -> None:
        self.token_ids = list(self.token_ids)
        if self.num_prompt < 0:
            self.num_prompt = len(self.token_ids)

    @property
    def prompt(self) -> list[int]:
        return self.token_ids[: self.num_prompt]

    @property
    def output(self) -> list[int]:
        return self.token_ids[self.num_prompt :]

    @property
    def num_output(self) -> int:
        """Sampled tokens, received or pending."""
        return len(self.token_ids) - self.num_prompt + self.num_pending

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival

    def block_hashes(self, num_blocks: int, block_size: int) -> list[bytes]:
        """Hashes of the first ``num_blocks`` full blocks (extends the cached chain)."""
        have = len(self.hashes)
        if have < num_blocks:
            new = self.token_ids[have * block_size : num_blocks * block_size]
            parent = self.hashes[-1] if self.hashes else None
            self.hashes += hash_blocks(new, block_size, self.extra, parent)
        return self.hashes[:num_blocks]


class Scheduler:
    def __init__(
        self,
        cache: KVCache,
        max_batch: int,
        prefill_chunk: int,
        max_model_len: int,
        prefix: PrefixCache | None = None,
        prefill_fits: Callable[[int, int], bool] | None = None,
    ) -> None:
        self.cache = cache
        # Whether a prefill step of (sequences, longest chunk) has a compiled shape.
        self.prefill_fits = prefill_fits or (lambda rows, tokens: True)
        self.prefix = prefix
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.cache.block_size)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def _caching(self) -> bool:
        """Whether prompts are hashed and matched (a cache with bound 0 reuses nothing)."""
        return self.prefix is not None and self.prefix.enabled

    def _available_blocks(self) -> int:
        idle = self.prefix.num_evictable_blocks if self.prefix else 0
        return self.cache.num_free_blocks + idle

    def _pages_for_blocks(self, n: int) -> int:
        """Physical pages that hold n more blocks (whole KV pages)."""
        kv_pages = -(-n // self.cache.min_blocks_per_page)
        return kv_pages * self.cache.pages_per_kv_page

    def _admit(self) -> None:
        bs = self.cache.block_size
        while self.waiting and len(self.running) < self.max_batch:
            seq = self.waiting[0]
            if seq.num_pending:  # preempted while a step sampled for it: wait for it
                return
            hashes: list[bytes] = []
            if self._caching:
                # The last token is always recomputed: it yields the next token's logits.
                hashes = seq.block_hashes((seq.num_tokens - 1) // bs, bs)
            hit = self.prefix.lookup(hashes) if self._caching else 0
            need = self.blocks_for(min(seq.num_tokens + 1, self.max_model_len)) - hit
            available = self._available_blocks() - hit
            if need > available:
                capacity = self.cache.capacity_blocks
                if need + hit > capacity:
                    # It can never fit: drop it so the requests behind it still run.
                    self.waiting.popleft()
                    seq.finish_reason = "error"
                    err = PoolExhausted(
                        f"request {seq.request_id} needs {need + hit} KV blocks but "
                        f"{self.cache.name!r} can hold at most {capacity} under the pool's "
                        f"current budget and limits"
                    )
                    err.request_id = seq.request_id
                    raise err
                # Other tenants may hold idle cached prefixes; else wait for memory.
                if not self.cache.pool.reclaim(
                    self.cache, self._pages_for_blocks(need - available)
                ):
                    return
                continue
            self.waiting.popleft()
            if self._caching:
                seq.blocks = self.prefix.match(hashes)
                seq.num_inserted = len(seq.blocks)
                seq.num_computed = len(seq.blocks) * bs
                seq.cached_tokens = seq.num_computed
            self.running.append(seq)

    def _grow(self, seq: Sequence, num_tokens: int, after) -> bool:
        """Gives seq blocks for num_tokens, preempting later sequences if needed."""
        need = self.blocks_for(num_tokens) - len(seq.blocks)
        while need > 0:
            try:
                seq.blocks.extend(self.cache.alloc(need).tolist())
                return True
            except PoolExhausted:
                # Idle cached prefixes go first (page-aware), ours then other tenants',
                # then our running sequences.
                if self.prefix and self.prefix.evict(need, after=after) > 0:
                    continue
                if self.cache.pool.reclaim(self.cache, self._pages_for_blocks(need)) > 0:
                    continue
                victim = self.running[-1]
                self.preempt(victim, after)
                if victim is seq:
                    return False
        return True

    def preempt(self, seq: Sequence, after) -> None:
        """Frees seq's blocks; it is recomputed from its tokens when readmitted."""
        self.running.remove(seq)
        self._release(seq, after)
        seq.num_computed = 0
        seq.num_inserted = 0
        seq.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def shrink_to_limit(self, after) -> None:
        """Gives back what is mapped above the cache's memory limit: idle cached prefixes
        first, then the newest running sequences (preempted)."""
        while (over := self.cache.over_limit_pages) > 0:
            blocks = -(-over // self.cache.pages_per_kv_page) * self.cache.blocks_per_page
            if self.prefix and self.prefix.evict(blocks, after=after) > 0:
                continue
            if not self.running:
                return
            self.preempt(self.running[-1], after)

    def abort(self, seq: Sequence, after) -> bool:
        """Drops a waiting or running sequence (its blocks are released)."""
        if seq in self.running:
            self.finish(seq, "abort", after)
            return True
        if seq in self.waiting:
            self.waiting.remove(seq)
            seq.finish_reason = "abort"
            return True
        return False

    def finish(self, seq: Sequence, reason: str, after) -> None:
        """Ends a running sequence, or one preempted while a step sampled for it."""
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
            self._release(seq, after)
        else:
            self.waiting.remove(seq)

    def _release(self, seq: Sequence, after) -> None:
        if self.prefix:
            self.prefix.release(seq.blocks, after=after)
        else:
            self.cache.free(seq.blocks, after=after)
        seq.blocks = []

    def computed(self, seq: Sequence, num_computed: int) -> None:
        """Records a step's progress; full blocks of known tokens join the prefix cache
        (a block holding a still-pending token joins when it arrives: call again)."""
        seq.num_computed = num_computed
        if not self._caching:
            return  # block hashes are only needed to share blocks
        bs = self.cache.block_size
        full = min(num_computed, len(seq.token_ids)) // bs
        if seq.num_inserted >= full:
            return
        hashes = seq.block_hashes(full, bs)
        for i in range(seq.num_inserted, full):
            self.prefix.insert(hashes[i], seq.blocks[i])
        seq.num_inserted = full

    def _step_len(self, seq: Sequence, prefill: bool) -> int:
        """New tokens seq feeds this step: a prefill chunk, or its one decode token."""
        return min(seq.num_tokens - seq.num_computed, self.prefill_chunk) if prefill else 1

    def _done_when_pending_arrives(self, seq: Sequence) -> bool:
        """Its pending token ends it by length: nothing more to compute for it."""
        return seq.num_pending > 0 and (
            seq.num_output >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len
        )

    def schedule(self, after) -> tuple[list[Sequence], list[StepInput]]:
        """The next step: a prefill batch if any running sequence needs one, else decode.

        ``after``: arrays of the last step (blocks freed here wait for them). A decode
        input whose token is still being sampled names the row of the step that samples
        it (``StepInput.src``): the device feeds it, the host does not wait for it.
        """
        self.shrink_to_limit(after)
        self._admit()
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
            if not self._grow(seq, seq.num_computed + n, after):
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
        return seqs, inputs
