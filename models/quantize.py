"""Packing a model's weights at load: which layers hold packed weights, in which format.

A checkpoint's tensors arrive dense (numpy) or packed (:class:`~.quant_format.Packed`,
from a quantized GGUF). :func:`pack_model` decides each projection's and token table's
format, swaps its ``nnx.Linear`` / ``nnx.Embed`` for a :class:`~.quant_linear.QuantLinear`
/ :class:`~.quant_linear.QuantEmbed`, and turns the tensors into what those hold:
- ``quantization=None``: packed tensors stay packed, dense ones stay dense;
- ``"int8"`` / ``"int4"``: every projection and token table in that format (rounded to
  nearest per group; a tensor already in it loads exactly);
- ``"none"``: nothing packed (a quantized GGUF is dequantized by its reader).
A stacked weight's layers share one format: the widest of theirs, to which the others
convert exactly. Every decision that is not byte for byte is logged.
"""

from __future__ import annotations

import collections
import logging
from typing import Any

from flax import nnx

from .quant_format import AT_LOAD, Packed, QuantFormat, convert, quantize, widest
from .quant_linear import PackedWeight, QuantEmbed, QuantLinear

log = logging.getLogger("jax_kvcached.models")

QUANTIZATIONS = (None, "none", "int8", "int4")


def check_quantization(quantization: str | None) -> None:
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")


def _packable(module: Any, attr: str) -> bool:
    return (isinstance(module, nnx.Linear) and attr == "kernel") or (
        isinstance(module, nnx.Embed) and attr == "embedding"
    )


def pack_model(model: Any, tensors: dict, quantization: str | None, path: str) -> None:
    """Swaps the modules that will hold packed weights and packs ``tensors`` (in place)
    for them; see the module's docstring. ValueError names a tensor that cannot be
    packed (its inputs not whole groups)."""
    check_quantization(quantization)
    at_load = AT_LOAD.get(quantization or "")
    per_module: dict[int, list[tuple[str, int | None]]] = collections.defaultdict(list)
    modules: dict[int, Any] = {}
    for name, (module, attr, _, index) in model.hf_weights().items():
        if name not in tensors:
            continue
        value = tensors[name]
        if isinstance(value, Packed) and not _packable(module, attr):
            raise ValueError(f"{path}: {name} is stored quantized ({value.source}), but its "
                             "layer cannot hold packed weights")  # fmt: skip
        if not _packable(module, attr) or not (isinstance(value, Packed) or at_load):
            continue
        if at_load is not None and not (isinstance(value, Packed) and value.fmt == at_load):
            value = value.dequantize() if isinstance(value, Packed) else value
            if value.shape[1] % at_load.group:
                raise ValueError(f"{path}: {name} {value.shape}: its {value.shape[1]} inputs "
                                 f"are not whole groups of {at_load.group}")  # fmt: skip
            tensors[name] = quantize(value, at_load)
        per_module[id(module)].append((name, index))
        modules[id(module)] = module
    notes: collections.Counter = collections.Counter()
    experts = any(type(node).__name__ == "MoE" for _, node in nnx.iter_graph(model))
    if at_load is not None and experts:  # (said, not silent: most of such a model's bytes)
        log.info("%s: the mixture-of-experts layers keep their experts in the model dtype "
                 "(packed experts are not supported yet)", path or "model")  # fmt: skip
    for key, names in per_module.items():
        fmt = widest([tensors[n].fmt for n, _ in names])
        for n, _ in names:
            p = tensors[n]
            if p.fmt != fmt:
                notes[f"{p.source} {p.fmt.name} -> {fmt.name} (a stacked weight's layers share "
                      "one format; exact)"] += 1  # fmt: skip
                tensors[n] = convert(p, fmt)
            notes[f"{tensors[n].source} -> {fmt.name}"] += 1
        _swap(model, modules[key], _packed_module(modules[key], fmt, names))
    for note, count in sorted(notes.items()):
        log.info("%s: packed weights: %s (%d tensors)", path or "model", note, count)


def _packed_module(module: Any, fmt: QuantFormat, names: list) -> PackedWeight:
    """The packed stand-in for ``module`` (shapes only: the loader fills the values)."""
    stacked = names[0][1] is not None
    if isinstance(module, nnx.Embed):
        vocab, hidden = module.embedding.get_value().shape
        dtype = module.embedding.get_value().dtype
        return nnx.eval_shape(lambda: QuantEmbed(vocab, hidden, fmt, dtype=dtype))
    kernel = module.kernel.get_value()
    inputs, out = kernel.shape[-2:]
    layers = kernel.shape[0] if stacked else 0
    bias = module.bias is not None
    return nnx.eval_shape(
        lambda: QuantLinear(inputs, out, fmt, bias=bias, dtype=kernel.dtype, layers=layers)
    )


def _swap(model: Any, old: Any, new: Any) -> None:
    for path, node in nnx.iter_graph(model):
        if node is old:
            parent = model
            for key in path[:-1]:
                parent = getattr(parent, key) if isinstance(key, str) else parent[key]
            setattr(parent, path[-1], new)
            return
    raise ValueError("module to replace not found in the model")


def packed_targets(targets: dict, tensors: dict, path: str) -> dict:
    """``targets`` (HF name -> (module, attr, transpose, index)) with each packed layer's
    weight entry replaced by one per array it holds (values, scales, mins: ``NAME:q``...),
    and ``tensors`` likewise, so the loader copies them as it copies any parameter. Checks
    that each tensor is packed in its layer's format and shape."""
    out = {}
    for name, (module, attr, transpose, index) in targets.items():
        if not isinstance(module, PackedWeight) or attr == "bias":
            out[name] = (module, attr, transpose, index)
            continue
        p = tensors.pop(name)
        if not isinstance(p, Packed):
            raise ValueError(f"{path}: {name} is not packed but its layer is")
        inputs, n = module.features
        if p.shape != (n, inputs) or p.fmt != module.fmt:
            raise ValueError(f"{path}: {name}: {p.fmt.name} {p.shape} != the layer's "
                             f"{module.fmt.name} {(n, inputs)}")  # fmt: skip
        arrays = {"q": p.q, "scales": p.scales, "mins": p.mins}
        for array in module.packed_params():
            out[f"{name}:{array}"] = (module, array, False, index)
            tensors[f"{name}:{array}"] = arrays[array]
    return out
