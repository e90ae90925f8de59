"""Packed int8 / int4 weights on the host: the format, rounding to nearest, GGUF blocks.

A weight ``W`` (outputs, inputs), ``inputs`` a multiple of 32, is kept as
- ``q``: int8 ``(out, in)``, or for int4 uint8 ``(out, in / 2)``: per 32-block of a row 16
  bytes, byte ``j`` holding element ``j`` in its low nibble and ``j + 16`` in its high one
  (GGUF's Q4_0 / Q4_1 layout, so those load byte for byte);
- ``scales``: float16 ``(out, in / group)``, ``group`` a multiple of 32;
- ``mins``: float16 like the scales, or None.

Values: int8 ``q * scale (+ min)``; int4 symmetric ``(u - 8) * scale``, with mins
``u * scale + min`` (``u`` the nibble, 0..15). GGUF's Q8_0, Q4_0 and Q4_1 are these
formats with group 32, exactly; its other quantized types load into the nearest
(:func:`nearest_format`): a requantization, which the load log names.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

BLOCK = 32  # the kernels' block: a group is a multiple of it


@dataclasses.dataclass(frozen=True)
class QuantFormat:
    """``bits`` 8 or 4; ``group`` inputs per scale; ``has_min``: a float min per group."""

    bits: int
    group: int = BLOCK
    has_min: bool = False

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"packed weights have 4 or 8 bits, not {self.bits}")
        if self.group <= 0 or self.group % BLOCK:
            raise ValueError(f"a group must be a positive multiple of {BLOCK}, got {self.group}")

    @property
    def name(self) -> str:
        return f"int{self.bits}" + ("+min" if self.has_min else "") + f"/g{self.group}"

    def bits_per_weight(self) -> float:
        return self.bits + 16 * (1 + self.has_min) / self.group


INT8 = QuantFormat(8)
INT4 = QuantFormat(4)  # symmetric (GGUF's Q4_0)
INT4_MIN = QuantFormat(4, has_min=True)  # with mins (GGUF's Q4_1)
# What ``quantization=`` names when quantizing full-precision weights at load. int4 keeps
# a min per group (5 bits a weight, not 4.5): re-rounding SmolLM2's Q4_1 weights to the
# symmetric grid cost 34% perplexity, to this one 7% (tests/test_quant.py measures).
AT_LOAD = {"int8": INT8, "int4": INT4_MIN}


@dataclasses.dataclass
class Packed:
    """One packed weight on the host (HF layout: rows are outputs). ``source`` says where
    it came from (a GGUF type, or ``quantized at load``)."""

    fmt: QuantFormat
    q: np.ndarray
    scales: np.ndarray
    mins: np.ndarray | None
    source: str = ""

    def __post_init__(self) -> None:
        out, cols = self.q.shape
        want = np.int8 if self.fmt.bits == 8 else np.uint8
        if self.q.dtype != want:
            raise ValueError(f"{self.fmt.name} values must be {np.dtype(want).name}")
        inputs = cols if self.fmt.bits == 8 else 2 * cols
        if inputs % self.fmt.group:
            raise ValueError(f"{inputs} inputs are not whole groups of {self.fmt.group}")
        groups = (out, inputs // self.fmt.group)
        if self.scales.shape != groups or self.scales.dtype != np.float16:
            raise ValueError(f"scales must be float16 {groups}, got {self.scales.dtype} "
                             f"{self.scales.shape}")  # fmt: skip
        if (self.mins is not None) != self.fmt.has_min:
            raise ValueError(f"{self.fmt.name}: mins {'missing' if self.fmt.has_min else 'given'}")
        if self.mins is not None and (self.mins.shape != groups or self.mins.dtype != np.float16):
            raise ValueError(f"mins must be float16 {groups}, got {self.mins.dtype} "
                             f"{self.mins.shape}")  # fmt: skip

    @property
    def shape(self) -> tuple[int, int]:
        out, cols = self.q.shape
        return (out, cols if self.fmt.bits == 8 else 2 * cols)

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scales.nbytes + (0 if self.mins is None else self.mins.nbytes)

    def take_rows(self, index: np.ndarray) -> Packed:
        """The rows (outputs) ``index`` picks, in its order (exact)."""
        mins = None if self.mins is None else self.mins[index]
        return Packed(self.fmt, self.q[index], self.scales[index], mins, self.source)

    def dequantize(self) -> np.ndarray:
        """The float32 weight (out, in)."""
        return dequantize(self.q, self.scales, self.mins, self.fmt)


def unpack_int4(q: Any, xp: Any = np) -> Any:
    """uint8 (..., in / 2) in the nibble layout -> nibbles (..., in) as uint8 (``xp``:
    numpy, or ``jax.numpy`` inside a traced step)."""
    blocks = q.reshape(*q.shape[:-1], -1, BLOCK // 2)
    u = xp.concatenate([blocks & 0x0F, blocks >> 4], axis=-1)
    return u.reshape(*q.shape[:-1], q.shape[-1] * 2)


def pack_int4(u: np.ndarray) -> np.ndarray:
    """Nibbles (..., in), values 0..15 -> uint8 (..., in / 2) in the nibble layout."""
    blocks = u.astype(np.uint8).reshape(*u.shape[:-1], -1, 2, BLOCK // 2)
    return (blocks[..., 0, :] | (blocks[..., 1, :] << 4)).reshape(*u.shape[:-1], -1)


def levels(q: Any, fmt: QuantFormat, dtype: Any = np.float32, xp: Any = np) -> Any:
    """The integer each weight stands for before its scale: int8 q, int4 u - 8 (symmetric)
    or u (with mins), in ``dtype`` (..., in)."""
    if fmt.bits == 8:
        return q.astype(dtype)
    u = unpack_int4(q, xp).astype(dtype)
    return u if fmt.has_min else u - 8


def dequantize(q: Any, scales: Any, mins: Any, fmt: QuantFormat, dtype: Any = np.float32,
               xp: Any = np) -> Any:  # fmt: skip
    """Packed (..., out, cols) -> the weight (..., out, in) in ``dtype``; with ``xp`` =
    ``jax.numpy`` the expression XLA folds into a dot (``quant_linear``)."""
    v = levels(q, fmt, dtype, xp)
    shape = v.shape
    v = v.reshape(*shape[:-1], -1, fmt.group) * scales.astype(dtype)[..., None]
    if mins is not None:
        v = v + mins.astype(dtype)[..., None]
    return v.reshape(shape)


def quantize(w: np.ndarray, fmt: QuantFormat, source: str = "quantized at load") -> Packed:
    """Round to nearest per group (llama.cpp's rules). int8: scale max|w| / 127. int4
    symmetric: scale m / -8 for the value m of largest magnitude; with mins: (max - min)
    / 15 and the min. Scales are rounded to float16 first and the values quantized against
    them, so ``dequantize`` gives back what the rounding chose."""
    w = np.asarray(w, np.float32)
    if w.ndim != 2 or w.shape[1] % fmt.group:
        raise ValueError(f"a weight of shape {w.shape} is not (outputs, whole groups of "
                         f"{fmt.group} inputs)")  # fmt: skip
    g = w.reshape(w.shape[0], -1, fmt.group)
    mins = None
    if fmt.bits == 8:
        d = (np.abs(g).max(-1) / 127.0).astype(np.float16)
        mins = np.zeros_like(d) if fmt.has_min else None
        lo, hi, offset = -127, 127, 0.0
    elif fmt.has_min:
        mn, mx = g.min(-1), g.max(-1)
        d = ((mx - mn) / 15.0).astype(np.float16)
        mins = mn.astype(np.float16)
        g = g - mins.astype(np.float32)[..., None]
        lo, hi, offset = 0, 15, 0.0
    else:
        at = np.abs(g).argmax(-1)[..., None]
        m = np.take_along_axis(g, at, -1)[..., 0]
        d = (m / -8.0).astype(np.float16)
        lo, hi, offset = 0, 15, 8.0
    df = d.astype(np.float32)[..., None]
    inv = np.divide(1.0, df, out=np.zeros_like(df), where=df != 0)
    v = np.clip(np.rint(g * inv) + offset, lo, hi).reshape(w.shape)
    q = v.astype(np.int8) if fmt.bits == 8 else pack_int4(v.astype(np.uint8))
    return Packed(fmt, q, d, mins, source)


def convert(p: Packed, fmt: QuantFormat) -> Packed:
    """``p`` in a format at least as wide, exactly: a smaller group repeats the scales;
    symmetric int4 -> int4 with mins (min = -8 scale); int4 -> int8 (its levels)."""
    if p.fmt == fmt:
        return p
    if fmt.bits < p.fmt.bits or p.fmt.group % fmt.group or (p.fmt.has_min and not fmt.has_min):
        raise ValueError(f"{p.fmt.name} does not convert exactly to {fmt.name}")
    rep = p.fmt.group // fmt.group
    scales = np.repeat(p.scales, rep, axis=1)
    mins = None if p.mins is None else np.repeat(p.mins, rep, axis=1)
    if fmt.bits == 8:
        q = p.q if p.fmt.bits == 8 else levels(p.q, p.fmt).astype(np.int8)
        if fmt.has_min and mins is None:
            mins = np.zeros_like(scales)
    else:
        q = p.q
        if fmt.has_min and mins is None:  # (u - 8) s = u s + (-8 s), exact in float16
            mins = (scales.astype(np.float32) * -8.0).astype(np.float16)
    return Packed(fmt, q, scales, mins, p.source)


def widest(formats: list[QuantFormat]) -> QuantFormat:
    """The one format every one of ``formats`` converts to exactly (a stacked weight's
    layers share one)."""
    group = min(f.group for f in formats)
    if any(f.group % group for f in formats):
        raise ValueError(f"group sizes {sorted({f.group for f in formats})} do not nest")
    return QuantFormat(max(f.bits for f in formats), group, any(f.has_min for f in formats))


# -- GGUF blocks ---------------------------------------------------------------------------
# type name -> (bytes per 32-block, format); GGUF stores a float16 d (and m) then the values.
GGUF_EXACT = {"Q8_0": (34, QuantFormat(8)), "Q4_0": (18, QuantFormat(4)),
              "Q4_1": (20, QuantFormat(4, has_min=True))}  # fmt: skip
# Types that load requantized: into the nearest packed format.
GGUF_NEAREST = {"Q4_K": QuantFormat(4, has_min=True), "Q5_0": INT8, "Q5_1": INT8,
                "Q5_K": INT8, "Q6_K": INT8}  # fmt: skip


def nearest_format(type_name: str) -> QuantFormat | None:
    """The packed format a GGUF type loads into (None: a float type)."""
    if type_name in GGUF_EXACT:
        return GGUF_EXACT[type_name][1]
    return GGUF_NEAREST.get(type_name)


def from_gguf_blocks(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> Packed:
    """A Q8_0 / Q4_0 / Q4_1 tensor's raw bytes (rows of blocks) as packed, byte for byte."""
    size, fmt = GGUF_EXACT[type_name]
    out, inputs = shape
    blocks = np.ascontiguousarray(raw).reshape(out, inputs // BLOCK, size)
    scales = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0]
    mins = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0] if fmt.has_min else None
    start = 4 if fmt.has_min else 2
    values = np.ascontiguousarray(blocks[..., start:]).reshape(out, -1)
    q = values.view(np.int8) if fmt.bits == 8 else values
    return Packed(fmt, q, scales, mins, type_name)


# -- the kernel's arithmetic, in numpy (tests hold the kernels to it) ----------------------
LO = 256  # hi's weight in units of lo (activations: two int8 planes)


def quantize_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows of x (rows, in) as the kernel rounds them, per 32-block: two int8 planes, hi =
    rint(x / s) with s = max|x| / 127 and lo = rint((x - s hi) 256 / s), clamped to 127;
    returns the combined integers 256 hi + lo (int32, about 16 bits) and their unit
    s / 256."""
    b = np.asarray(x, np.float32).reshape(x.shape[0], x.shape[1] // BLOCK, BLOCK)
    d = (np.abs(b).max(-1) / np.float32(127)).astype(np.float32)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)[..., None]
    hi = np.clip(np.rint(b * inv), -127, 127).astype(np.float32)
    lo = np.clip(np.rint((b - hi * d[..., None]) * inv * np.float32(LO)), -127, 127)
    combined = (hi.astype(np.int32) * LO + lo.astype(np.int32)).reshape(x.shape)
    return combined, (d / np.float32(LO)).astype(np.float32)


def reference_matmul(x: np.ndarray, p: Packed) -> np.ndarray:
    """``x @ W.T`` as the kernels compute it: activations rounded per 32-block
    (:func:`quantize_activations`), exact integer dots per block, float scales (float64
    sums here)."""
    xq, d = quantize_activations(x)
    lv = levels(p.q, p.fmt).astype(np.float64)  # (out, in)
    rows = xq.shape[0]
    xb = xq.astype(np.float64).reshape(rows, xq.shape[1] // BLOCK, BLOCK)
    wb = lv.reshape(lv.shape[0], -1, BLOCK)
    dots = np.einsum("rbj,obj->rob", xb, wb)  # exact integer dots per block
    per = p.fmt.group // BLOCK
    s = np.repeat(p.scales.astype(np.float64), per, axis=1)  # (out, blocks)
    y = np.einsum("rob,ob,rb->ro", dots, s, d.astype(np.float64))
    if p.mins is not None:
        sums = xb.sum(-1) * d  # (rows, blocks)
        y += sums @ np.repeat(p.mins.astype(np.float64), per, axis=1).T
    return y.astype(np.float32)


# MXFP4 (OCP microscaling, GPT-OSS's experts): 4-bit e2m1 values, two to a byte (low
# nibble first), 32 to a block sharing one e8m0 scale (2 ** (byte - 127)).
FP4_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)  # fmt: skip


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MXFP4 ``blocks`` ``(..., rows, G, 16)`` uint8 and ``scales`` ``(..., rows, G)``
    uint8 as float32 ``(..., G * 32, rows)``: each row's inputs along the second-last axis,
    the layout transformers' GPT-OSS experts hold (``gate_up_proj`` ``(E, hidden, 2I)``)."""
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8 or blocks.shape[-1] != 16:
        raise ValueError(
            f"mxfp4: blocks must be uint8 (..., 16) and scales uint8, got "
            f"{blocks.dtype} {blocks.shape}, {scales.dtype} {scales.shape}"
        )
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"mxfp4: blocks {blocks.shape} do not match scales {scales.shape}")
    out = np.empty((*blocks.shape[:-1], 32), np.float32)
    out[..., 0::2] = FP4_E2M1[blocks & 0x0F]
    out[..., 1::2] = FP4_E2M1[blocks >> 4]
    out = np.ldexp(out, scales.astype(np.int32)[..., None] - 127)
    out = out.reshape(*blocks.shape[:-2], blocks.shape[-2] * 32)  # (..., rows, inputs)
    return np.ascontiguousarray(np.swapaxes(out, -1, -2))
