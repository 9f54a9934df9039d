"""The static decode batch the model attends over when it runs a padded decode step (a CUDA
graph bucket, ``disagg.cuda_graph``): ``StaticDecodeMeta``, the paged-decode kernel contract
(``DecodeFn``) and its implementations (Triton's, and a PyTorch reference), and the contract of
the optional RoPE + K/V-write kernel (``RopeStoreFn``: ``disagg.model.triton_rope``).

Model side: the model's ``Attention`` takes a ``StaticDecodeMeta`` in place of
``AttentionMetadata``; nothing here knows the scheduler or the graphs that fill it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# paged_decode(q [S, Hq, D], kv_layer [N, 2, Hkv, B, D], block_tables [S, M], seq_lens [S],
#              scale, num_splits) -> [S, Hq, D]
DecodeFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, "int | None"],
                    torch.Tensor]

# rope_store(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D], cos [T, 1, D], sin [T, 1, D],
#            kv_layer [N, 2, Hkv, B, D], slot_block [T], slot_offset [T]) -> RoPE(q) [T, Hq, D]
# (contiguous); writes RoPE(k) and v into row t's slot, as store_kv does.
RopeStoreFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                        torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, slot_block: torch.Tensor,
             slot_offset: torch.Tensor) -> None:
    """Row t's K/V -> ``kv_layer[slot_block[t], {0: K, 1: V}, :, slot_offset[t]]``."""
    kv_layer[slot_block, 0, :, slot_offset] = k.to(kv_layer.dtype)
    kv_layer[slot_block, 1, :, slot_offset] = v.to(kv_layer.dtype)


def triton_paged_decode() -> DecodeFn | None:
    """The Triton decode kernel, or None where it is missing (no triton, CPU-only installs)."""
    try:
        from disagg.model import triton_attention
    except Exception:  # noqa: BLE001 - not there / triton broken: the graphs stay off
        return None
    if not getattr(triton_attention, "HAS_TRITON", True):
        return None
    return getattr(triton_attention, "paged_decode", None)


def paged_decode_reference(q: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float,
                           num_splits: int | None = None) -> torch.Tensor:
    """``paged_decode``'s contract in PyTorch (shape-static, no host sync): sequence ``s``
    attends keys ``[0, seq_lens[s])`` of its ``M`` table blocks; seq_len 0 gives zeros.
    Reads all ``M * B`` keys of every row: for tests and tiny models only."""
    del num_splits  # one pass: splitting only changes the order of the sums
    s, hq, d = q.shape
    _, _, hkv, bsz, _ = kv_layer.shape
    m = block_tables.shape[1]
    g = hq // hkv
    ctx = kv_layer.index_select(0, block_tables.reshape(-1).long())  # [S*M, 2, Hkv, B, D]
    # (s, block c, kv, head, offset j) -> key c*B + j of sequence s
    ctx = ctx.view(s, m, 2, hkv, bsz, d).permute(2, 0, 3, 1, 4, 5).reshape(2, s, hkv, m * bsz, d)
    k, v = ctx[0].float(), ctx[1].float()
    qf = q.float().view(s, hkv, g, d)
    scores = torch.einsum("shgd,shld->shgl", qf, k) * scale
    keys = torch.arange(m * bsz, device=q.device)
    valid = keys[None, :] < seq_lens.long()[:, None]  # [S, L]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    p = torch.softmax(scores, dim=-1).nan_to_num(nan=0.0)  # seq_len 0: all -inf -> 0
    out = torch.einsum("shgl,shld->shgd", p, v)
    return out.reshape(s, hq, d).to(q.dtype)


@dataclass(frozen=True)
class StaticDecodeMeta:
    """Attention inputs of a padded decode batch, all device tensors of fixed shape (the model's
    ``Attention`` calls ``attend`` instead of ``paged_attention`` when it gets one)."""

    block_tables: torch.Tensor  # [b, M] int64
    seq_lens: torch.Tensor  # [b] int64, 0 on padding rows
    slot_block: torch.Tensor  # [b] int64 (scratch block on padding rows)
    slot_offset: torch.Tensor  # [b] int64
    decode: DecodeFn
    num_splits: int | None = None  # None: paged_decode picks from shapes
    # RoPE of q and k and the K/V write in one launch (CUDA, once the runner's device check
    # accepted it); None: the model applies RoPE itself and ``attend`` writes K/V.
    rope_store: RopeStoreFn | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.seq_lens.shape[0])

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv_layer: torch.Tensor, scale: float) -> torch.Tensor:
        """Decode attention of q (RoPE applied) after writing k (RoPE applied) and v."""
        store_kv(k, v, kv_layer, self.slot_block, self.slot_offset)
        return self.decode(q, kv_layer, self.block_tables, self.seq_lens, scale,
                           self.num_splits)

    def rope_attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, kv_layer: torch.Tensor, scale: float) -> torch.Tensor:
        """``attend`` for q and k *before* RoPE: ``rope_store`` rotates both and writes K/V."""
        if self.rope_store is None:
            raise ValueError("rope_attend needs a StaticDecodeMeta with rope_store set")
        q = self.rope_store(q, k, v, cos, sin, kv_layer, self.slot_block, self.slot_offset)
        return self.decode(q, kv_layer, self.block_tables, self.seq_lens, scale,
                           self.num_splits)
