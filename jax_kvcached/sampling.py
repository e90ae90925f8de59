"""Sampling: greedy, or seeded temperature / top-k / top-p, per row, inside jit.

A row's random key is ``fold_in(PRNGKey(seed), step)`` (step = tokens generated so far),
so outputs do not depend on batching, scheduling or preemption.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, 1, INT32_MAX)
        _check_int("top_k", self.top_k, 0, INT32_MAX)
        _check_int("seed", self.seed, 0, UINT32_MAX)
        for t in self.stop_token_ids:
            _check_int("stop_token_ids[i]", t, 0, INT32_MAX)
        for name, v in (("temperature", self.temperature), ("top_p", self.top_p)):
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


INT32_MAX = (1 << 31) - 1
UINT32_MAX = (1 << 32) - 1


def _check_int(name: str, v: object, lo: int, hi: int) -> None:
    """Sampling fields go into int32 / uint32 step inputs: reject what does not fit."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {v}")


@jax.jit
def sample(logits, temperature, top_k, top_p, seeds, steps):
    """Next tokens ``(B,)`` from logits ``(B, V)`` and per-row parameters ``(B,)``."""
    v = logits.shape[-1]
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    desc = jnp.sort(scaled, axis=-1)[:, ::-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
    kth = jnp.take_along_axis(desc, (k - 1)[:, None], axis=-1)
    scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
    desc = jnp.where(jnp.arange(v)[None] < k[:, None], desc, -jnp.inf)
    probs = jax.nn.softmax(desc, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each token
    keep = before < top_p[:, None]
    threshold = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True)
    scaled = jnp.where(scaled < threshold, -jnp.inf, scaled)
    keys = jax.vmap(lambda s, n: jax.random.fold_in(jax.random.PRNGKey(s), n))(seeds, steps)
    drawn = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
    return jnp.where(temperature == 0, greedy, drawn)
