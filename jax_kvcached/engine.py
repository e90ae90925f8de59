"""Engine: continuous-batching generation for one model over a KVCache of a Pool."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any

import jax.numpy as jnp
import numpy as np

from jax_kvcached.kv_cache import KVCache
from jax_kvcached.pool import Pool
from jax_kvcached.prefix_cache import PrefixCache, extra_key_bytes
from jax_kvcached.runner import ModelRunner
from jax_kvcached.sampling import SamplingParams, sample
from jax_kvcached.scheduler import Scheduler, Sequence


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
    text: str | None = None


class Engine:
    """Serves one Flax model (``jax_kvcached.models.LlamaModel``) from a pool.

    Args:
      model: the model (its ``config`` gives the KV shape).
      pool: the pool its KV cache is created in.
      name: the KV cache's name in the pool.
      max_batch: sequences running at once.
      prefill_chunk: new tokens per sequence in one prefill step.
      max_model_len: prompt + output limit (default: the model's max positions).
      kv_dtype: KV cache dtype (default: the model's dtype).
      tokenizer: optional, for string prompts and ``RequestOutput.text``.
      prefix_caching: reuse the KV of cached prompt prefixes across requests.
      max_cached_tokens: prefix-cache bound (default ``KVCACHED_MAX_CACHED_TOKENS``).
      log_every: steps between INFO logs of the prefix-cache metrics.
    """

    def __init__(
        self,
        model: Any,
        pool: Pool,
        *,
        name: str = "model",
        max_batch: int = 8,
        prefill_chunk: int = 128,
        max_model_len: int | None = None,
        kv_dtype: Any = None,
        block_size: int = 16,
        tokenizer: Any = None,
        prefix_caching: bool = True,
        max_cached_tokens: int | None = None,
        log_every: int = 200,
    ) -> None:
        cfg = model.config
        if max_batch <= 0 or prefill_chunk <= 0:
            raise ValueError("max_batch and prefill_chunk must be positive")
        self.config = cfg
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len or cfg.max_position_embeddings
        self.cache: KVCache = pool.create_kv_cache(
            name,
            cfg.num_layers,
            cfg.num_kv_heads,
            cfg.head_dim,
            kv_dtype or model.dtype,
            block_size=block_size,
        )
        self.name = name
        self.runner = ModelRunner(model, self.cache)
        self.prefix_cache = PrefixCache(self.cache, max_cached_tokens) if prefix_caching else None
        self.scheduler = Scheduler(
            self.cache, max_batch, prefill_chunk, self.max_model_len, self.prefix_cache
        )
        self.log_every = log_every
        self._ids = itertools.count()
        self.finished: list[Sequence] = []
        self.steps = 0

    # -- requests ----------------------------------------------------------------------
    def _encode(self, prompt: str | Seq[int]) -> list[int]:
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
            raise ValueError(
                f"prompt of {len(ids)} tokens leaves no room in max_model_len={self.max_model_len}"
            )
        return ids

    def add_request(
        self,
        prompt: str | Seq[int],
        params: SamplingParams | None = None,
        on_token: Callable[[int, int, bool], None] | None = None,
        *,
        cache_salt: str | None = None,
        adapter_id: str | None = None,
    ) -> int:
        """Queues a request; ``on_token(request_id, token, finished)`` streams its output.

        Requests share cached prefixes only with the same model, ``cache_salt`` and
        ``adapter_id``.
        """
        ids = self._encode(prompt)
        rid = next(self._ids)
        seq = Sequence(rid, ids, params or SamplingParams(), on_token)
        seq.extra = extra_key_bytes(self.name, cache_salt, adapter_id)
        self.scheduler.add(seq)
        return rid

    # -- the loop ----------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Runs one scheduled step; returns the sequences that finished in it."""
        seqs, inputs = self.scheduler.schedule(after=self.runner.token)
        if not seqs:
            return []
        logits = self.runner.run(inputs)
        self.steps += 1
        # Rows whose new tokens reached the end of their sequence yield a next token.
        rows = [
            i
            for i, (s, x) in enumerate(zip(seqs, inputs, strict=True))
            if x.start + len(x.tokens) == s.num_tokens
        ]
        sampling = [seqs[i] for i in rows]
        for s, x in zip(seqs, inputs, strict=True):
            self.scheduler.computed(s, x.start + len(x.tokens))
        if self.prefix_cache and self.steps % self.log_every == 0:
            self.prefix_cache.log_stats()
        if not sampling:
            return []
        p = [s.params for s in sampling]
        new_tokens = np.asarray(
            sample(
                logits[jnp.asarray(rows)],
                jnp.asarray([q.temperature for q in p], jnp.float32),
                jnp.asarray([q.top_k for q in p], jnp.int32),
                jnp.asarray([q.top_p for q in p], jnp.float32),
                jnp.asarray([q.seed for q in p], jnp.uint32),
                jnp.asarray([len(s.output) for s in sampling], jnp.int32),
            )
        )
        now = time.perf_counter()
        done = []
        eos = self.config.eos_ids
        for s, tok in zip(sampling, new_tokens.tolist(), strict=True):
            s.output.append(tok)
            if s.first_token_time is None:
                s.first_token_time = now
            reason = None
            if tok in s.params.stop_token_ids or (tok in eos and not s.params.ignore_eos):
                reason = "stop"
            elif len(s.output) >= s.params.max_tokens:
                reason = "length"
            elif s.num_tokens >= self.max_model_len:
                reason = "length"
            if reason:
                self.scheduler.finish(s, reason, after=self.runner.token)
                done.append(s)
            if s.on_token is not None:
                s.on_token(s.request_id, tok, reason is not None)
        self.finished.extend(done)
        return done

    def run(self) -> None:
        """Steps until every queued request has finished."""
        while self.scheduler.has_work:
            self.step()

    def generate(
        self,
        prompts: Seq[str | Seq[int]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        on_token: Callable[[int, int, bool], None] | None = None,
        *,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Generates for every prompt (batched continuously); outputs in prompt order."""
        if isinstance(params, SamplingParams) or params is None:
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("one SamplingParams per prompt")
        encoded = [self._encode(p) for p in prompts]  # validate all before queueing any
        ids = [
            self.add_request(e, q, on_token, cache_salt=cache_salt)
            for e, q in zip(encoded, params, strict=True)
        ]
        self.run()
        wanted = set(ids)
        by_id = {s.request_id: s for s in self.finished if s.request_id in wanted}
        self.finished = [s for s in self.finished if s.request_id not in wanted]
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
                    text=self.tokenizer.decode(s.output) if self.tokenizer else None,
                )
            )
        return out

    def stats(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "waiting": len(self.scheduler.waiting),
            "running": len(self.scheduler.running),
            "preemptions": self.scheduler.num_preemptions,
            "prefix_cache": self.prefix_cache.stats() if self.prefix_cache else None,
        }

    def close(self) -> None:
        self.cache.close()
