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
        self.runner = ModelRunner(model, self.cache)
        self.scheduler = Scheduler(self.cache, max_batch, prefill_chunk, self.max_model_len)
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
    ) -> int:
        """Queues a request; ``on_token(request_id, token, finished)`` streams its output."""
        ids = self._encode(prompt)
        rid = next(self._ids)
        self.scheduler.add(Sequence(rid, ids, params or SamplingParams(), on_token))
        return rid

    # -- the loop ----------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Runs one scheduled step; returns the sequences that finished in it."""
        seqs, inputs = self.scheduler.schedule(after=self.runner.token)
        if not seqs:
            return []
        logits = self.runner.run(inputs)
        self.steps += 1
        sampling = [
            s for s, x in zip(seqs, inputs, strict=True) if x.start + len(x.tokens) == len(s.tokens)
        ]
        for s, x in zip(seqs, inputs, strict=True):
            s.num_computed = x.start + len(x.tokens)
        if not sampling:
            return []
        rows = [i for i, (s, x) in enumerate(zip(seqs, inputs, strict=True)) if s in sampling]
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
            elif len(s.tokens) >= self.max_model_len:
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
    ) -> list[RequestOutput]:
        """Generates for every prompt (batched continuously); outputs in prompt order."""
        if isinstance(params, SamplingParams) or params is None:
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("one SamplingParams per prompt")
        encoded = [self._encode(p) for p in prompts]  # validate all before queueing any
        ids = [self.add_request(e, q, on_token) for e, q in zip(encoded, params, strict=True)]
        self.run()
        by_id = {s.request_id: s for s in self.finished}
        out = []
        for rid in ids:
            s = by_id[rid]
            out.append(
                RequestOutput(
                    rid,
                    s.prompt,
                    s.output,
                    s.finish_reason or "",
                    s.ttft or 0.0,
                    time.perf_counter() - s.arrival,
                    s.preemptions,
                    self.tokenizer.decode(s.output) if self.tokenizer else None,
                )
            )
        return out

    def close(self) -> None:
        self.cache.close()
