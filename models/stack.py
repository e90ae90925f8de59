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
    return _layer(*nnx.split(layers), i)


def _layer(graphdef: Any, state: Any, i: int) -> nnx.Module:
    """Layer ``i`` of a split stacked module (a LayerList gives its own array)."""
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
    if any(isinstance(a, LayerList) for a in jax.tree.leaves(state)):
        scan = False  # per-layer arrays (see LayerList): unrolled
    if not scan:
        for i in range(n):
            x, carry = body(_layer(graphdef, state, i), x, jnp.int32(i), carry)
        return x, carry

    def step(xc, xs):
        (x, c), (st, i) = xc, xs
        return body(nnx.merge(graphdef, st), x, i, c), None

    (x, carry), _ = jax.lax.scan(step, (x, carry), (state, jnp.arange(n, dtype=jnp.int32)))
    return x, carry


class LayerList:
    """A stacked parameter given as one array per layer (a ``jax.tree`` leaf): indexing
    picks a layer's own array, with no slice in the program. On a CPU, XLA copies every
    slice of a stacked weight (a dynamic slice in a scan too) before its dot, so the
    engine runs the layers unrolled over per-layer arrays there (:func:`run_layers`
    with ``scan=False`` reads them)."""

    def __init__(self, arrays) -> None:
        self.arrays = tuple(arrays)

    def __getitem__(self, i: int) -> Any:
        return self.arrays[i]

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.arrays), *self.arrays[0].shape)


def stacked_leaves(state: Any) -> list[bool]:
    """For each leaf of a model's state (``jax.tree`` order): whether it is a stacked
    layer parameter (under the model's ``layers``)."""
    flags = []
    for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]:
        first = path[0] if path else None
        flags.append(getattr(first, "key", None) == "layers")
    return flags
