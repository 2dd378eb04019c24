"""The lean step's KV cache: per layer, keys and values preallocated for a number of
positions, written in place (no `cat` per step), grown by doubling when a reply outgrows it.

Slot i holds the token the step wrote there. A step of n tokens after `start` cached ones
writes slots start..start+n-1 in node order; keeping an accepted path moves its slots
together in place. Rolling back needs nothing: the caller's `start` says how many slots
count, and later steps overwrite the rest. Sliding-window layers keep every position too;
their mask hides what falls out of the window.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.devices import staged

FIRST_CAPACITY = 512  # positions allocated at first; doubled as a reply needs more


def doubled(size: int, needed: int, limit: int) -> int:
    """`size` doubled until it holds `needed`, then capped at `limit` (never below
    `needed`): how the lean step's tables grow (few regrowths, none past the model)."""
    while size < needed:
        size *= 2
    return max(needed, min(size, limit))


class LeanCache:
    """Keys and values of every layer: (kv_heads, capacity, D) each."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, limit: int, capacity: int = FIRST_CAPACITY,
                 storage: tuple | None = None):
        self.shape = (kv_heads, head_dim)
        self.dtype, self.device = dtype, device
        self.limit = limit  # positions the model supports: never allocated beyond
        self.finalizer = None  # hands the tables back to the target that lends them
        if storage is not None:  # an earlier reply's tensors, and graphs captured over them
            self.keys, self.values, self.graphs = storage
            self._zero()
            return
        capacity = min(capacity, limit)
        self.keys = [self._empty(capacity) for _ in range(layers)]
        self.values = [self._empty(capacity) for _ in range(layers)]
        # CUDA graphs captured over these tensors (engine/lean/graphs.py), by step key.
        self.graphs: dict = {}

    def _zero(self) -> None:
        """Zero every slot in place (the graphs keep the addresses they recorded). Graphed
        steps attend over the whole capacity behind a finfo.min mask, which hides a finite
        value but not a NaN or inf an earlier reply left in a slot (a score NaN + mask is
        NaN; probability 0 times a NaN value is NaN): this reply must find only zeros
        beyond what it writes, as a fresh cache holds."""
        with torch.inference_mode():
            for table in (*self.keys, *self.values):
                table.zero_()

    @property
    def storage(self) -> tuple:
        """What a later cache can take over: the (growing) tables and their graphs."""
        return self.keys, self.values, self.graphs

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[1]

    def _empty(self, capacity: int) -> torch.Tensor:
        kv, d = self.shape
        # Inference tensors wherever the cache is made or grown: the compiled layer's
        # graphs are specialised to them (steps run under inference_mode).
        with torch.inference_mode():
            return torch.zeros(kv, capacity, d, dtype=self.dtype, device=self.device)

    def reserve(self, slots: int) -> None:
        """Make room for `slots` slots (doubling, up to the model's limit; a step padded past
        the limit writes its padding into room allocated beyond it)."""
        if slots <= self.capacity:
            return
        capacity = doubled(self.capacity, slots, self.limit)
        self.graphs.clear()  # captured over the tensors about to be replaced
        for table in (self.keys, self.values):
            for i, old in enumerate(table):
                new = self._empty(capacity)
                with torch.inference_mode():
                    new[:, :old.shape[1]] = old
                table[i] = new

    def keep_path(self, start: int, keep: Sequence[int], layers: range | None = None) -> None:
        """After a step written at slots start.., move node keep[i]'s slot to start + i."""
        keep = list(keep)
        if keep == list(range(len(keep))):
            return  # a chain's accepted prefix is already in place
        source = staged([start + k for k in keep], self.device)
        rows = slice(start, start + len(keep))
        with torch.inference_mode():
            for i in range(len(self.keys)) if layers is None else layers:
                self.keys[i][:, rows] = self.keys[i].index_select(1, source)
                self.values[i][:, rows] = self.values[i].index_select(1, source)
