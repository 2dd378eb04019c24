"""Reading a decode cache in tests, whichever target made it (engine/decode/target.py)."""

from __future__ import annotations

import torch
from transformers import DynamicCache


def held(cache, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (kv_heads, t, D) keys and values of a cache holding `length` positions
    (a transformers cache's sliding layers hold only their latest t; the lean cache's
    slots past `length` are left over from dropped drafts)."""
    if isinstance(cache, DynamicCache):
        assert cache.get_seq_length() == length
        return [(layer.keys[0], layer.values[0]) for layer in cache.layers]
    return [(k[:, :length], v[:, :length]) for k, v in zip(cache.keys, cache.values,
                                                            strict=True)]
