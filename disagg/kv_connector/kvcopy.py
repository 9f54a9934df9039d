"""Copy a request's KV between a rank's paged cache and a contiguous transfer buffer.

Cache of one rank: ``kv[num_blocks, layers, 2, heads, B, D]``; token ``p`` of a request with
block table ``bt`` is at ``kv[bt[p // B], :, :, :, p % B]``. The token-major buffer of a piece
is ``[nl, 2, nh, num_tokens, D]`` for local layers ``[l0, l1)`` and heads ``[h0, h1)``: it does
not depend on the block size, so the two sides may use different ``tokens_per_block``.

The generation side's install (``pull.install``) writes pulled payloads with
``scatter_tokens``. The context side's server builds payloads with
``transfer.payload.gather_into`` (run-wise numpy copies, off the engine thread);
``gather_tokens`` here is its simple per-token inverse of ``scatter_tokens``, for reading a
request's KV back (tests, checks), not a second transfer path.
"""

from __future__ import annotations

import torch

Range = tuple[int, int]


def _token_index(block_ids: list[int], num_tokens: int, block_size: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(block, offset) of tokens [0, num_tokens): token p -> (block_ids[p // B], p % B)."""
    pos = torch.arange(num_tokens, device=device)
    blocks = torch.tensor(block_ids, dtype=torch.long, device=device)[pos // block_size]
    return blocks, pos % block_size


def gather_tokens(kv: torch.Tensor, block_ids: list[int], num_tokens: int,
                  layers: Range, heads: Range, out: torch.Tensor | None = None) -> torch.Tensor:
    """Read tokens [0, num_tokens) of local layers/heads as ``[nl, 2, nh, num_tokens, D]``."""
    B = kv.shape[4]
    if len(block_ids) * B < num_tokens:
        raise ValueError(f"{len(block_ids)} blocks of {B} cannot hold {num_tokens} tokens")
    blk, off = _token_index(block_ids, num_tokens, B, kv.device)
    view = kv[:, layers[0]:layers[1], :, heads[0]:heads[1]]  # [N, nl, 2, nh, B, D]
    # Advanced indices on dims 0 and 4 (separated by slices) move T first: [T, nl, 2, nh, D].
    picked = view[blk, :, :, :, off]
    result = picked.permute(1, 2, 3, 0, 4)
    if out is None:
        return result.contiguous()
    out.copy_(result)
    return out


def scatter_tokens(kv: torch.Tensor, block_ids: list[int], payload: torch.Tensor,
                   layers: Range, heads: Range) -> None:
    """Write a ``[nl, 2, nh, T, D]`` buffer into tokens [0, T) of the request's blocks."""
    B = kv.shape[4]
    num_tokens = payload.shape[3]
    if len(block_ids) * B < num_tokens:
        raise ValueError(f"{len(block_ids)} blocks of {B} cannot hold {num_tokens} tokens")
    blk, off = _token_index(block_ids, num_tokens, B, kv.device)
    view = kv[:, layers[0]:layers[1], :, heads[0]:heads[1]]
    view[blk, :, :, :, off] = payload.permute(3, 0, 1, 2, 4).to(kv.dtype)
