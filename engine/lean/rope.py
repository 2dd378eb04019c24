"""Rotary tables computed once by the model's own rotary module (so every scaling variant the
family has is applied as transformers applies it), grown as positions are needed."""

from __future__ import annotations

import torch

from engine.lean.cache import doubled

FIRST_POSITIONS = 1024  # rows computed at first; doubled as positions need


class RopeTable:
    """cos and sin rows by position: (positions, D) tables in the activations' dtype."""

    def __init__(self, rotary: torch.nn.Module, dtype: torch.dtype, device: torch.device,
                 limit: int):
        self.rotary, self.dtype, self.device, self.limit = rotary, dtype, device, limit
        self.cos = self.sin = torch.empty(0, device=device)

    def rows(self, positions: torch.Tensor, highest: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(n, D) cos and sin rows of `positions` (n,), the highest of which is `highest`
        (known to the caller: no read back from the device)."""
        needed = highest + 1
        if needed > self.cos.shape[0]:
            self._grow(needed)
        return self.cos[positions], self.sin[positions]

    def _grow(self, needed: int) -> None:
        size = doubled(max(FIRST_POSITIONS, self.cos.shape[0]), needed, self.limit)
        positions = torch.arange(size, device=self.device)[None]
        probe = torch.zeros(1, dtype=self.dtype, device=self.device)
        with torch.inference_mode():
            cos, sin = self.rotary(probe, positions)
        self.cos, self.sin = cos[0], sin[0]
