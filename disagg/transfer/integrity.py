"""End-to-end checksums of KV payloads (issue 41: corrupted KV is never served).

A READ that asks for it (``"integrity": ALGORITHM``) is answered with ``"integrity"`` set to
the same name, its payload, then one more header, the trailer ``{"checksum": "<hex>"}``: the
checksum of the payload's bytes as the context worker sent them from its pinned blocks. The
reader computes the same over the bytes that landed (its receive buffers, or its own blocks
for a read straight into them) before anything is installed, and fails that read on a
mismatch (``INTEGRITY_ERROR``): the request fails, nothing of it is used. Reads over the
same-host mapped path move no payload (the reader gathers from the context worker's memory
itself) and carry no checksum.

``wsum32x2``: the payload as little-endian 32-bit words ``x_j`` (zero-padded to a multiple of
4 bytes), two sums modulo 2**32::

    s1 = sum_j x_j * (2j + 1)        s2 = sum_j x_j

Every weight is odd, so any single flipped bit changes ``s1``; the position weights catch
moved words (a block or a head slice landing at the wrong place), ``s2`` any change of the
words' total. It is not a MAC (the headers are signed already): it catches corruption, not an
attacker. It runs as a few tensor operations per chunk on the payload's own device (CPU or
CUDA), bit-identical on both, about as fast as a memcpy on the CPU (bench/kv_integrity.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

ALGORITHM = "wsum32x2"
INTEGRITY_ERROR = "integrity_error"  # a payload whose checksum does not match the trailer
_MASK = (1 << 32) - 1
_CHUNK_WORDS = 1 << 18  # 1 MiB of payload per tensor operation: stays in cache on a CPU
_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def _weights(device: torch.device) -> torch.Tensor:
    """``2j + 1`` for ``j`` in ``[0, _CHUNK_WORDS)`` (int32), one tensor per device."""
    w = _WEIGHTS.get(device)
    if w is None:
        w = _WEIGHTS[device] = torch.arange(_CHUNK_WORDS, dtype=torch.int32,
                                            device=device) * 2 + 1
    return w


def _as_tensor(view: Any) -> torch.Tensor:
    """A payload view (1-D uint8 numpy array, or a CUDA / CPU uint8 tensor) as a flat uint8
    tensor sharing its memory."""
    if isinstance(view, np.ndarray):
        return torch.from_numpy(view.reshape(-1).view(np.uint8))
    return view.reshape(-1).view(torch.uint8)


def _words(data: torch.Tensor) -> torch.Tensor:
    """``data`` (flat uint8) as int32 words, copied and zero-padded only when its length or
    address is not a multiple of 4."""
    if data.numel() % 4 or data.data_ptr() % 4:
        padded = torch.zeros(-(-data.numel() // 4) * 4, dtype=torch.uint8, device=data.device)
        padded[:data.numel()] = data
        data = padded
    return data.view(torch.int32)


def _sums(words: torch.Tensor, offset: int) -> tuple[int, int]:
    """``(s1, s2)`` of ``words`` placed at word ``offset`` of the payload (mod 2**32).

    A chunk at word ``o`` has weights ``2(o + j) + 1 = (2j + 1) + 2o``, so its ``s1`` is its
    sum against the fixed weights plus ``2o`` times its plain sum."""
    w = _weights(words.device)
    s1 = s2 = 0
    for start in range(0, words.numel(), _CHUNK_WORDS):
        chunk = words[start:start + _CHUNK_WORDS]
        n = chunk.numel()
        # int32 products wrap (mod 2**32); their int64 sum is exact for any chunk size here
        weighted = int((chunk * w[:n]).sum(dtype=torch.int64))
        plain = int(chunk.sum(dtype=torch.int64))
        s1 += weighted + 2 * (offset + start) * plain
        s2 += plain
    return s1 & _MASK, s2 & _MASK


def payload_checksum(views: Sequence[Any]) -> str:
    """The ``wsum32x2`` checksum of ``views`` (contiguous byte views, one byte stream in
    order) as 16 hex digits. Views go one by one while each holds whole words (payload parts
    are whole rows of the cache, so they do); from the first one that does not, the rest is
    joined into one buffer first (a copy)."""
    tensors = [t for t in (_as_tensor(v) for v in views) if t.numel()]
    s1 = s2 = 0
    offset = 0  # bytes of the stream before the current view
    for i, data in enumerate(tensors):
        if data.numel() % 4:
            rest = torch.cat([t.to(data.device) for t in tensors[i:]])
            a, b = _sums(_words(rest), offset // 4)
            s1, s2 = s1 + a, s2 + b
            break
        a, b = _sums(_words(data), offset // 4)
        s1, s2 = s1 + a, s2 + b
        offset += data.numel()
    return f"{s1 & _MASK:08x}{s2 & _MASK:08x}"
