"""Sampling: greedy, or seeded temperature / top-k / top-p, per row, inside the jitted step.

Semantics (exact, documented in the README). Temperature 0 is greedy (argmax, lowest id on
ties). Otherwise a row's tokens are ordered by logit descending, ties by ascending token
id; top-k keeps the first ``top_k`` of that order (0 or >= vocabulary: all);
top-p keeps the shortest prefix of the kept tokens whose probability (softmax over the
kept tokens) reaches ``top_p``, i.e. every token whose strictly-earlier mass is below
``top_p``. The draw is the Gumbel-max trick with counter-based noise: the kept token with
the largest ``logit / temperature + g(seed, step, token id)``, ``g`` Gumbel noise from a
hash of its arguments, ``step`` the number of tokens the request generated so far. So a
draw depends only on its own row: outputs do not change with batching, scheduling or
preemption.

No full-vocabulary sort anywhere: the ``num_candidates`` largest logits come from a
two-stage top-k (:func:`top_candidates`); a row is served from them when its kept set
provably lies inside them (``top_k <= num_candidates``, or the candidates' mass reaches
``top_p``). Rows with no filter (``top_k`` off, ``top_p == 1``) draw over the whole
vocabulary; only a row whose kept set reaches past the candidates finds its top-k and
top-p boundaries over the whole vocabulary, by bisection.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import secrets

import jax
import jax.numpy as jnp
from jax import lax

from jax_kvcached.engine.structured import Structured

NUM_CANDIDATES = 64


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """``seed``: None draws a fresh random one per request (the engine reports it, so the
    output can be replayed); an int makes the request reproducible."""

    max_tokens: int = 16
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    # Stop strings (up to MAX_STOP): the output ends before the first one that appears in
    # its text (needs the engine's tokenizer); finish_reason "stop".
    stop: tuple[str, ...] | list[str] | str = ()
    ignore_eos: bool = False
    # Logit processing, on the device, per row (see process_logits): OpenAI's presence /
    # frequency penalties over the generated tokens, the multiplicative repetition
    # penalty over prompt and generated tokens, additive biases per token id, and no EOS
    # or stop token before ``min_tokens`` tokens.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] | dict[int, float] = ()
    min_tokens: int = 0
    # Log-probabilities (the model's distribution: log-softmax of the raw logits) of each
    # generated token and of its ``logprobs`` most likely alternatives (None: none).
    logprobs: int | None = None
    # Log-probability of every prompt token after the first (and the ``logprobs`` most
    # likely at each position); the prompt is then computed in full (no prefix reuse).
    prompt_logprobs: bool = False
    # The output held to a JSON schema, a regex, a choice or a grammar (engine.structured);
    # the request stops when it is complete.
    structured: Structured | None = None

    def __post_init__(self) -> None:
        if isinstance(self.logit_bias, dict):  # {id: bias} as OpenAI writes it
            object.__setattr__(self, "logit_bias", tuple(sorted(self.logit_bias.items())))
        try:
            stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        except TypeError:
            raise TypeError(f"stop must be a string or a list of them, got {self.stop!r}") from None
        if len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be up to {MAX_STOP} non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        _check_int("max_tokens", self.max_tokens, 1, INT32_MAX)
        _check_int("top_k", self.top_k, 0, INT32_MAX)
        _check_int("min_tokens", self.min_tokens, 0, self.max_tokens)
        if self.seed is not None:
            _check_int("seed", self.seed, 0, UINT32_MAX)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        for t in self.stop_token_ids:
            _check_int("stop_token_ids[i]", t, 0, INT32_MAX)
        for t, _ in self.logit_bias:
            _check_int("logit_bias token id", t, 0, INT32_MAX)
        reals = [
            ("temperature", self.temperature), ("top_p", self.top_p),
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
            ("repetition_penalty", self.repetition_penalty),
        ] + [(f"logit_bias[{t}]", b) for t, b in self.logit_bias]  # fmt: skip
        for name, v in reals:
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
        if self.structured is not None and not isinstance(self.structured, Structured):
            raise TypeError(f"structured must be a Structured, got {self.structured!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if len({t for t, _ in self.logit_bias}) != len(self.logit_bias):
            raise ValueError("logit_bias names a token id twice")

    @property
    def processes_logits(self) -> bool:
        """Whether the row's logits are processed before sampling (penalties, biases,
        min_tokens)."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
            or self.logit_bias or self.min_tokens
        )  # fmt: skip

    def outside_vocabulary(self, vocab_size: int) -> str | None:
        """The first field naming a token id outside ``[0, vocab_size)``: ``logit_bias``
        or ``stop_token_ids`` (None: every id is inside)."""
        for name, ids in (("logit_bias", [t for t, _ in self.logit_bias]),
                          ("stop_token_ids", self.stop_token_ids)):  # fmt: skip
            if any(t >= vocab_size for t in ids):
                return name
        return None

    def seeded(self) -> SamplingParams:
        """These parameters with a seed: a fresh random one if none was given."""
        if self.seed is not None:
            return self
        return dataclasses.replace(self, seed=secrets.randbits(32))


INT32_MAX = (1 << 31) - 1
UINT32_MAX = (1 << 32) - 1
MAX_LOGPROBS = 20  # alternatives per token (OpenAI's bound)
MAX_STOP = 16  # stop strings per request


def _check_int(name: str, v: object, lo: int, hi: int) -> None:
    """Sampling fields go into int32 / uint32 step inputs: reject what does not fit."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {v}")


def _mix(x: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finalizer: a bijection with full avalanche."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def gumbel_noise(seeds: jax.Array, steps: jax.Array, ids: jax.Array) -> jax.Array:
    """Gumbel noise ``(B, N)`` for token ``ids`` ``(B, N)`` of rows with ``seeds`` (uint32)
    and ``steps`` ``(B,)``: a counter-based hash of (seed, step, id), so each value is a
    function of its own (seed, step, id) only, at any batch position."""
    row = _mix(_mix(seeds.astype(jnp.uint32) ^ jnp.uint32(0x9E3779B9)) + steps.astype(jnp.uint32))
    col = _mix(ids.astype(jnp.uint32) * jnp.uint32(0x27D4EB2F) + jnp.uint32(0x165667B1))
    bits = _mix(_mix(row[:, None] ^ col) + row[:, None])
    return -jnp.log(-jnp.log(open_unit(bits)))


def open_unit(bits: jax.Array) -> jax.Array:
    """uint32 hash bits -> float32 strictly inside (0, 1): 23 bits, so the largest is
    1 - 2**-24 (24 bits would round it to 1.0 in float32, whose Gumbel noise is +inf:
    a token picked whatever its logit, even a masked -inf one)."""
    return ((bits >> 9).astype(jnp.float32) + 0.5) * (1.0 / (1 << 23))


def sample(
    logits, temperature, top_k, top_p, seeds, steps, num_candidates=NUM_CANDIDATES, *,
    barrier: bool = True,
):  # fmt: skip
    """Next tokens ``(B,)`` int32 from logits ``(B, V)`` and per-row parameters ``(B,)``
    (temperature f32, top_k i32, top_p f32, seeds uint32, steps i32). Traceable; the
    all-greedy batch costs one argmax. ``barrier=False`` leaves out the optimization
    barriers that keep the CPU's partial-sort kernel (XLA's SPMD partitioner, which
    runs for a program over a mesh, fails on them); the tokens are the same."""
    logits = logits.astype(jnp.float32)

    def greedy(_):
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw(_):
        return _draw(logits, temperature, top_k, top_p, seeds, steps, num_candidates, barrier)

    return lax.cond(jnp.all(temperature <= 0), greedy, draw, None)


def _draw(logits, temperature, top_k, top_p, seeds, steps, num_candidates, barrier=True):
    b, v = logits.shape
    k = min(num_candidates, v)
    inv_t = (1.0 / jnp.where(temperature > 0, temperature, 1.0))[:, None]
    k_eff = jnp.where((top_k > 0) & (top_k < v), top_k, v)
    no_filter = (k_eff == v) & (top_p >= 1.0)

    # The order is the logits' (a positive temperature keeps it): one pass over the
    # input for the candidates and one for the normaliser, nothing materialised.
    raw, ids = top_candidates(logits, k, barrier)
    cand = raw * inv_t
    in_k = jnp.arange(k)[None] < k_eff[:, None]
    top = cand[:, :1]
    lse_all = top[:, 0] + jnp.log(jnp.sum(jnp.exp((logits - raw[:, :1]) * inv_t), axis=-1))
    lse_cand = top[:, 0] + jnp.log(jnp.sum(jnp.where(in_k, jnp.exp(cand - top), 0.0), axis=-1))
    probs = jnp.exp(cand - jnp.where(k_eff <= k, lse_cand, lse_all)[:, None])
    probs = jnp.where(in_k, probs, 0.0)
    before = jnp.cumsum(probs, axis=-1) - probs
    keep = in_k & (before < top_p[:, None])
    # The kept set lies inside the candidates: top-k within them, or their mass reaches
    # top_p (so the first token past them has earlier mass >= top_p).
    covered = (k_eff <= k) | (~no_filter & (k_eff == v) & (jnp.sum(probs, axis=-1) >= top_p))
    score = jnp.where(keep, cand + gumbel_noise(seeds, steps, ids), -jnp.inf)
    fast = jnp.take_along_axis(ids, jnp.argmax(score, -1)[:, None], -1)[:, 0]

    def whole_vocabulary(_):
        # Recomputed from the logits (an input buffer): capturing `scaled` would make XLA
        # materialise it for the branch on every step, taken or not.
        scaled = logits * inv_t
        all_ids = jnp.broadcast_to(jnp.arange(v, dtype=jnp.int32)[None], (b, v))
        filtered = ~covered & ~no_filter
        keep = lax.cond(
            jnp.any(filtered),
            lambda _: _exact_keep(logits, scaled, k_eff, top_p) | ~filtered[:, None],
            lambda _: jnp.ones((b, v), bool),
            None,
        )
        score = jnp.where(keep, scaled + gumbel_noise(seeds, steps, all_ids), -jnp.inf)
        return jnp.argmax(score, axis=-1).astype(jnp.int32)

    slow = lax.cond(jnp.all(covered), lambda _: fast, whole_vocabulary, None)
    # Greedy rows of a mixed batch: the first candidate is the argmax (lowest id on ties).
    return jnp.where(temperature > 0, jnp.where(covered, fast, slow), ids[:, 0])


def process_logits(logits, ids, counts, row_params, prev_token):
    """Penalties and biases of every row, batch-independent. ``logits`` ``(B, V)``;
    ``ids`` ``(B, P)`` the token ids a row names (padding: id 0 with zero weights);
    ``counts`` ``(3, B, P)`` f32: times generated, in the prompt (0/1), additive bias;
    ``row_params`` ``(3, B)`` f32: presence, frequency and repetition penalties;
    ``prev_token`` ``(B,)`` the row's generated token still on the device (-1: none),
    counted as generated. Repetition (prompt or generated tokens): positive logits are
    divided by it, negative ones multiplied; then ``- presence * [generated > 0] -
    frequency * generated + bias``."""
    b, v = logits.shape
    logits = logits.astype(jnp.float32)
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], ids.shape)
    zeros = jnp.zeros((b, v), jnp.float32)
    gen = zeros.at[rows, ids].add(counts[0])
    has_prev = prev_token >= 0
    gen = gen.at[jnp.arange(b), jnp.maximum(prev_token, 0)].add(has_prev.astype(jnp.float32))
    seen = (zeros.at[rows, ids].max(counts[1]) > 0) | (gen > 0)
    bias = zeros.at[rows, ids].add(counts[2])
    presence, frequency, repetition = (row_params[i][:, None] for i in range(3))
    rep = jnp.where(logits > 0, logits / repetition, logits * repetition)
    out = jnp.where(seen & (repetition != 1.0), rep, logits)
    return out - presence * (gen > 0) - frequency * gen + bias


def token_logprobs(logits, tokens, k: int = MAX_LOGPROBS):
    """Log-probabilities (log-softmax of ``logits`` ``(B, V)``) of ``tokens`` ``(B,)``,
    and the ``k`` most likely ids and their log-probabilities ``(B, k)`` (ties: lower
    id first)."""
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    chosen = jnp.take_along_axis(logits, tokens[:, None].astype(jnp.int32), -1)[:, 0] - lse
    vals, ids = lax.top_k(logits, min(k, logits.shape[-1]))
    return chosen, ids.astype(jnp.int32), vals - lse[:, None]


CHUNK = 128  # top_candidates: vocabulary chunk of the first stage


def top_candidates(x: jax.Array, k: int, barrier: bool = True) -> tuple[jax.Array, jax.Array]:
    """The ``k`` largest of each row of ``x`` ``(B, V)`` and their ids, descending, ties by
    lower id (exactly ``lax.top_k``). For a large vocabulary in two stages: the k chunks
    of 128 with the largest maxima (every top-k entry lies in one of them; ties by lower
    chunk), then the top k of those chunks, gathered in id order."""
    b, v = x.shape
    fence = lax.optimization_barrier if barrier else (lambda x: x)
    if v < 32 * CHUNK or v % CHUNK:
        # The barrier keeps XLA from folding later gathers into the top-k's sort, which
        # would stop the CPU backend from using its partial-sort kernel.
        return fence(lax.top_k(x, k))
    chunks = x.reshape(b, v // CHUNK, CHUNK)
    _, best = fence(lax.top_k(jnp.max(chunks, axis=-1), k))
    best = jnp.sort(best, axis=-1)  # id order, so the stable top-k keeps lower ids first
    picked = jnp.take_along_axis(chunks, best[:, :, None], axis=1).reshape(b, k * CHUNK)
    vals, pos = fence(lax.top_k(picked, k))
    ids = jnp.take_along_axis(best, pos // CHUNK, axis=-1) * CHUNK + pos % CHUNK
    return vals, ids.astype(jnp.int32)


def _ordered_key(x: jax.Array) -> jax.Array:
    """float32 -> uint32 with the same order (finite values and infinities)."""
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def _smallest(pred, b: int) -> jax.Array:
    """Per row, the smallest uint32 ``t`` with ``pred(t)`` (monotone: False, then True;
    true at 2^32 - 1): 32 halvings of the key range."""

    def body(_, lo_hi):
        lo, hi = lo_hi
        mid = lo + (hi - lo) // 2
        ok = pred(mid)
        return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

    lo = jnp.zeros((b,), jnp.uint32)
    hi = jnp.full((b,), UINT32_MAX, jnp.uint32)
    return lax.fori_loop(0, 32, body, (lo, hi))[1]


def _ties_first(mask: jax.Array, weight: jax.Array, room: jax.Array) -> jax.Array:
    """Of the tied tokens ``mask``, those (by ascending id) whose exclusive running total
    of ``weight`` is below ``room``."""
    w = jnp.where(mask, weight, 0)
    return mask & (jnp.cumsum(w, axis=-1) - w < room[:, None])


def _exact_keep(logits, scaled, k_eff, top_p):
    """The kept set over the whole vocabulary, without sorting: the top-k and top-p
    boundaries are found by bisection over the logits' order-preserving integer keys."""
    b, v = scaled.shape
    key = _ordered_key(logits)

    def count_above(t):
        return jnp.sum(key > t[:, None], axis=-1)

    tk = _smallest(lambda t: count_above(t) < k_eff, b)  # the k-th largest key
    above = key > tk[:, None]
    tied = key == tk[:, None]
    room = k_eff - jnp.sum(above, axis=-1)
    in_k = above | _ties_first(tied, jnp.ones_like(key, jnp.int32), room)
    top = jnp.max(scaled, axis=-1, keepdims=True)
    e = jnp.where(in_k, jnp.exp(scaled - top), 0.0)
    probs = e / jnp.sum(e, axis=-1, keepdims=True)

    def mass_above(t):
        return jnp.sum(jnp.where(key > t[:, None], probs, 0.0), axis=-1)

    tp = _smallest(lambda t: mass_above(t) < top_p, b)  # the last kept key
    above = in_k & (key > tp[:, None])
    tied = in_k & (key == tp[:, None])
    room = top_p - jnp.sum(jnp.where(above, probs, 0.0), axis=-1)
    keep = above | _ties_first(tied, probs, room)
    return jnp.where((top_p >= 1.0)[:, None], in_k, keep)
