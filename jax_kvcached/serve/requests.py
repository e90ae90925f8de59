"""A served request as the loop holds it, and the last event it gets."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from jax_kvcached.engine.engine import Prompt
from jax_kvcached.engine.sampling import SamplingParams
from jax_kvcached.engine.sequence import Sequence


@dataclasses.dataclass(frozen=True)
class Finished:
    """The last event of a request."""

    finish_reason: str  # "stop", "length" or "abort"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    preemptions: int
    seed: int | None = None  # the sampling seed it ran with (drawn if it gave none)
    logprobs: list[Any] | None = None  # per token (params.logprobs)
    prompt_logprobs: list[Any] | None = None  # per prompt position (params.prompt_logprobs)

    @classmethod
    def of(cls, s: Sequence) -> Finished:
        """The figures of a finished sequence."""
        return cls(finish_reason=s.finish_reason or "", prompt_tokens=len(s.prompt),
                   completion_tokens=len(s.output), cached_tokens=s.cached_tokens,
                   preemptions=s.preemptions, seed=s.params.seed, logprobs=s.logprobs,
                   prompt_logprobs=s.prompt_logprobs)  # fmt: skip


# on_event(kind, value): ("token", int) (each preceded by ("logprobs", (logprob, top))
# when the request asked for them), then ("done", Finished) or ("error", Exception).
EventCallback = Callable[[str, Any], None]


@dataclasses.dataclass(eq=False)
class Request:
    model: str
    prompt: Prompt  # validated by the model's engine
    params: SamplingParams
    on_event: EventCallback
    submitted: float = dataclasses.field(default_factory=time.perf_counter)
    request_id: int | None = None  # the engine's, once added
    cancelled: bool = False
    closed: bool = False  # done, failed or cancelled: no more events
    fork_of: Request | None = None  # shares this earlier request's prompt KV (n samples)
    cache_salt: str | None = None  # shares cached prefixes only with the same salt
    adapter: str | None = None  # the LoRA adapter it runs with (None: the base model)
