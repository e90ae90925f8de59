"""The step program: one jitted function that runs a ragged batch through the model over
the paged KV cache and, in a decode-sized step, samples every sequence's next token too:
one dispatch per step.

Inputs travel as one packed int32 array, sliced by name through the shape's
:class:`~jax_kvcached.engine.step_layout.StepLayout` (the same object the input builder
packs with): the tokens and their positions, slots and block tables of every KV cache
group, the ragged layout, each row's sampling parameters and the step's flags
(:data:`SAMPLE`, :data:`LOGPROBS`). Each layer
writes the step's K/V (one ``ops.write_kv_async`` call) and attends over the cache; the
last token of each sequence gives its logits. A *fused* step (``StepSpec.fuse`` and at
most ``max_rows`` tokens: the steps whose cost is launches, not math) then samples (and,
when a row asks, gives the sampled tokens' log-probabilities) in the same program;
other steps, and a fused step whose rows process their logits (penalties, biases: flag
off), leave sampling to the runner's separate programs, which run behind the step on
the (processed) logits.

The outputs: the logits of the step's first :func:`logit_rows` rows, the prompt scores
(zeros unless a row asked), and in a fused step the sampled tokens ``(max_rows,)`` and
their log-probabilities (zeros unless asked; None in an unfused step), plus the token
that orders the next step after this one.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_kvcached.engine.attention import Ragged, host_paged_attention, paged_attention
from jax_kvcached.engine.recurrent import recurrence
from jax_kvcached.engine.sampler_programs import sampler_programs
from jax_kvcached.engine.sampling import MAX_LOGPROBS
from jax_kvcached.engine.step_layout import LOGPROBS, SAMPLE, StepLayout
from jax_kvcached.memory import ops
from jax_kvcached.memory.kv_cache import KVCache
from jax_kvcached.models.lora import LoRABatch


def attention_fn(impl: str, cache: KVCache, nb: int, token: jax.Array) -> Callable:
    """The ragged paged attention of a resolved choice (``host``, ``xla``, ``pallas``,
    ``pallas-interpret``): ``(q, view, layer, layout, window=0) -> out``. ``xla`` is the
    portable fallback; ``pallas-interpret`` runs the kernel interpreted (tests)."""
    if impl == "xla":
        return paged_attention
    if impl == "host":
        return functools.partial(host_paged_attention, cache, token)
    from jax_kvcached.engine.pallas_attention import pallas_paged_attention

    splits = max(1, min(8, nb // 32))  # flash decoding: split long contexts
    return functools.partial(
        pallas_paged_attention, num_splits=splits, interpret=impl == "pallas-interpret"
    )


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """What a step program is built from (the runner's fixed choices)."""

    graphdef: Any
    cache: KVCache
    attention: str  # resolved (see attention_fn)
    max_rows: int  # sequence slots (a power of two)
    num_candidates: int
    windows: np.ndarray  # each layer's window (0: full attention)
    join: Callable[[list], Any]  # the flat weights -> the model's state
    layout: Callable[[tuple[int, int]], StepLayout]  # a shape's packed input
    per_device: Callable  # (fn, in_specs, out_specs) -> fn over the mesh (or fn)
    head_spec: Any  # the partition of a (T, heads, D) array (None without a mesh)
    logits_sharding: Any  # replicated logits on a mesh (None without one)
    fuse: bool = True  # sample inside steps of at most max_rows tokens

    def fused(self, t: int) -> bool:
        """Whether a step of ``t`` tokens samples inside its program."""
        return self.fuse and t <= self.max_rows

    @property
    def on_mesh(self) -> bool:
        return self.logits_sharding is not None


def make_step(spec: StepSpec) -> Callable:
    """``step(weights, view, packed, prev, t, nb, token) -> (outputs, token)`` (``t`` and
    ``nb`` static; ``weights``: the model's flat weights and the LoRA slots' stacks or
    None): ``outputs`` = (logits ``(R, vocab)``, prompt scores, sampled tokens
    ``(max_rows,)``, log-probabilities of the sampled tokens), R = :func:`logit_rows`;
    the last two None unless ``spec.fused(t)``."""
    graphdef, cache, max_rows = spec.graphdef, spec.cache, spec.max_rows
    per_device, heads, windows = spec.per_device, spec.head_spec, spec.windows
    groups = np.asarray(cache.layer_groups, np.int32)  # each layer's KV cache group
    sample_rows, _, logprob_rows = sampler_programs(
        max_rows, spec.num_candidates, barrier=not spec.on_mesh
    )
    # On a mesh every device samples the same rows from the replicated logits (XLA's
    # partitioner then never sees the sampler's barriers).
    sampler = per_device(sample_rows, (None, None), None)
    logprobs = per_device(logprob_rows, (None, None, None), None)

    def step(weights, view, packed, prev, t, nb, token):
        weights, adapters = weights  # (the LoRA slots' stacks, or None)
        state = spec.join(weights)
        layout = spec.layout((t, nb))
        a = layout.unpack(packed)
        rows = layout.rows
        tokens, positions, targets = a["tokens"], a["positions"], a["targets"]
        group_slots, group_tables = a["slots"], a["tables"]
        src, last, q_start = a["src"], a["last"], a["q_start"]
        lay = Ragged(group_tables[0], a["kv_lens"], q_start, a["q_lens"], a["item_seq"],
                     a["item_rows"], a["item_pos"], a["token_slot"])  # fmt: skip
        params, flags = a["params"], a["flags"][0]
        # Decode rows fed by the previous step's samples (still on the device).
        fed = jnp.where(src >= 0, prev[jnp.clip(src, 0, max_rows - 1)],
                        tokens[jnp.clip(q_start, 0, t - 1)])  # fmt: skip
        tokens = tokens.at[q_start].set(fed, mode="drop")  # unused slots: past the axis
        model = nnx.merge(graphdef, state)
        kv_heads = None if cache.latent else heads  # a latent cache is replicated
        view_spec = cache.sharding.spec if spec.on_mesh else None
        write = per_device(
            lambda view, i, k, v, slots, token: ops.write_kv_async(cache, i, k, v, slots, token,
                                                                   view=view),
            (view_spec, None, kv_heads, kv_heads, None, None), None,
        )  # fmt: skip
        # sinks (heads,): split with the heads; None (no sinks) is an empty argument
        sink_spec = None if heads is None else jax.sharding.PartitionSpec(heads[1])
        attention = per_device(
            lambda q, view, i, lay, token, w, s: attention_fn(spec.attention, cache, nb, token)(
                q, view, i, lay, window=w, sinks=s
            ),
            (heads, view_spec, None, None, None, None, sink_spec),
            heads,
        )  # fmt: skip

        def attend(i, q, k, v, chain, sinks=None):
            # This step's K/V first (the reads below see them), then the attention; the
            # token chain orders every layer's calls (the scan's carry). A layer writes
            # and reads through its KV cache group's slots and tables.
            # (unrolled, i is a Python int: the group is static; scanned, an index)
            g = groups[i] if isinstance(i, int) else jnp.asarray(groups)[i]
            slots, tables = group_slots[g], group_tables[g]
            chain = write(view, i, k[0].astype(cache.dtype), v[0].astype(cache.dtype), slots,
                          chain)  # fmt: skip
            after = dataclasses.replace(lay, tables=ops.after(tables, chain))
            window = jnp.asarray(windows)[i] if any(windows) else jnp.int32(0)
            return attention(q[0], view, i, after, chain, window, sinks)[None], chain

        def recur(i, step_fn, init, xs, chain, chunk=None):
            # A recurrent layer's state slots (recurrent.py; never on a mesh).
            return recurrence(cache, view, i, step_fn, init, xs, chain,
                              blocks=a["state_blocks"], rows=a["state_rows"], q_start=q_start,
                              q_lens=a["q_lens"], chunk=chunk)  # fmt: skip

        attend.recur = recur
        if adapters is not None:  # each token's adapter (models/lora.py)
            attend.lora = LoRABatch(*adapters, a["lora"])
        hidden, chain = model.hidden_states(tokens[None], positions[None], attend, token)
        hidden = hidden[0]  # (t, E)
        logits = model.logits(hidden[jnp.clip(last[:rows], 0, t - 1)])  # (rows, vocab)
        scores = prompt_scores(model, hidden, targets)
        if spec.on_mesh:  # the logits gathered onto every device
            logits = jax.lax.with_sharding_constraint(logits, spec.logits_sharding)
        if not spec.fused(t):
            return (logits, scores, None, None), chain
        sampled = jax.lax.cond(
            (flags & SAMPLE) != 0,
            lambda: sampler(logits, params),
            lambda: jnp.zeros((max_rows,), jnp.int32),
        )
        k = min(MAX_LOGPROBS, logits.shape[-1])  # (token_logprobs' own bound)
        shapes = (rows,), (rows, k), (rows, k)
        lps = jax.lax.cond(
            (flags & LOGPROBS) != 0,
            lambda: logprobs(logits, sampled, src[:rows]),
            lambda: (
                jnp.zeros(shapes[0], jnp.float32),
                jnp.zeros(shapes[1], jnp.int32),
                jnp.zeros(shapes[2], jnp.float32),
            ),  # fmt: skip
        )
        return (logits, scores, sampled, lps), chain

    return step


def prompt_scores(model: Any, hidden: jax.Array, targets: jax.Array) -> jax.Array:
    """Prompt log-probabilities ``(1 + 2K, t)`` f32, per position: the target's
    log-probability, then the K most likely ids (exact below 2^24) and their
    log-probabilities. Computed (every position's logits) only when a row asks."""

    def score(_):
        lp = jax.nn.log_softmax(model.logits(hidden), axis=-1)
        want = jnp.take_along_axis(lp, jnp.maximum(targets, 0)[..., None], -1)
        vals, ids = jax.lax.top_k(lp, MAX_LOGPROBS)
        out = jnp.concatenate([want, ids.astype(jnp.float32), vals], axis=-1)
        return jnp.moveaxis(out, -1, 0)

    shape = (1 + 2 * MAX_LOGPROBS, *targets.shape)
    return jax.lax.cond(jnp.any(targets >= 0), score, lambda _: jnp.zeros(shape, jnp.float32), None)
