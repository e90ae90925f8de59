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


def segments(kinds: list) -> list[tuple[int, int, Any]]:
    """Runs of equal layer kinds as (first layer, count, kind), in order: each run is
    stacked apart (a scan's layers share one structure)."""
    out: list[tuple[int, int, Any]] = []
    for i, kind in enumerate(kinds):
        if out and out[-1][2] == kind:
            out[-1] = (out[-1][0], out[-1][1] + 1, kind)
        else:
            out.append((i, 1, kind))
    return out


def stack_segments(make: Callable[[Any], nnx.Module], kinds: list) -> tuple[Any, tuple[int, ...]]:
    """Layers of ``kinds`` (one per layer; ``make(kind)`` builds one): a stacked module
    when all are alike, else an ``nnx.List`` of one stacked module per run; and each
    run's first layer."""
    runs = segments(kinds)
    stacks = [stack_layers(lambda k=kind: make(k), n) for _, n, kind in runs]
    starts = tuple(start for start, _, _ in runs)
    return (stacks[0] if len(stacks) == 1 else nnx.List(stacks)), starts


def layer_runs(layers: Any, starts: tuple[int, ...]) -> list[tuple[int, nnx.Module]]:
    """(first layer, stacked module) of each run of :func:`stack_segments`' layers."""
    stacks = list(layers) if isinstance(layers, nnx.List) else [layers]
    return list(zip(starts, stacks, strict=True))


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
    offset: int = 0,
) -> tuple[jax.Array, Any]:
    """Runs ``body(layer, x, index, carry) -> (x, carry)`` over the stacked ``layers`` in
    order; ``index`` is the layer's int32 scalar (``offset`` + its place in the stack: a
    segment's first layer, see :func:`segments`). ``scan``: under ``jax.lax.scan`` (one
    body in the program), else unrolled."""
    graphdef, state = nnx.split(layers)
    n = jax.tree.leaves(state)[0].shape[0]
    if any(isinstance(a, LayerList) for a in jax.tree.leaves(state)):
        scan = False  # per-layer arrays (see LayerList): unrolled
    if not scan:
        for i in range(n):
            x, carry = body(_layer(graphdef, state, i), x, jnp.int32(offset + i), carry)
        return x, carry

    def step(xc, xs):
        (x, c), (st, i) = xc, xs
        return body(nnx.merge(graphdef, st), x, i, c), None

    index = jnp.arange(offset, offset + n, dtype=jnp.int32)
    (x, carry), _ = jax.lax.scan(step, (x, carry), (state, index))
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
