"""The token mask of one sampling step: every constrained row's allowed tokens, filled by the
grammar engine into one packed bitmask (32 tokens per int32, llguidance's layout), then
unpacked on the logits' device by one vectorized shift and applied by the sampler in one
masked fill."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from disagg.structured.grammar import Matcher


class MaskFiller:
    """Fills the bitmasks of a batch's matchers."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._bits: dict[torch.device, torch.Tensor] = {}  # 0..31 on each device used

    def forbidden(self, matchers: Sequence[Matcher | None], device: torch.device
                  ) -> torch.Tensor | None:
        """A bool [rows, vocab] tensor on ``device``, True where a row's grammar forbids the
        token (rows without a matcher forbid none), or None when no row is constrained."""
        rows = [(m.ll, i) for i, m in enumerate(matchers) if m is not None and m.error is None]
        if not rows:
            return None
        words = (self.vocab_size + 31) // 32
        packed = torch.full((len(matchers), words), -1, dtype=torch.int32)
        base, stride = packed.data_ptr(), words * 4
        # Each row's mask straight into its row of ``packed`` (one native call per row, on this
        # thread: llguidance's thread pool (LLExecutor) took 270-340 us a row against 12 us
        # here with SmolLM2's vocabulary on a busy 2-core machine).
        for ll, i in rows:
            ll.unsafe_compute_mask_ptr(base + i * stride, stride)
        return self.unpack(packed, device)

    def forbidden_with_drafts(self, matchers: Sequence[Matcher | None],
                              drafts: Sequence[Sequence[int]], device: torch.device
                              ) -> torch.Tensor | None:
        """As ``forbidden`` for a step whose request i has 1 + len(drafts[i]) rows: row j of
        request i is its matcher's mask after its first j drafts (consumed to compute the
        next row's mask, then rolled back: the matcher ends where it started, no token is
        consumed twice). Drafts must be ones the grammar accepts (``Matcher.valid_prefix``);
        rows past a draft it refused anyway keep the last mask (they are never used: that
        draft is rejected)."""
        if all(m is None or m.error is not None for m in matchers):
            return None
        words = (self.vocab_size + 31) // 32
        packed = torch.full((sum(1 + len(d) for d in drafts), words), -1, dtype=torch.int32)
        base, stride = packed.data_ptr(), words * 4
        row = 0
        for m, d in zip(matchers, drafts, strict=True):
            if m is not None and m.error is None:
                ll = m.ll
                consumed = 0
                for j in range(len(d) + 1):
                    ll.unsafe_compute_mask_ptr(base + (row + j) * stride, stride)
                    # validate first: consuming a refused token leaves the matcher in its
                    # error state, which rollback does not undo
                    if (j < len(d) and consumed == j and ll.validate_tokens([d[j]]) == 1
                            and ll.consume_token(d[j])):
                        consumed += 1
                    elif j < len(d):  # refused: the rows after it keep this mask
                        packed[row + j + 1:row + len(d) + 1] = packed[row + j]
                        break
                if consumed:
                    ll.rollback(consumed)
            row += 1 + len(d)
        return self.unpack(packed, device)

    def unpack(self, packed: torch.Tensor, device: torch.device) -> torch.Tensor:
        """[rows, words] int32 (bit b of word w: token 32 w + b may be sampled) -> bool
        [rows, vocab_size], True where the token is forbidden: one shift of every word by
        0..31 (timed against a byte lookup table: no faster on CPU, bench/structured_outputs.py
        records the step's cost)."""
        bits = self._bits.get(device)
        if bits is None:
            bits = self._bits[device] = torch.arange(32, dtype=torch.int32, device=device)
        if device.type == "cuda":
            packed = packed.pin_memory().to(device, non_blocking=True)
        else:
            packed = packed.to(device)
        # int32 >> is arithmetic: a set sign bit smears ones leftward, & 1 still reads bit b.
        unpacked = (packed.unsqueeze(-1) >> bits) & 1  # [rows, words, 32]
        return unpacked.view(packed.shape[0], -1)[:, :self.vocab_size] == 0
