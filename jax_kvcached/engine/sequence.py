"""Sequence: one request's state, shared by the scheduler, the KV manager and the engine."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from jax_kvcached.engine.detokenizer import TextStream
from jax_kvcached.engine.sampling import SamplingParams
from jax_kvcached.engine.structured import GrammarState
from jax_kvcached.engine.thinking import ThinkingGrammar


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
    # Block tables, one per KV cache group (one group: ``blocks``); a sliding-window
    # group's blocks below the window are the null block 0.
    tables: list[list[int]] = dataclasses.field(default_factory=lambda: [[]])
    num_computed: int = 0  # tokens whose K/V is in the cache
    finish_reason: str | None = None
    arrival: float = dataclasses.field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    preemptions: int = 0
    extra: bytes = b""  # prefix-cache extra keys (tenant, cache_salt, adapter)
    # Chained hashes of full blocks of known tokens, computed once (kept across
    # preemption); per group, the first ``inserted[g]`` of its table were offered to the
    # prefix cache.
    hashes: list[bytes] = dataclasses.field(default_factory=list)
    inserted: list[int] = dataclasses.field(default_factory=lambda: [0])
    cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    # A recurrent group's state (engine.recurrent): the checkpoint blocks its first step
    # reads (a prefix hit; empty: its own slot, or zeros from position 0), and the
    # checkpoint its next step writes: (blocks, position) or None.
    state_src: list[int] = dataclasses.field(default_factory=list)
    state_ck: tuple[list[int], int] | None = None
    last_row: int = -1  # row of the newest dispatched step that samples for it
    error: Exception | None = None  # why it was rejected (finish_reason "error")
    # Per generated token: its log-probability and the top alternatives [(id, logprob)]
    # (a list when params.logprobs asks for them, else None); per prompt position the same
    # for the prompt's token (None for the first; a list when params.prompt_logprobs).
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]] | None] | None = None
    forked_from: int | None = None  # the request whose prompt blocks it shares
    # Called with (request_id, (logprob, top alternatives)) before on_token, per token.
    on_logprobs: Callable[[int, tuple[float, list[tuple[int, float]]]], None] | None = None
    # The output's text, matched against params.stop as tokens arrive (None: no stop
    # strings).
    detok: TextStream | None = None
    # The matcher of a structured output (params.structured): the next token's mask, and
    # each sampled token (engine.structured).
    grammar: GrammarState | ThinkingGrammar | None = None
    adapter_slot: int = 0  # its LoRA adapter's slot in the runner's stacks (0: none)
    lora: tuple[int, str] | None = None  # its adapter's (id, name), as KV events carry it

    def __post_init__(self) -> None:
        self.token_ids = list(self.token_ids)
        if self.num_prompt < 0:
            self.num_prompt = len(self.token_ids)
        if self.params.logprobs is not None:
            self.logprobs = []
        if self.params.prompt_logprobs:
            self.prompt_logprobs = [None] * self.num_prompt

    @property
    def blocks(self) -> list[int]:
        """The block table of the first KV cache group (the only one, usually)."""
        return self.tables[0]

    @blocks.setter
    def blocks(self, value: list[int]) -> None:
        self.tables[0] = value

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
