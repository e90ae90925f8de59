"""Layers over packed int8 / int4 weights (:mod:`.quant_format`): ``QuantLinear`` for
projections, ``QuantEmbed`` for a token table (lookups and tied logits).

The weights stay packed on the device. :func:`quant_matmul` computes ``x @ W.T``:
- on a CPU, the ``kvcached_quant_matmul`` custom call (AVX-512 VNNI / AVX2 / portable,
  chosen at run time; activations rounded per 32-block, integer dot products). The models
  stand alone: the call names its XLA FFI target, and the C++ core that registers it
  (``jax_kvcached.memory.ops``) is loaded when a CPU step is first traced, not imported;
- elsewhere, XLA: the weight's dequantization written as the dot's operand, for XLA's
  GPU fusion to fold into the matmul (``scripts/gpu-check.sh`` checks the optimized HLO).
``jax.lax.platform_dependent`` picks the path when the step is lowered.

Under tensor parallelism (``models.sharding``) a layer split by outputs or inputs runs
per device under ``jax.shard_map`` (inputs: a ``psum`` of the partial products).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from . import quant_format
from .quant_format import QuantFormat

QUANT_IMPLS = ("auto", "kernel", "xla")
# "auto" on a CPU: the kernel up to this many rows (decode; weight bandwidth bound), XLA's
# float32 dot over the dequantized weight above it (prefill; compute bound, where XLA's
# dot outruns the kernel: 4 x 256-token prefill 464 vs 364 tok/s through the kernel;
# benchmarks/bench_quant.py, part "prefill"). Decode-sized steps through XLA were slower.
KERNEL_MAX_ROWS = 32


def dequantize(q: jax.Array, scales: jax.Array, mins: jax.Array | None, fmt: QuantFormat,
               dtype: Any) -> jax.Array:  # fmt: skip
    """Packed (..., out, cols) -> (..., out, in) in ``dtype`` (what XLA folds into a dot):
    :func:`.quant_format.dequantize` over ``jax.numpy``."""
    return quant_format.dequantize(q, scales, mins, fmt, dtype, xp=jnp)


Weight = tuple  # (q, scales, mins or None) of one packed weight


def _kernel(x, weights: list, fmt: QuantFormat) -> list:
    # The custom call's target lives in the C++ core: importing ffi_targets registers it
    # (the one import of the memory layer a model may make, here where the call is built).
    from jax_kvcached.memory import ffi_targets  # noqa: F401
    rows = x.shape[0]
    outs = [jax.ShapeDtypeStruct((rows, q.shape[0]), jnp.float32) for q, _, _ in weights]
    operands = [x.astype(jnp.float32)]
    for q, s, m in weights:
        operands += [q, s, m if m is not None else jnp.zeros((0,), jnp.float16)]
    return jax.ffi.ffi_call("kvcached_quant_matmul", outs)(
        *operands, bits=np.int64(fmt.bits), group=np.int64(fmt.group)
    )


def _xla(x, weights: list, fmt: QuantFormat) -> list:
    return [
        jnp.dot(x, dequantize(q, s, m, fmt, x.dtype).T, preferred_element_type=jnp.float32)
        for q, s, m in weights
    ]


def quant_matmuls(x: jax.Array, weights: list, fmt: QuantFormat, impl: str = "auto") -> list:
    """float32 ``x (rows, in) @ W.T`` for each packed ``W`` of ``weights`` ((q, scales,
    mins) triples of one format): the CPU kernel (one call for all: one quantization of
    ``x``) or XLA (see the module's docstring); ``impl`` forces one (``kernel``: a CPU)."""
    if impl not in QUANT_IMPLS:
        raise ValueError(f"impl must be one of {QUANT_IMPLS}, got {impl!r}")
    weights = [tuple(w) for w in weights]
    if impl == "kernel":
        return list(_kernel(x, weights, fmt))
    if impl == "xla" or x.shape[0] > KERNEL_MAX_ROWS:
        return _xla(x, weights, fmt)
    return list(jax.lax.platform_dependent(
        x, weights, cpu=lambda x, w: list(_kernel(x, w, fmt)), default=lambda x, w: _xla(x, w, fmt),
    ))  # fmt: skip


def quant_matmul(
    x: jax.Array, q: jax.Array, scales: jax.Array, mins: jax.Array | None, fmt: QuantFormat,
    impl: str = "auto",
) -> jax.Array:  # fmt: skip
    """:func:`quant_matmuls` of one weight."""
    return quant_matmuls(x, [(q, scales, mins)], fmt, impl)[0]


def project(x: jax.Array, layers: list) -> list:
    """Each layer of ``layers`` (``nnx.Linear`` or :class:`QuantLinear`) applied to ``x``;
    packed layers of one format (and not split over devices) in one kernel call."""
    fused = (
        len(layers) > 1
        and all(isinstance(m, QuantLinear) and m.tp is None for m in layers)
        and len({m.fmt for m in layers}) == 1
    )
    if not fused:
        return [m(x) for m in layers]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    ys = quant_matmuls(x2, [m.weight() for m in layers], layers[0].fmt)
    return [
        m.finish(y.reshape(*lead, y.shape[-1]), x.dtype)
        for m, y in zip(layers, ys, strict=True)
    ]


def _param(shape: tuple[int, ...], dtype: Any) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, dtype))


class PackedWeight(nnx.Module):
    """``q``, ``scales`` and ``mins`` of a packed (out, in) weight, ``layers`` deep when
    stacked (0: not). ``tp``: (mesh, split "out" | "in") once sharded."""

    def __init__(self, out: int, inputs: int, fmt: QuantFormat, layers: int = 0) -> None:
        if inputs % fmt.group:
            raise ValueError(f"{inputs} inputs are not whole groups of {fmt.group}")
        lead = (layers,) if layers else ()
        cols = inputs if fmt.bits == 8 else inputs // 2
        self.q = _param((*lead, out, cols), jnp.int8 if fmt.bits == 8 else jnp.uint8)
        self.scales = _param((*lead, out, inputs // fmt.group), jnp.float16)
        self.mins = _param((*lead, out, inputs // fmt.group), jnp.float16) if fmt.has_min else None
        self.fmt = fmt
        self.features = (inputs, out)
        self.tp: tuple[Any, str] | None = None

    def packed_params(self) -> list[str]:
        return ["q", "scales"] + (["mins"] if self.mins is not None else [])

    def weight(self) -> Weight:
        return (self.q[...], self.scales[...], None if self.mins is None else self.mins[...])

    def matmul(self, x: jax.Array) -> jax.Array:
        """float32 ``x (..., in) @ W.T`` -> (..., out)."""
        lead = x.shape[:-1]
        args = (x.reshape(-1, x.shape[-1]), *self.weight())
        if self.tp is None:
            y = quant_matmul(*args, self.fmt)
        else:
            y = self._sharded(*args)
        return y.reshape(*lead, y.shape[-1])

    def _sharded(self, x, q, scales, mins):
        mesh, split = self.tp
        axis = mesh.axis_names[0]
        P = jax.sharding.PartitionSpec
        w = P(axis, None) if split == "out" else P(None, axis)
        xs = P() if split == "out" else P(None, axis)
        fmt = self.fmt

        def local(x, q, s, m):
            y = quant_matmul(x, q, s, m, fmt)
            return y if split == "out" else jax.lax.psum(y, axis)

        specs = (xs, w, w, None if mins is None else w)
        return jax.shard_map(
            local, mesh=mesh, in_specs=specs, out_specs=P(None, axis) if split == "out" else P(),
            check_vma=False,
        )(x, q, scales, mins)  # fmt: skip


class QuantLinear(PackedWeight):
    """``x @ W.T + bias`` over a packed weight; stands in for ``nnx.Linear``."""

    def __init__(
        self, inputs: int, out: int, fmt: QuantFormat, *, bias: bool, dtype: Any, layers: int = 0
    ) -> None:
        super().__init__(out, inputs, fmt, layers)
        lead = (layers,) if layers else ()
        self.bias = _param((*lead, out), dtype) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.finish(self.matmul(x), x.dtype)

    def finish(self, y: jax.Array, dtype: Any) -> jax.Array:
        """The float32 product plus the bias, in ``dtype``."""
        if self.bias is not None:
            y = y + self.bias[...].astype(jnp.float32)
        return y.astype(dtype)


class QuantEmbed(PackedWeight):
    """A packed token table (vocab, hidden): lookups dequantize the rows they gather;
    ``attend`` (tied logits) is a packed matmul. Stands in for ``nnx.Embed``."""

    def __init__(self, vocab: int, hidden: int, fmt: QuantFormat, *, dtype: Any) -> None:
        super().__init__(vocab, hidden, fmt)
        self.dtype = jnp.dtype(dtype)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        mins = None if self.mins is None else self.mins[...][tokens]
        rows = (self.q[...][tokens], self.scales[...][tokens], mins)
        return dequantize(*rows, self.fmt, jnp.float32).astype(self.dtype)

    def attend(self, x: jax.Array) -> jax.Array:
        return self.matmul(x).astype(x.dtype)


def split_entries(mod: Any, split: str, tp: int) -> list[tuple[object, str, int]]:
    """(module, attribute, axis) entries of a tensor-parallel plan that split a projection
    or token table (``nnx.Linear`` / ``nnx.Embed`` or packed) by its outputs (``"out"``,
    with the bias) or its inputs (``"in"``) over ``tp`` devices. A packed weight splits
    its values, scales and mins along the same axis; by inputs, each device's share must
    be whole groups (ValueError otherwise)."""
    if isinstance(mod, nnx.Embed):
        return [(mod, "embedding", 0)]
    if isinstance(mod, PackedWeight):
        ndim = len(mod.q.get_value().shape)
        if split == "in" and (mod.features[0] // tp) % mod.fmt.group:
            raise ValueError(
                f"tensor parallelism over {tp} devices splits {mod.features[0]} inputs into "
                f"{mod.features[0] // tp}, not whole groups of {mod.fmt.group} ({mod.fmt.name})"
            )
        axis = ndim - 2 if split == "out" else ndim - 1
        out = [(mod, name, axis) for name in mod.packed_params()]
    else:
        ndim = len(mod.kernel.get_value().shape)
        out = [(mod, "kernel", ndim - 1 if split == "out" else ndim - 2)]
    bias = getattr(mod, "bias", None)
    if split == "out" and bias is not None:
        out.append((mod, "bias", len(bias.get_value().shape) - 1))
    return out


def packed_leaves(state: Any) -> list[bool]:
    """For each leaf of a model's state (``jax.tree`` order): whether it is a packed
    layer's values, scales or mins."""
    names = ("q", "scales", "mins")
    out = []
    for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]:
        keys = [getattr(k, "key", None) for k in path]  # (..., "q", value attribute)
        out.append(any(k in names for k in keys[-2:]))
    return out


def packed_bytes(model: Any) -> int:
    """Bytes of a model's packed weights (q, scales, mins)."""
    total = 0
    for _, node in nnx.iter_graph(model):
        if isinstance(node, PackedWeight):
            for name in node.packed_params():
                v = getattr(node, name).get_value()
                total += int(np.prod(v.shape)) * jnp.dtype(v.dtype).itemsize
    return total
