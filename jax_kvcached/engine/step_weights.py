"""StepWeights: a model's parameters as the step program takes them.

The weights travel as a flat list: flattening an ``nnx.State`` on every call costs more
host time than the rest of a small step's dispatch. Unrolled (``scan_layers=False``),
each stacked weight travels as its layers' arrays (``models.stack.LayerList``): on a CPU
XLA copies each slice of a stacked weight before its dot. Every array is committed where
it is (jit keys on commitment), so weights restored after a sleep hit the same
executables.
"""

from __future__ import annotations

import math
from typing import Any

import jax
from flax import nnx

from jax_kvcached.engine.sleep import Offloaded, offload, restore
from jax_kvcached.models.quant_linear import packed_leaves
from jax_kvcached.models.sharding import shard_model
from jax_kvcached.models.stack import LayerList, stacked_leaves


class StepWeights:
    """The flat weights of a split model (``state`` of ``nnx.split``), ``num_layers``
    deep; ``unroll``: stacked weights travel as per-layer arrays; ``mesh``: the mesh a
    reloaded model is placed on (a level-2 wake)."""

    def __init__(self, state: Any, num_layers: int, *, unroll: bool, mesh: Any = None) -> None:
        leaves, self._treedef = jax.tree.flatten(state)
        self._stacked = [f and unroll for f in stacked_leaves(state)]
        # A stacked weight's depth: num_layers, or its segment's layers (a model whose
        # layers differ, e.g. dense and mixture-of-experts ones, stacks each run apart).
        self._depths = [x.shape[0] if s else 1 for x, s in zip(leaves, self._stacked, strict=True)]
        if any(d > num_layers for d in self._depths):
            raise ValueError(f"a stacked weight is deeper than the model's {num_layers} layers")
        self._mesh = mesh
        self.arrays: list[jax.Array] = self._expand(leaves)
        packed = packed_leaves(state)  # which arrays are packed values / scales / mins
        self.packed = [p for p, d in zip(packed, self._depths, strict=True)
                       for _ in range(d)]  # fmt: skip

    def nbytes(self) -> dict[str, int]:
        """Device bytes (one device of a mesh; 0 while asleep): ``weight_bytes`` in all,
        ``weight_packed_bytes`` of them packed int8 / int4 values and their scales."""
        total = packed = 0
        for a, p in zip(self.arrays, self.packed, strict=False):
            # (from the sharding: one device's shard, without touching the shards)
            n = math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
            total += n
            packed += n if p else 0
        return {"weight_bytes": total, "weight_packed_bytes": packed}

    def _expand(self, leaves: list) -> list:
        """A state's leaves as the step takes them: stacked weights split into their
        layers' arrays when unrolled, every array committed where it is."""
        out = []
        for leaf, split in zip(leaves, self._stacked, strict=True):
            if not split:
                out.append(leaf)
                continue
            sharding = leaf.sharding  # each layer's array split as the stacked one was
            if isinstance(sharding, jax.sharding.NamedSharding):
                spec = jax.sharding.PartitionSpec(*tuple(sharding.spec)[1:])
                sharding = jax.sharding.NamedSharding(sharding.mesh, spec)
            out += [jax.device_put(leaf[i], sharding) for i in range(leaf.shape[0])]
        return [w if w.committed else jax.device_put(w, w.sharding) for w in out]

    def join(self, weights: list) -> Any:
        """The step's flat weights back into the model's state (per-layer arrays as a
        LayerList); traced inside the step."""
        leaves, at = [], 0
        for split, n in zip(self._stacked, self._depths, strict=True):
            leaves.append(LayerList(weights[at : at + n]) if split else weights[at])
            at += n
        return jax.tree.unflatten(self._treedef, leaves)

    # -- sleep -----------------------------------------------------------------------------
    def offload(self, level: int) -> Offloaded:
        """Sleep: the weights to host memory (level 1) or dropped (level 2); the device
        arrays are deleted. No step may run until :meth:`restore`."""
        off = offload(self.arrays, level)
        self.arrays = []
        return off

    def restore(self, off: Offloaded, model: Any = None) -> float:
        """Wake: the weights back on the device, from the host copies or (level 2) from
        ``model``, a freshly loaded model of the same architecture; returns the copy's
        seconds. The compiled steps are hit again (same avals and shardings)."""
        fresh = None
        if off.level == 2:
            if model is None:
                raise ValueError("a level-2 wake needs the reloaded model")
            if self._mesh is not None:
                model = shard_model(model, self._mesh)
            fresh, treedef = jax.tree.flatten(nnx.split(model)[1])
            if treedef != self._treedef:
                raise ValueError("the reloaded checkpoint does not match the sleeping model")
            fresh = self._expand(fresh)
            shapes = [(x.shape, x.dtype) for x in fresh]
            if shapes != [(s.shape, s.dtype) for s in off.avals]:
                raise ValueError("the reloaded checkpoint does not match the sleeping model")
        self.arrays, seconds = restore(off, fresh)
        return seconds
