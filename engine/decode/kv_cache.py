"""The only module that touches KV-cache internals (transformers' DynamicCache layers).

Drafting appends a step's draft nodes to the cache and then keeps only the accepted ones,
so every layer must be able to roll back. Full-attention layers hold every position.
Sliding-window layers normally hold only the last `window - 1` positions and forget the
rest as soon as new ones arrive; this module switches on their past recording (they keep
what a rollback needs) and trims them back to the window after every edit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from engine.errors import AcceleratorError

# Layer types whose entries can be cut and reordered here; others (linear attention,
# quantized caches, shared-KV dummies) cannot roll back, so drafting refuses them.
_EDITABLE = (DynamicLayer, DynamicSlidingWindowLayer)


def new_cache(model) -> DynamicCache:
    """An empty cache for `model`, every sliding-window layer recording its past."""
    cache = DynamicCache(config=model.config)
    for layer in cache.layers:
        if isinstance(layer, DynamicSlidingWindowLayer):
            layer.activate_past_recording()
    return cache


def check_draftable(cache: DynamicCache) -> None:
    """Raise AcceleratorError when some layer's cache cannot be rolled back."""
    for layer in cache.layers:
        if type(layer) not in _EDITABLE:
            raise AcceleratorError(
                f"drafting needs a KV cache that can drop rejected tokens; this model's "
                f"{type(layer).__name__} layers cannot: use acceleration Off")


def keep_path(cache: DynamicCache, start: int, keep: Sequence[int],
              layers: range | None = None) -> None:
    """After a step, keep only the root's and the accepted nodes' entries.

    The layers hold `start` committed positions followed by one entry per draft node. Node
    keep[i]'s entry moves to position start + i; everything after start + len(keep) is
    dropped. `layers` limits the edit to some layers (Kangaroo's shallow and deep layers
    differ).
    """
    keep = list(keep)
    reorder = keep != list(range(len(keep)))
    for i in range(len(cache.layers)) if layers is None else layers:
        layer = cache.layers[i]
        if layer.is_initialized:
            _keep_in_layer(layer, start, keep, reorder)


def _keep_in_layer(layer, start: int, keep: list[int], reorder: bool) -> None:
    # A sliding layer's tensors hold only its latest entries, so the nodes' entries are
    # located from the end: the layer saw get_seq_length() positions, start of them before
    # the nodes, and its tensors end with the nodes.
    appended = layer.get_seq_length() - start
    first = layer.keys.shape[-2] - appended  # tensor index of node 0's entry
    if reorder:
        src = torch.tensor([first + k for k in keep], device=layer.keys.device)
        dst = slice(first, first + len(keep))
        layer.keys[..., dst, :] = layer.keys.index_select(-2, src)
        layer.values[..., dst, :] = layer.values.index_select(-2, src)
    dropped = appended - len(keep)
    if dropped > 0 or layer.is_sliding:
        # transformers' crop: cuts the tail and trims a sliding layer back to its window
        # (crop(0) on a sliding layer only trims).
        layer.crop(-dropped)


def rollback(cache: DynamicCache, n: int) -> None:
    """Remove the last n positions from every layer and trim sliding-window layers back to
    their window: the one way a drafter's rejected positions leave a transformers cache.
    transformers' crop takes a negative count; crop(0) removes nothing but still trims a
    sliding layer (its documented meaning)."""
    if n < 0:
        raise ValueError(f"cannot roll back {n} positions")
    cache.crop(-n)


def tree_attention_mask(cache: DynamicCache, past: int, tree_mask: torch.Tensor,
                        depths: Sequence[int], layer_types: Sequence[str] | None,
                        dtype: torch.dtype, device: torch.device):
    """The additive attention mask for verifying a token tree after `past` positions.

    tree_mask: (n, n) bool, node i sees node j. Each query sees the cached positions its
    layer holds (for a sliding-window layer only those within the window of the node's
    position past + depth) and its ancestors. Returns one (1, 1, n, kv) mask when every
    layer needs the same one, else {layer type: mask} (models with alternating sliding
    and full layers take a mask per type).
    """
    n = len(depths)
    nodes = torch.tensor(depths, device=device) + past  # (n,) query positions
    masks: dict[tuple, torch.Tensor] = {}
    by_type: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(cache.layers):
        kv_len, offset = cache.get_mask_sizes(n, i)
        window = getattr(layer, "sliding_window", None) if layer.is_sliding else None
        key = (kv_len, offset, window)
        if key not in masks:
            masks[key] = _layer_mask(past, tree_mask, nodes, kv_len, offset, window, dtype,
                                     device)
        name = layer_types[i] if layer_types else "full_attention"
        by_type.setdefault(name, masks[key])
    if len(masks) == 1:
        return next(iter(masks.values()))
    return by_type


def _layer_mask(past: int, tree_mask: torch.Tensor, nodes: torch.Tensor, kv_len: int,
                offset: int, window: int | None, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
    """(1, 1, n, kv_len) additive mask; column j is cache slot offset + j."""
    n = nodes.shape[0]
    slots = torch.arange(offset, offset + kv_len, device=device)  # (kv,)
    allowed = (slots < past)[None, :].expand(n, -1).clone()
    if window is not None:  # transformers' sliding rule: key position > query position - window
        allowed &= slots[None, :] > nodes[:, None] - window
    tree = tree_mask.to(device)
    if window is not None:  # a deep node's window ends inside the tree too
        tree = tree & (nodes[None, :] > nodes[:, None] - window)
    allowed[:, past - offset:] = tree
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]
