"""Chained hashes of full KV blocks (torch-free).

A block is identified by its tokens *and* everything before it, so a hit on block ``i`` implies
hits on blocks ``0..i-1``: ``h_i = H(h_{i-1}, tokens of block i)`` with ``h_{-1} = None``.

The router imports this module to hash prompts exactly as the workers do, so the byte layout is
a wire contract; change it only together with ``BLOCK_HASH_SCHEME``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

BLOCK_HASH_SCHEME = "sha256-chain-v1"


def hash_block_tokens(parent: int | None, tokens: Sequence[int]) -> int:
    """``H(parent, tokens)``: the first 8 bytes (big-endian, unsigned) of
    ``sha256(parent as 8 big-endian bytes (nothing when None) + each token as 4 little-endian
    bytes)``."""
    h = hashlib.sha256()
    if parent is not None:
        h.update(parent.to_bytes(8, "big"))
    h.update(b"".join(t.to_bytes(4, "little") for t in tokens))
    return int.from_bytes(h.digest()[:8], "big")


def hash_token_blocks(tokens: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of the *full* blocks of ``tokens`` (a trailing partial block is ignored)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    return extend_block_hashes([], tokens, block_size)


def extend_block_hashes(hashes: list[int], tokens: Sequence[int], block_size: int) -> list[int]:
    """Append to ``hashes`` (the chain of ``tokens``' first ``len(hashes)`` blocks) the hashes of
    the remaining full blocks of ``tokens``; returns ``hashes`` (mutated in place).

    Lets a caller keep a request's chain and only hash blocks that became full since."""
    num_full = len(tokens) // block_size
    parent = hashes[-1] if hashes else None
    for i in range(len(hashes), num_full):
        # block i holds tokens [i*B, (i+1)*B)
        parent = hash_block_tokens(parent, tokens[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
    return hashes
