"""GGUF quantized blocks decoded into the layouts the CPU kernels read (numpy; torch-free).

Each decoder takes a tensor's raw bytes as stored (``GGUFWeights.raw``: ``[N, K / block *
bytes per block]`` uint8, rows in the file's order) and returns arrays whose weights are the
GGUF ones exactly (``tests/test_gguf_quantized.py`` checks them against ``gguf.quants``):

- **Q8_0** (34 bytes per 32: fp16 d, 32 x int8 q): ``(q int8 [N, K], d float32 [N, K / 32])``,
  ``w = d * q``.
- **Q4_0 / Q4_1 / Q4_K**: ``(codes uint8 [N, K] in 0..15, scale, zero float32 [N, K / 32])``,
  ``w = (codes - 8) * scale + zero``: the group-32 form of ``aten._weight_int4pack_mm_for_cpu``.

  ====== ============================= ============ ===================
  type   block                         scale        zero
  ====== ============================= ============ ===================
  Q4_0   d f16, 16 bytes of nibbles     d            0
  Q4_1   d f16, m f16, 16 bytes         d            m + 8 d
  Q4_K   256 = 8 x 32: d, dmin f16,     d sc_j       8 d sc_j - dmin m_j
         6-bit sc_j / m_j, 128 bytes
  ====== ============================= ============ ===================

  (Q4_0: w = d (q - 8); Q4_1: w = d q + m; Q4_K: w = d sc_j q - dmin m_j.) A block of 32 keeps
  element j in the low nibble of byte j and element j + 16 in the high one; a Q4_K
  super-block keeps sub-blocks 2i and 2i + 1 in the low and high nibbles of bytes
  [32 i, 32 i + 32).

``decode`` dispatches by type name; other types have no quantized kernel here (they are
dequantized to float32 by the loader).

``kernel_blocks`` gives the blocks ``csrc/quant_gemm.h``'s kernel reads (``quant.BlockWeight``):
Q4_0, Q4_1 and Q8_0 the file's bytes as they are (``[N, K / 32 * block bytes]``); Q4_K as
``Q4F`` blocks of 32 (float32 d = d_K sc_j and m = -dmin m_j, then 16 bytes of nibbles laid out
as Q4_0's: element j low, j + 16 high), 24 bytes each: exactly its weights, each product of an
fp16 and a 6-bit integer being exact in float32.
"""

from __future__ import annotations

import numpy as np

QK = 32  # weights per block (per sub-block of Q4_K)
Q8_TYPES = ("Q8_0",)
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q4_K": 144}
_BLOCK_SIZE = {"Q8_0": 32, "Q4_0": 32, "Q4_1": 32, "Q4_K": 256}


def _blocks(raw: np.ndarray, type_name: str, n: int, k: int) -> np.ndarray:
    """``raw`` as ``[N, K / block, block bytes]`` uint8 (checked)."""
    size, nbytes = _BLOCK_SIZE[type_name], _BLOCK_BYTES[type_name]
    if k % size:
        raise ValueError(f"{type_name}: rows of {k} are not whole blocks of {size}")
    if raw.dtype != np.uint8 or raw.size != n * (k // size) * nbytes:
        raise ValueError(f"{type_name}: {raw.size} bytes ({raw.dtype}) do not hold [{n}, {k}]")
    return raw.reshape(n, k // size, nbytes)


def _f16(b: np.ndarray) -> np.ndarray:
    """The little-endian fp16 in the last axis (2 bytes) of ``b`` as float32 (exact)."""
    return np.ascontiguousarray(b).view("<f2")[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Bytes ``[..., 16]`` -> their 32 nibbles: element j low nibble of byte j, j + 16 high."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def decode_q8_0(raw: np.ndarray, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Q8_0 -> ``(q int8 [N, K], d float32 [N, K / 32])``."""
    b = _blocks(raw, "Q8_0", n, k)
    q = np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(n, k)
    return q, _f16(b[..., :2])


def decode_int4(raw: np.ndarray, type_name: str, n: int, k: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_0 / Q4_1 / Q4_K -> ``(codes uint8 [N, K], scale, zero float32 [N, K / 32])`` with
    ``w = (codes - 8) * scale + zero``."""
    b = _blocks(raw, type_name, n, k)
    if type_name == "Q4_0":
        d = _f16(b[..., :2])
        return _nibbles(b[..., 2:]).reshape(n, k), d, np.zeros_like(d)
    if type_name == "Q4_1":
        d, m = _f16(b[..., :2]), _f16(b[..., 2:4])
        return _nibbles(b[..., 4:]).reshape(n, k), d, m + np.float32(8) * d
    if type_name != "Q4_K":
        raise ValueError(f"{type_name}: not a 4-bit type with blocks of 32 ({INT4_TYPES})")
    codes, scale, minimum = _q4k_parts(raw, n, k)
    return codes, scale, np.float32(8) * scale + minimum


def _q4k_parts(raw: np.ndarray, n: int, k: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K -> ``(codes uint8 [N, K], d_j, m_j float32 [N, K / 32])``, ``w = d_j c + m_j``
    per sub-block j of 32 (``d_j = d sc_j``, ``m_j = -dmin mn_j``: exact in float32)."""
    b = _blocks(raw, "Q4_K", n, k)
    d, dmin = _f16(b[..., :2])[..., None], _f16(b[..., 2:4])[..., None]  # [N, KB, 1]
    s = b[..., 4:16].astype(np.uint8)  # the 12 bytes of 6-bit scales and minimums
    # Sub-blocks 0..3: low 6 bits of bytes 0..3 (scale) and 4..7 (min); 4..7: low / high
    # nibble of bytes 8..11 with the top 2 bits of bytes 0..3 / 4..7 above them.
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)],
                        axis=-1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)],
                        axis=-1)
    scale = d * sc.astype(np.float32)  # [N, KB, 8]
    minimum = -(dmin * mn.astype(np.float32))
    qs = b[..., 16:].reshape(n, k // 256, 4, 32)  # 4 x 32 bytes: sub-blocks (2i, 2i + 1)
    codes = np.stack([qs & 15, qs >> 4], axis=3)  # [N, KB, 4, 2, 32]
    return codes.reshape(n, k), scale.reshape(n, -1), minimum.reshape(n, -1)


KERNEL_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q8_0")
_KERNEL_BLOCK = {"Q4_0": "Q4_0", "Q4_1": "Q4_1", "Q4_K": "Q4F", "Q8_0": "Q8_0"}


def kernel_blocks(raw: np.ndarray, type_name: str, n: int, k: int) -> tuple[np.ndarray, str]:
    """``(blocks uint8 [N, K / 32 * block bytes], block type)`` for ``csrc/quant_gemm.h`` (see
    the module docstring): the file's bytes, or Q4_K's as ``Q4F`` blocks."""
    if type_name not in KERNEL_TYPES:
        raise ValueError(f"{type_name}: no block kernel ({KERNEL_TYPES})")
    if type_name != "Q4_K":
        return _blocks(raw, type_name, n, k).reshape(n, -1), type_name
    codes, d, m = _q4k_parts(raw, n, k)
    c = codes.reshape(n, k // QK, 2, QK // 2)  # per block: elements [0, 16) and [16, 32)
    qs = c[:, :, 0] | (c[:, :, 1] << 4)  # [N, KB, 16]
    out = np.concatenate([d[..., None].view(np.uint8), m[..., None].view(np.uint8), qs],
                         axis=-1)  # [N, KB, 4 + 4 + 16]
    return np.ascontiguousarray(out).reshape(n, -1), "Q4F"


def decode(raw: np.ndarray, type_name: str, n: int, k: int) -> tuple[np.ndarray, ...] | None:
    """The kernel layout of a tensor of ``type_name`` (see the module docstring), or None for
    a type that has none."""
    if type_name in Q8_TYPES:
        return decode_q8_0(raw, n, k)
    if type_name in INT4_TYPES:
        return decode_int4(raw, type_name, n, k)
    return None
