"""Request intake: prompts and sampling parameters validated before anything is queued.

:class:`RequestIntake` is a mixin of :class:`~jax_kvcached.engine.engine.Engine`: a
prompt's ids must lie in the vocabulary and leave room in the context, ``max_tokens``
must fit the room left, stop strings need a tokenizer, token-id fields must name ids of
the vocabulary. Errors are ``ValueError`` (:class:`ContextLengthExceeded` for the
context), raised to the caller (a 400 in the server).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as Seq
from typing import Any

from jax_kvcached.engine.offline import Prompt
from jax_kvcached.engine.sampling import SamplingParams
from jax_kvcached.memory.errors import ContextLengthExceeded


class RequestIntake:
    """Prompt and parameter validation of an engine (its ``config``, ``max_model_len``
    and ``tokenizer``)."""

    config: Any
    max_model_len: int
    tokenizer: Any

    def max_new_tokens(self, prompt_len: int, max_tokens: int | None) -> int:
        """The tokens a prompt of ``prompt_len`` may generate: ``max_tokens`` checked
        against the room its context leaves (None: all of that room).
        :class:`ContextLengthExceeded` when it asks for more."""
        room = self.max_model_len - prompt_len
        if max_tokens is None:
            return room
        if max_tokens > room:
            raise ContextLengthExceeded(
                f"this model's maximum context length is {self.max_model_len} tokens; the "
                f"prompt has {prompt_len} and max_tokens asks for {max_tokens}"
            )
        return max_tokens

    def encode(self, prompt: str | Seq[int] | Prompt) -> list[int]:
        """Token ids of a prompt, validated (vocabulary, length); raises ValueError
        (:class:`ContextLengthExceeded` for a prompt that leaves no room)."""
        return list(self.prompt(prompt).token_ids)

    def prompt(self, prompt: str | Seq[int] | Prompt) -> Prompt:
        """The validated prompt (see :meth:`encode`); one this engine validated already
        is returned as it is."""
        if isinstance(prompt, Prompt) and prompt.engine is self:
            return prompt
        if isinstance(prompt, Prompt):
            prompt = prompt.token_ids
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a string prompt needs an Engine tokenizer")
            ids = list(self.tokenizer.encode(prompt))
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("empty prompt")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(
                f"token ids out of the vocabulary [0, {self.config.vocab_size}): {bad[:5]}"
            )
        if len(ids) >= self.max_model_len:
            raise ContextLengthExceeded(
                f"prompt of {len(ids)} tokens leaves no room in max_model_len={self.max_model_len}"
            )
        return Prompt(tuple(ids), self)

    def checked_params(self, prompt_len: int, params: SamplingParams | None) -> SamplingParams:
        """A request's sampling parameters, validated for a prompt of ``prompt_len``
        tokens: ``top_k`` over the whole vocabulary is off, an unseeded request gets a
        fresh seed (reported in its output)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        vocab = self.config.vocab_size
        if (field := params.outside_vocabulary(vocab)) is not None:
            raise ValueError(f"{field} names token ids outside the vocabulary [0, {vocab})")
        self.max_new_tokens(prompt_len, params.max_tokens)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need an Engine tokenizer (token ids: stop_token_ids)")
        if params.top_k >= vocab:  # keeps the whole vocabulary: off
            params = dataclasses.replace(params, top_k=0)
        return params.seeded()
