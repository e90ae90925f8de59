"""A lean GGUF parser: the metadata and the tensor directory of a GGUF (v2 / v3,
little-endian) file, the tensor data as read-only slices of one memory map.

The ``gguf`` package's reader builds a numpy view for every part of every field, which
takes seconds for a 49k-token vocabulary; this one reads strings and arrays straight from
the bytes (a model's metadata in tens of milliseconds). Dequantization stays with
``gguf.quants``. Every read is bounds-checked: a truncated or malformed file is a
ValueError naming what could not be read.
"""

from __future__ import annotations

import dataclasses
import mmap
import struct
from typing import Any

import numpy as np

_MAGIC = b"GGUF"
# value type -> (struct format, size) for scalars
_SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
            6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}  # fmt: skip
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
          10: "<u8", 11: "<i8", 12: "<f8"}  # fmt: skip
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # GGUF order: innermost first
    tensor_type: int  # a GGMLQuantizationType value
    offset: int  # of its data, from the file's start
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """The numpy (row-major) shape: outermost first."""
        return tuple(reversed(self.dims))


class GGUFFile:
    """``metadata`` (key -> Python value: str, int, float, bool or list) and ``tensors``
    (name -> :class:`TensorInfo`) of a GGUF file; :meth:`data` the raw bytes of one."""

    def __init__(self, path: str) -> None:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        self.path = path
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size < 24:
                raise ValueError(f"{size} bytes: too short for a GGUF header")
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._buf = memoryview(self._map)
        self._pos = 0
        if bytes(self._take(4)) != _MAGIC:
            raise ValueError("no GGUF magic at the start")
        version = self._scalar(4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 and 3 are)")
        n_tensors, n_kv = self._scalar(10), self._scalar(10)
        if n_tensors > size or n_kv > size:  # each takes at least a byte
            raise ValueError(f"implausible counts: {n_tensors} tensors, {n_kv} metadata keys")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(self._scalar(4))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._scalar(4)
            if not 1 <= n_dims <= _MAX_DIMS:
                raise ValueError(f"tensor {name!r} has {n_dims} dimensions")
            dims = tuple(self._scalar(10) for _ in range(n_dims))
            infos.append((name, dims, self._scalar(4), self._scalar(10)))
        align = int(self.metadata.get("general.alignment", 32))
        if align <= 0 or align & (align - 1):
            raise ValueError(f"general.alignment {align} is not a power of two")
        start = -(-self._pos // align) * align
        self.tensors: dict[str, TensorInfo] = {}
        for name, dims, ttype, offset in infos:
            try:
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
            except (ValueError, KeyError):
                raise ValueError(f"tensor {name!r} has an unknown type {ttype}") from None
            n = int(np.prod(dims, dtype=object))
            if dims[0] % block:
                raise ValueError(f"tensor {name!r}: rows of {dims[0]} are not whole blocks")
            nbytes = n // block * type_size
            at = start + offset
            if at + nbytes > size:
                raise ValueError(f"tensor {name!r} runs past the end of the file")
            self.tensors[name] = TensorInfo(name, dims, ttype, at, nbytes)

    def data(self, t: TensorInfo) -> np.ndarray:
        """The tensor's raw bytes as ``gguf.quants.dequantize`` takes them: float arrays
        for F32 / F16 (numpy shape), uint8 rows of blocks for the others (read-only)."""
        raw = np.frombuffer(self._map, np.uint8, t.nbytes, t.offset)
        if t.tensor_type == 0:
            return raw.view("<f4").reshape(t.shape)
        if t.tensor_type == 1:
            return raw.view("<f2").reshape(t.shape)
        return raw.reshape(*t.shape[:-1], -1)

    # -- parsing -----------------------------------------------------------------------
    def _take(self, n: int) -> memoryview:
        end = self._pos + n
        if n < 0 or end > len(self._buf):
            raise ValueError(f"truncated: {n} bytes wanted at offset {self._pos}")
        out = self._buf[self._pos : end]
        self._pos = end
        return out

    def _scalar(self, vtype: int) -> Any:
        fmt, n = _SCALARS[vtype]
        return struct.unpack(fmt, self._take(n))[0]

    def _string(self) -> str:
        n = self._scalar(10)
        try:
            return str(self._take(n), "utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"a string at offset {self._pos - n} is not UTF-8: {e}") from None

    def _value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self._scalar(vtype)
        if vtype == _STRING:
            return self._string()
        if vtype != _ARRAY:
            raise ValueError(f"unknown metadata value type {vtype} at offset {self._pos}")
        etype, count = self._scalar(4), self._scalar(10)
        if etype in _NUMPY:
            size = _SCALARS[etype][1]
            values = np.frombuffer(self._take(count * size), _NUMPY[etype]).tolist()
            return [bool(v) for v in values] if etype == 7 else values
        if count > len(self._buf):
            raise ValueError(f"an array of {count} items cannot fit the file")
        return [self._value(etype) for _ in range(count)]
