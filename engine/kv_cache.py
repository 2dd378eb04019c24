"""The only module that touches KV-cache internals (transformers' DynamicCache layers)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache


def new_cache(model) -> DynamicCache:
    """An empty cache for `model`."""
    return DynamicCache(config=model.config)


def cache_length(cache: DynamicCache) -> int:
    """Number of positions held by layer 0."""
    return cache.get_seq_length()


def drop_last(cache: DynamicCache, n: int) -> None:
    """Remove the last n positions from every layer (transformers wants a negative count)."""
    if n > 0:
        cache.crop(-n)


def keep_path(cache: DynamicCache, start: int, keep: Sequence[int], layers: range | None = None) -> None:
    """After a tree step, keep only the accepted nodes' entries.

    The cache holds `start` committed positions followed by one entry per tree node. Entries
    start + keep[i] move to start + i and everything after start + len(keep) is dropped.
    `layers` limits the edit to some layers (Kangaroo's shallow and deep layers differ).
    """
    keep = list(keep)
    indices = range(len(cache.layers)) if layers is None else layers
    contiguous = keep == list(range(len(keep)))
    if contiguous and layer_length(cache, indices[0]) == start + len(keep):
        return  # all nodes kept (always so in plain decoding); layers in range grow together
    for i in indices:
        layer = cache.layers[i]
        if not layer.is_initialized:
            continue
        if contiguous:
            end = start + len(keep)
        else:
            src = torch.tensor([start + k for k in keep], device=layer.keys.device)
            dst = slice(start, start + len(keep))
            layer.keys[..., dst, :] = layer.keys.index_select(-2, src)
            layer.values[..., dst, :] = layer.values.index_select(-2, src)
            end = start + len(keep)
        layer.keys = layer.keys[..., :end, :]
        layer.values = layer.values[..., :end, :]


def layer_length(cache: DynamicCache, layer: int) -> int:
    """Positions held by one layer (Kangaroo's layers can differ in length mid-round)."""
    return cache.layers[layer].get_seq_length() if layer < len(cache.layers) else 0


def enable_rollback(cache: DynamicCache) -> None:
    """Let sliding-window layers be rolled back: they keep the states a rollback needs until
    the next `rollback` call trims them to their window again (transformers' past recording)."""
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False):
            layer.activate_past_recording()


def rollback(cache: DynamicCache, n: int) -> None:
    """Remove the last n positions from every layer and trim sliding-window layers (n >= 0;
    unlike drop_last, n = 0 still trims, as rollback-enabled sliding layers need)."""
    cache.crop(-n)
