"""A GGUF file's header read quickly: metadata, tensor table, tensors as memory-mapped views.

``gguf.GGUFReader`` builds numpy views for every part of every field; for SmolLM2's tokenizer
(49,152 tokens, 48,900 merges) that is about 2.6 s of a 2-core machine, most of the model
import of a first start (``bench/first_start.py``). This reads the same header with ``struct``
from the memory map in a few tens of milliseconds. The tensors it gives are what
``GGUFReader`` gives (same dtypes and shapes: quantized types as ``uint8`` rows of bytes), so
``gguf.quants.dequantize`` decodes them as before; ``tests/test_gguf.py`` checks that both
readers agree on every key and tensor. The type table is the format's (``GGML_TYPES``,
as ``gguf.GGML_QUANT_SIZES``; an id it lacks is looked up there), so reading a file does not
import the ``gguf`` package (2.8 MiB of RSS, 3.7 with the yaml it imports): its dequantizers
are imported where float32 weights are made of quantized ones. ``GGUFFile.read`` copies one
tensor's bytes with a plain file read (the GGUF weight loader, ``disagg.model.gguf_weights``,
uses it so that the file's pages never count in the worker's resident memory).

Layout (GGUF v2/v3, little-endian)::

    "GGUF" | version u32 | tensor_count u64 | kv_count u64
    kv_count x   (key: string, value_type u32, value)
    tensor_count x (name: string, n_dims u32, dims u64 x n_dims, ggml_type u32, offset u64)
    padding to general.alignment (default 32) | tensor data (each at data_start + offset)

    string = length u64 + UTF-8 bytes; array = element type u32 + count u64 + elements
"""

from __future__ import annotations

import enum
import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# GGUF value type -> struct format (little-endian) of one scalar; 8 string, 9 array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# ggml types GGUFReader exposes as typed arrays (the others: uint8 bytes, quantized)
_PLAIN_TYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8,
                "I16": np.int16, "I32": np.int32, "I64": np.int64}


# ggml tensor types: id -> (name, weights per block, bytes per block), as ggml's type traits
# (``gguf.GGML_QUANT_SIZES``).
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
}
# The tensor type as an int enum: equal to gguf.GGMLQuantizationType's member of the same id.
GGMLType = enum.IntEnum("GGMLType", {name: i for i, (name, _, _) in GGML_TYPES.items()})


def ggml_type(raw_type: int) -> tuple[Any, int, int]:
    """``(type, weights per block, bytes per block)`` of ggml type id ``raw_type``; an id
    ``GGML_TYPES`` lacks (a newer ggml's) from the ``gguf`` package. ValueError if neither
    knows it."""
    if raw_type in GGML_TYPES:
        _, block, size = GGML_TYPES[raw_type]
        return GGMLType(raw_type), block, size
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    qtype = GGMLQuantizationType(raw_type)  # ValueError when unknown
    block, size = GGML_QUANT_SIZES[qtype]
    return qtype, block, size


class GGUFFormatError(ValueError):
    """The bytes are not a GGUF file this reader handles; the message says where."""


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: ``shape`` in GGUF order (innermost first, as ``ReaderTensor.shape``),
    ``tensor_type`` a ``gguf.GGMLQuantizationType``, ``data`` a view of the file."""

    name: str
    shape: tuple[int, ...]
    tensor_type: Any
    data: np.ndarray
    offset: int = 0  # of the tensor's first byte in the file


class _Cursor:
    """Reads values at an advancing offset of ``buf``."""

    def __init__(self, buf: mmap.mmap, path: str) -> None:
        self.buf, self.path, self.pos = buf, path, 0

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise GGUFFormatError(f"{self.path}: truncated header (at byte {self.pos})")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.take("<Q")
        end = self.pos + n
        if end > len(self.buf):
            raise GGUFFormatError(f"{self.path}: truncated string (at byte {self.pos})")
        text = str(self.buf[self.pos:end], "utf-8")
        self.pos = end
        return text

    def value(self, vtype: int, key: str) -> Any:
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype != _ARRAY:
            raise GGUFFormatError(f"{self.path}: key {key!r} has unknown value type {vtype}")
        etype, count = self.take("<I"), self.take("<Q")
        if etype == _STRING:
            return [self.string() for _ in range(count)]
        if etype in _SCALARS:  # one numpy read for the whole array
            dtype = np.dtype(_SCALARS[etype])
            end = self.pos + count * dtype.itemsize
            if end > len(self.buf):
                raise GGUFFormatError(f"{self.path}: truncated array {key!r}")
            out = np.frombuffer(self.buf, dtype, count, self.pos).tolist()
            self.pos = end
            return out
        return [self.value(etype, key) for _ in range(count)]  # arrays of arrays


class GGUFFile:
    """``metadata`` (key -> Python value) and ``tensors`` (file order) of the GGUF ``path``.

    The tensors' data are views of a read-only memory map that lives as long as they do.
    Raises ``GGUFFormatError`` (bad magic, unsupported version or endianness, truncation) and
    ``OSError``."""

    def __init__(self, path: str) -> None:
        with open(path, "rb") as f:
            try:
                buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError:  # an empty file cannot be mapped
                raise GGUFFormatError(f"{path}: empty file") from None
        self.path = path
        cur = _Cursor(buf, path)
        if len(buf) < 24 or buf[:4] != MAGIC:
            raise GGUFFormatError(f"{path}: no GGUF magic")
        cur.pos = 4
        version = cur.take("<I")
        if version & 0xFFFF == 0:
            raise GGUFFormatError(f"{path}: a big-endian GGUF file (not supported)")
        if version not in VERSIONS:
            raise GGUFFormatError(f"{path}: GGUF version {version} (supported: "
                                  f"{', '.join(map(str, VERSIONS))})")
        n_tensors, n_kv = cur.take("<Q"), cur.take("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.take("<I"), key)
        table = [self._tensor_info(cur) for _ in range(n_tensors)]
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise GGUFFormatError(f"{path}: general.alignment = {alignment!r} is not a power "
                                  f"of two")
        start = -(-cur.pos // alignment) * alignment  # round up to the alignment
        array = np.frombuffer(buf, np.uint8)
        self.tensors = [self._tensor(array, start, *info, path) for info in table]

    @staticmethod
    def _tensor_info(cur: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
        name = cur.string()
        dims = tuple(cur.take("<Q") for _ in range(cur.take("<I")))
        return name, dims, cur.take("<I"), cur.take("<Q")

    @staticmethod
    def _tensor(array: np.ndarray, start: int, name: str, dims: tuple[int, ...],
                raw_type: int, offset: int, path: str) -> GGUFTensor:
        try:
            qtype, block, type_size = ggml_type(raw_type)
        except ValueError:
            raise GGUFFormatError(f"{path}: tensor {name!r} has unknown ggml type "
                                  f"{raw_type}") from None
        n_elems = int(np.prod(dims, dtype=np.int64))
        n_bytes = n_elems * type_size // block
        # Tensor bytes: [start + offset, start + offset + n_bytes) of the file.
        begin = start + offset
        if begin + n_bytes > array.size:
            raise GGUFFormatError(f"{path}: tensor {name!r} runs past the end of the file")
        raw = array[begin:begin + n_bytes]
        np_shape = tuple(reversed(dims))  # numpy order: GGUF's dims reversed
        plain = _PLAIN_TYPES.get(qtype.name)
        if plain is not None:
            data = raw.view(plain).reshape(np_shape)
        else:
            # rows of bytes: [..., K] weights -> [..., K / block * type_size] bytes
            if np_shape[-1] % block:
                raise GGUFFormatError(f"{path}: tensor {name!r}: rows of {np_shape[-1]} are "
                                      f"not whole {qtype.name} blocks of {block}")
            data = raw.reshape(*np_shape[:-1], np_shape[-1] // block * type_size)
        return GGUFTensor(name, dims, qtype, data, begin)

    def read(self, tensor: GGUFTensor) -> np.ndarray:
        """A copy of ``tensor``'s data (same dtype and shape as ``tensor.data``), read from the
        file rather than through the memory map: pages read through the map stay resident in
        this process (its RSS) until the map closes, which would hold a second copy of every
        tensor a loader has already converted."""
        out = np.empty(tensor.data.shape, tensor.data.dtype)
        with open(self.path, "rb") as f:
            f.seek(tensor.offset)
            view = memoryview(out.reshape(-1).view(np.uint8))
            if f.readinto(view) != out.nbytes:
                raise GGUFFormatError(f"{self.path}: tensor {tensor.name!r} is truncated")
        return out
