"""The offline API: an engine from a model's name or checkpoint, and ``generate`` and
``chat`` over its step loop.

:class:`OfflineAPI` is the part of :class:`~jax_kvcached.engine.engine.Engine` a script
calls: it validates every prompt before queueing any, runs the loop until they finish
and returns :class:`RequestOutput` objects in prompt order (a request that can never fit
raises its error). It needs the engine's ``add_request``, ``run``, ``encode`` and its
finished sequences.
"""

from __future__ import annotations

import dataclasses
import numbers
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any

from jax_kvcached.engine.config import EngineConfig
from jax_kvcached.engine.sampling import SamplingParams
from jax_kvcached.engine.sequence import Sequence
from jax_kvcached.models.chat_template import ChatTemplate

# One prompt: text, token ids, or a Prompt an engine validated.
PromptLike = str | Seq[int] | Any


@dataclasses.dataclass
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    ttft_s: float
    latency_s: float
    preemptions: int
    cached_tokens: int = 0
    seed: int | None = None  # the request's sampling seed (drawn if it gave none)
    text: str | None = None
    # params.logprobs: per token (logprob, [(id, logprob)]); params.prompt_logprobs: per
    # prompt position the same (None for the first; params.logprobs alternatives).
    logprobs: list[Any] | None = None
    prompt_logprobs: list[Any] | None = None


@dataclasses.dataclass(frozen=True)
class Prompt:
    """A prompt one engine has validated (:meth:`Engine.prompt`): token ids in its
    vocabulary that leave room in its context. Passing it on is not validated again."""

    token_ids: tuple[int, ...]
    engine: Any = dataclasses.field(repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.token_ids)


def as_prompt_list(prompts: Any) -> list[Any]:
    """``generate``'s prompts as a list: one string, Prompt or flat token-id list is one
    prompt (as the OpenAI ``prompt`` field reads it)."""
    if isinstance(prompts, (str, Prompt)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, numbers.Integral) for t in prompts):
        return [prompts]  # one prompt of token ids
    return prompts


def _text(tokenizer: Any, s: Sequence) -> str | None:
    """A finished sequence's output text (cut before its stop string, if it hit one)."""
    if tokenizer is None:
        return None
    if s.detok is None:
        return tokenizer.decode(s.output)
    s.detok.flush()
    return s.detok.text


class OfflineAPI:
    """``from_pretrained``, ``generate`` and ``chat`` of an engine (a mixin of
    :class:`Engine`, which gives ``encode``, ``add_request``, ``run``,
    ``take_finished``, ``tokenizer`` and ``chat_template``)."""

    tokenizer: Any
    chat_template: ChatTemplate | None

    @classmethod
    def from_pretrained(
        cls,
        source: str,
        pool: Any,
        *,
        dtype: Any = None,
        download: bool = False,
        seed: int = 0,
        quantization: str | None = None,
        **kwargs: Any,
    ) -> Any:
        """An engine for :func:`jax_kvcached.models.load_pretrained`'s ``source`` (a
        packaged model's name, a preset, a GGUF file or a checkpoint folder) with its
        tokenizer and chat template; ``dtype`` defaults to what the pool's device computes
        well (fp32 on a CPU, bf16 on a GPU). ``kwargs`` go to the constructor (a
        ``config`` and / or its fields); the KV cache is named after ``source`` unless
        they name it. ``quantization``: packed weights (see ``load_pretrained``)."""
        from jax_kvcached.models.pretrained import load_pretrained, weights_dtype

        dtype = dtype or weights_dtype(source, pool.device)
        pre = load_pretrained(
            source, dtype=dtype, seed=seed, download=download, quantization=quantization
        )
        config = kwargs.get("config")
        if "name" not in kwargs and (config is None or config.name == EngineConfig.name):
            kwargs["name"] = source
        # a level-2 sleep drops the weights: waking reads the checkpoint again
        kwargs.setdefault(
            "reload",
            lambda: load_pretrained(
                source, dtype=dtype, seed=seed, quantization=quantization
            ).model,
        )
        return cls(pre.model, pool, tokenizer=pre.tokenizer, chat_template=pre.template, **kwargs)

    def generate(
        self,
        prompts: PromptLike | Seq[PromptLike],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        on_token: Callable[[int, int, bool], None] | None = None,
        *,
        cache_salt: str | None = None,
        adapter: str | Seq[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Generates for every prompt (batched continuously); outputs in prompt order.
        ``adapter``: a loaded LoRA adapter's name for every prompt, or one per prompt
        (None: the base model).

        ``prompts``: a list of prompts (strings, token-id lists), or one prompt (a string
        or a flat list of token ids), as the OpenAI ``prompt`` field reads them; one
        prompt gives a list of one output. The first call compiles the step shapes it
        meets (seconds each): :meth:`compile` compiles all of them up front."""
        prompts = as_prompt_list(prompts)
        if isinstance(params, SamplingParams) or params is None:
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("one SamplingParams per prompt")
        adapters = [adapter] * len(prompts) if adapter is None or isinstance(adapter, str) else (
            list(adapter))  # fmt: skip
        if len(adapters) != len(prompts):
            raise ValueError("one adapter (or None) per prompt")
        encoded = [self.encode(p) for p in prompts]  # validate all before queueing any
        for a in set(adapters) - {None}:
            self.adapters.get(a)  # (a name not loaded: before any is queued)
        ids = [
            self.add_request(e, q, on_token, cache_salt=cache_salt, adapter=a)
            for e, q, a in zip(encoded, params, adapters, strict=True)
        ]
        self.run()
        by_id = self.take_finished(ids)
        for rid in ids:
            if by_id[rid].error is not None:  # rejected: it can never fit
                raise by_id[rid].error
        out = []
        for rid in ids:
            s = by_id[rid]
            out.append(
                RequestOutput(
                    request_id=rid,
                    prompt_token_ids=s.prompt,
                    token_ids=s.output,
                    finish_reason=s.finish_reason or "",
                    ttft_s=s.ttft or 0.0,
                    latency_s=time.perf_counter() - s.arrival,
                    preemptions=s.preemptions,
                    cached_tokens=s.cached_tokens,
                    seed=s.params.seed,
                    text=_text(self.tokenizer, s),
                    logprobs=s.logprobs,
                    prompt_logprobs=s.prompt_logprobs,
                )
            )
        return out

    def chat(
        self,
        messages: Seq[dict[str, str]] | Seq[Seq[dict[str, str]]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        **kwargs: Any,
    ) -> list[RequestOutput]:
        """Answers a conversation (a list of ``{"role", "content"}`` messages), or each of
        a list of them, through the model's chat template; outputs in order. ``kwargs``
        go to :meth:`generate`."""
        if self.tokenizer is None:
            raise ValueError("Engine.chat needs an Engine tokenizer (Engine.from_pretrained)")
        if isinstance(messages, dict) or not messages:
            raise TypeError("chat takes a list of {'role', 'content'} messages, or a list of those")
        convs = [messages] if isinstance(messages[0], dict) else list(messages)
        template = self.chat_template or ChatTemplate()
        prompts = [
            self.tokenizer.encode(template.render(list(c)), add_special_tokens=False) for c in convs
        ]  # (the rendered template brings its own special tokens)
        return self.generate(prompts, params, **kwargs)
