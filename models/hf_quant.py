"""Hugging Face folders whose ``config.json`` carries a ``quantization_config``: their
packed tensors read into :class:`~.quant_format.Packed`, never dequantized.

- AWQ (GEMM layout, 4 bits): ``qweight`` int32 (in, out / 8), eight output columns per
  word in the order 0 2 4 6 1 3 5 7; ``qzeros`` likewise per group; ``scales`` (groups,
  out). ``w = (q - z) s``.
- GPTQ (4 bits, v1 and v2 checkpoints): ``qweight`` int32 (in / 8, out), eight input rows
  per word in order; ``qzeros`` (groups, out / 8) in order, stored minus one in v1;
  ``scales``; ``g_idx`` must be the plain one (act-order weights are refused).
- compressed-tensors: ``pack-quantized`` symmetric int4 (``weight_packed`` int32 (out,
  in / 8), eight inputs per word, stored + 8; ``weight_scale``) and ``int-quantized``
  int8 (``weight`` int8, ``weight_scale`` per channel or group).

4-bit weights with zero points load as int4 with mins (``min = -z s``, rounded to
float16), symmetric ones as int4 or int8 exactly. Anything else fails naming the tensor.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .quant_format import Packed, QuantFormat, pack_int4

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # column of nibble i within a word


def _nibbles(words: np.ndarray) -> np.ndarray:
    """int32 (..., n) -> the 8 nibbles of each word, (..., n, 8), nibble i at bits 4i."""
    w = words.astype(np.uint32)[..., None]
    return ((w >> (4 * np.arange(8, dtype=np.uint32))) & 0xF).astype(np.uint8)


def _int4(u: np.ndarray, scales: np.ndarray, zeros: np.ndarray | None, group: int,
          source: str) -> Packed:  # fmt: skip
    """Nibbles u (out, in), scales (out, groups) and zero points (out, groups) or None
    (symmetric: zero 8) as packed int4."""
    s = scales.astype(np.float16)
    if zeros is None:
        return Packed(QuantFormat(4, group), pack_int4(u), s, None, source)
    mins = (-zeros.astype(np.float32) * s.astype(np.float32)).astype(np.float16)
    return Packed(QuantFormat(4, group, True), pack_int4(u), s, mins, source)


def _check(name: str, cond: bool, why: str) -> None:
    if not cond:
        raise ValueError(f"{name}: {why}")


def read_quantized(tensors: dict[str, np.ndarray], qcfg: dict[str, Any], path: str) -> None:
    """Replaces, in place, every quantized layer's tensors by ``PREFIX.weight``: a
    :class:`Packed`. ValueError names the method, field or tensor it cannot read."""
    method = str(qcfg.get("quant_method", "")).lower()
    for k, v in tensors.items():
        tensors[k] = np.asarray(v)
    if method == "awq":
        _awq(tensors, qcfg, path)
    elif method == "gptq":
        _gptq(tensors, qcfg, path)
    elif method == "compressed-tensors":
        _compressed(tensors, qcfg, path)
    else:
        raise ValueError(f"{path}: quantization_config quant_method {method!r} is not supported "
                         "(awq, gptq, compressed-tensors)")  # fmt: skip


def _prefixes(tensors: dict, suffix: str) -> list[str]:
    return sorted(k[: -len(suffix)] for k in tensors if k.endswith(suffix))


def _awq(tensors: dict, qcfg: dict, path: str) -> None:
    bits = int(qcfg.get("bits", qcfg.get("w_bit", 4)))
    group = int(qcfg.get("group_size", qcfg.get("q_group_size", 128)))
    version = str(qcfg.get("version", "gemm")).lower()
    if bits != 4 or version != "gemm":
        raise ValueError(f"{path}: AWQ {bits}-bit {version!r} is not supported (4-bit GEMM)")
    for p in _prefixes(tensors, ".qweight"):
        q, z, s = (tensors.pop(p + x) for x in (".qweight", ".qzeros", ".scales"))
        inputs, words = q.shape
        _check(p + ".qweight", inputs % group == 0, f"{inputs} inputs, not whole groups of {group}")
        order = np.argsort(AWQ_ORDER)  # nibble index holding each column
        u = _nibbles(q)[..., order].reshape(inputs, words * 8)  # (in, out)
        zz = _nibbles(z)[..., order].reshape(z.shape[0], -1)
        _check(p + ".scales", s.shape == (inputs // group, words * 8), f"shape {s.shape}")
        tensors[p + ".weight"] = _int4(u.T, s.T, zz.T, group, "AWQ")


def _gptq(tensors: dict, qcfg: dict, path: str) -> None:
    bits = int(qcfg.get("bits", 4))
    group = int(qcfg.get("group_size", 128))
    v1 = str(qcfg.get("checkpoint_format", "gptq")).lower() == "gptq"
    if bits != 4:
        raise ValueError(f"{path}: GPTQ {bits}-bit weights are not supported (4-bit)")
    for p in _prefixes(tensors, ".qweight"):
        q, z, s = (tensors.pop(p + x) for x in (".qweight", ".qzeros", ".scales"))
        rows, out = q.shape
        inputs = rows * 8
        group_ = inputs if group == -1 else group
        g_idx = tensors.pop(p + ".g_idx", None)
        if g_idx is not None:
            _check(p + ".g_idx", np.array_equal(np.asarray(g_idx), np.arange(inputs) // group_),
                   "act-order (desc_act) weights are not supported")  # fmt: skip
        u = _nibbles(q.T).reshape(out, inputs)  # input row 8r + j at nibble j of word r
        zz = _nibbles(z).reshape(z.shape[0], -1).astype(np.int32) + (1 if v1 else 0)
        _check(p + ".scales", s.shape == (inputs // group_, out), f"shape {s.shape}")
        tensors[p + ".weight"] = _int4(u, s.T, zz.T, group_, "GPTQ")


def _compressed(tensors: dict, qcfg: dict, path: str) -> None:
    fmt = str(qcfg.get("format", "")).lower()
    groups = list((qcfg.get("config_groups") or {}).values())
    weights = (groups[0].get("weights") or {}) if groups else {}
    if fmt not in ("pack-quantized", "int-quantized") or not weights:
        raise ValueError(f"{path}: compressed-tensors format {fmt!r} is not supported "
                         "(pack-quantized int4, int-quantized int8)")  # fmt: skip
    if not weights.get("symmetric", True):
        raise ValueError(f"{path}: compressed-tensors asymmetric weights are not supported")
    if fmt == "pack-quantized":
        for p in _prefixes(tensors, ".weight_packed"):
            q, s = tensors.pop(p + ".weight_packed"), tensors.pop(p + ".weight_scale")
            tensors.pop(p + ".weight_shape", None)
            out, words = q.shape
            inputs = words * 8
            u = _nibbles(q).reshape(out, inputs)  # stored q + 8: our symmetric nibble
            group = inputs // s.shape[1]
            _check(p + ".weight_scale", s.shape[0] == out and inputs % s.shape[1] == 0,
                   f"shape {s.shape}")  # fmt: skip
            tensors[p + ".weight"] = _int4(u, s, None, group, "compressed-tensors int4")
        return
    for p in _prefixes(tensors, ".weight_scale"):
        w, s = tensors.pop(p + ".weight"), tensors.pop(p + ".weight_scale")
        out, inputs = w.shape
        _check(p + ".weight", w.dtype == np.int8, f"dtype {w.dtype}, not int8")
        per_row = s.reshape(out, -1).shape[1] if s.shape[0] == out else 0
        _check(p + ".weight_scale", per_row > 0 and inputs % per_row == 0, f"shape {s.shape}")
        s = s.reshape(out, -1).astype(np.float16)
        tensors[p + ".weight"] = Packed(QuantFormat(8, inputs // s.shape[1]), w, s, None,
                                        "compressed-tensors int8")  # fmt: skip
