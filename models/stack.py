"""Decoder layers stored stacked (one module whose parameters carry a leading layer axis)
and run under ``jax.lax.scan``: a step program holds one layer body whatever the depth,
so compile time does not grow with the number of layers.

The layer index reaches the attention as an int32 scalar (traced under the scan), which
the engine's custom calls take as an operand. ``scan=False`` runs the same stacked
weights in an unrolled Python loop (the reference the scan is tested against).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx


def stack_layers(make: Callable[[], nnx.Module], n: int) -> nnx.Module:
    """``n`` layers built by ``make()`` in turn (so a seeded random init draws what it
    drew for a list of layers), merged into one module with stacked parameters."""
    if n < 1:
        raise ValueError(f"a model needs at least one layer, got {n}")
    graphdef, first = nnx.split(make())
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(first)):
        # Built abstractly (abstract_model's eval_shape: a loader fills the values): one
        # layer's shapes suffice, and tracing n initialisations costs seconds.
        return nnx.merge(
            graphdef, jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *x.shape)), first)
        )
    rest = [nnx.split(make())[1] for _ in range(n - 1)]
    return nnx.merge(graphdef, jax.tree.map(lambda *xs: jnp.stack(xs), first, *rest))


def num_stacked(layers: nnx.Module) -> int:
    """The number of layers in a stacked module."""
    return jax.tree.leaves(nnx.state(layers))[0].shape[0]


def layer_slice(layers: nnx.Module, i: int) -> nnx.Module:
    """Layer ``i`` of a stacked module as a module of its own (a copy of its slices)."""
    graphdef, state = nnx.split(layers)
    return nnx.merge(graphdef, jax.tree.map(lambda a: a[i], state))


def run_layers(
    layers: nnx.Module,
    x: jax.Array,
    carry: Any,
    body: Callable[[nnx.Module, jax.Array, jax.Array, Any], tuple[jax.Array, Any]],
    *,
    scan: bool = True,
) -> tuple[jax.Array, Any]:
    """Runs ``body(layer, x, index, carry) -> (x, carry)`` over the stacked ``layers`` in
    order; ``index`` is the layer's int32 scalar. ``scan``: under ``jax.lax.scan`` (one
    body in the program), else unrolled."""
    graphdef, state = nnx.split(layers)
    n = jax.tree.leaves(state)[0].shape[0]
    if not scan:
        for i in range(n):
            layer = nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state))
            x, carry = body(layer, x, jnp.int32(i), carry)
        return x, carry

    def step(xc, xs):
        (x, c), (st, i) = xc, xs
        return body(nnx.merge(graphdef, st), x, i, c), None

    (x, carry), _ = jax.lax.scan(step, (x, carry), (state, jnp.arange(n, dtype=jnp.int32)))
    return x, carry
