"""The programs that run right behind a step, on its logits, without a host round trip:
logit processing (penalties, biases), a structured output's token mask, sampling, and the
sampled tokens' log-probabilities.

Each takes the step's logits of every sequence slot ``(max_rows, vocab)`` and works on its
first ``rows`` rows (a power of two, from the shape of its other inputs), so each compiles
once per row count; the runner jits them next to its step program.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jax_kvcached.engine.sampling import MAX_LOGPROBS, process_logits, sample, token_logprobs


def sampler_programs(
    max_rows: int, num_candidates: int, barrier: bool
) -> tuple[Callable, Callable, Callable]:
    """``(sample_rows, process_rows, logprob_rows)`` for steps of ``max_rows`` sequence
    slots. ``barrier``: the sampler's optimization barriers (off on a mesh, where each
    device runs its own copy)."""

    def process_rows(logits, ids, counts, row_params, prev, src):
        """The logits with the first ``ids.shape[0]`` rows after each row's penalties and
        biases; ``prev``/``src``: the previous step's samples and the row each row's
        input token came from."""
        n = ids.shape[0]
        prev_token = jnp.where(src >= 0, prev[jnp.clip(src, 0, max_rows - 1)], -1)
        out = process_logits(logits[:n], ids, counts, row_params, prev_token)
        return logits.at[:n].set(out)  # every slot's row: the sampler's one input shape

    def logprob_rows(logits, tokens, rows):
        """Each of the first ``rows.shape[0]`` rows' sampled token's log-probability and
        its top alternatives."""
        n = rows.shape[0]
        return token_logprobs(logits[:n], tokens[:n], MAX_LOGPROBS)

    def sample_rows(logits, params):
        """Next tokens of the first ``params.shape[1]`` rows, padded to ``(max_rows,)``;
        ``params`` ``(5, rows)``: temperature and top_p as float32 bits, top_k, seed,
        tokens generated."""
        logits = logits[: params.shape[1]]
        temperature = jax.lax.bitcast_convert_type(params[0], jnp.float32)
        top_p = jax.lax.bitcast_convert_type(params[2], jnp.float32)
        seeds = jax.lax.bitcast_convert_type(params[3], jnp.uint32)
        nxt = sample(logits, temperature, params[1], top_p, seeds, params[4], num_candidates,
                     barrier=barrier)  # fmt: skip
        return jnp.zeros((max_rows,), jnp.int32).at[: logits.shape[0]].set(nxt)

    return sample_rows, process_rows, logprob_rows


def mask_rows(logits: jax.Array, mask: jax.Array) -> jax.Array:
    """The logits with each of the first ``mask.shape[0]`` rows' disallowed tokens at
    -inf; ``mask`` ``(rows, words)`` int32: bit ``t % 32`` of word ``t // 32`` set when
    token ``t`` is allowed (a structured output's grammar; -1 words allow all)."""
    n, words = mask.shape
    bits = (mask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    allowed = bits.reshape(n, words * 32)[:, : logits.shape[1]] != 0
    return logits.at[:n].set(jnp.where(allowed, logits[:n], -jnp.inf))
