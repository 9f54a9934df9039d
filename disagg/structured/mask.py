"""The token mask of one sampling step: every constrained row's allowed tokens, filled by the
grammar engine into one packed bitmask (32 tokens per int32, llguidance's layout) in one call
for the whole batch, then unpacked on the logits' device by one vectorized shift."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from disagg.structured.grammar import Matcher


class MaskFiller:
    """Fills the bitmasks of a batch's matchers (owns the grammar engine's thread pool)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._executor: Any = None
        self._bits: dict[torch.device, torch.Tensor] = {}  # 0..31 on each device used

    def forbidden(self, matchers: Sequence[Matcher | None], device: torch.device
                  ) -> torch.Tensor | None:
        """A bool [rows, vocab] tensor on ``device``, True where a row's grammar forbids the
        token (rows without a matcher forbid none), or None when no row is constrained."""
        rows = [(m.ll, i) for i, m in enumerate(matchers) if m is not None and m.error is None]
        if not rows:
            return None
        if self._executor is None:
            import llguidance  # not llguidance.torch: it imports torch.compile (~1 s)

            self._executor = llguidance.LLExecutor()
        words = (self.vocab_size + 31) // 32
        packed = torch.full((len(matchers), words), -1, dtype=torch.int32)
        # One call for the batch: the rows' masks are computed on the engine's thread pool
        # straight into ``packed`` (row i at byte offset i * words * 4).
        self._executor.unsafe_compute_mask_ptr(rows, packed.data_ptr(), words * 4,
                                               len(matchers))
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
