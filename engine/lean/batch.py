"""Many independent sequences decoded together on the lean step, one token per sequence
per step: what the trainer's data stage answers its seed prompts with.

Each of the B rows has its own slice of every layer's cache, (B, kv_heads, C, D), and its
own length, so a row whose answer ended takes the next prompt at once (continuous
batching) without touching the others: its prompt is prefilled alone through the target's
own step (a long prompt is many rows of one matmul there) and its cache copied into the
row. A decode step then runs every layer once over the B rows' pending tokens, each row
attending to its own cache under a mask of its length. The rows' linear layers are one
(B, H) product: what makes answering many prompts cheaper than answering one.

Every step can hand back the states of chosen layers for every row, so the features the
drafters learn from come out of the same forward that writes the answers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.devices import staged
from engine.lean.cache import doubled
from engine.lean.layer import BatchLengths, make_layer
from engine.lean.lean_target import LeanTarget
from engine.weights import kernels


@dataclass
class Step:
    """What one batched step computed, per row."""

    logits: torch.Tensor  # (B, V) next-token logits (float32)
    states: dict[int, torch.Tensor]  # layer -> (B, H) states (layer L: final normed)


class BatchRows:
    """B cache rows of `capacity` positions over a lean target (see the module doc)."""

    def __init__(self, target: LeanTarget, rows: int, capacity: int):
        s = target.spec
        self.target, self.rows = target, rows
        self.layer = make_layer(s, target.wide_rows, batched=True)
        self.keys: list[torch.Tensor] = []  # per layer (B, kv_heads, capacity, D)
        self.values: list[torch.Tensor] = []
        self.reserve(capacity)
        self.lengths = torch.zeros(rows, dtype=torch.long)  # cached tokens per row (host)
        self._scratch = target.new_cache()  # one prompt's cache while it is prefilled

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    def reserve(self, positions: int) -> None:
        """Room for `positions` per row (doubling, up to the model's context)."""
        s, have = self.target.spec, self.capacity
        if positions <= have:
            return
        size = doubled(max(have, 256), positions, s.context)
        shape = (self.rows, s.kv_heads, size, s.head_dim)
        t = self.target
        with torch.inference_mode():
            for table in (self.keys, self.values):
                for i in range(s.layers):
                    new = torch.zeros(shape, dtype=t.cache_dtype, device=t.device)
                    if i < len(table):
                        new[:, :, :have] = table[i]
                        table[i] = new
                    else:
                        table.append(new)

    def prefill(self, row: int, tokens: list[int], layers: tuple[int, ...] = ()) -> Step:
        """Cache `tokens` in `row` (replacing what it held): the logits after every token
        (P, V) and the states of `layers` (P, H) each."""
        n = len(tokens)
        if not 0 < n < self.capacity:
            raise ValueError(f"a prompt of {n} tokens does not fit rows of {self.capacity}: "
                             "reserve room first")
        out = self.target.forward(self._scratch, tokens, 0, states=bool(layers))
        with torch.inference_mode():
            for i in range(self.target.spec.layers):
                self.keys[i][row, :, :n] = self._scratch.keys[i][:, :n]
                self.values[i][row, :, :n] = self._scratch.values[i][:, :n]
        self.lengths[row] = n
        states = {layer: out.states[layer][0] for layer in layers}
        return Step(out.logits.float(), states)

    def step(self, tokens: torch.Tensor, active: torch.Tensor,
             layers: tuple[int, ...] = ()) -> Step:
        """Feed each row its (B,) pending token at its next position: the (B, V) logits
        after it and the states of `layers`. Rows where the (B,) bool `active` is False
        decode a token nobody reads and keep their length."""
        t = self.target
        positions = staged(self.lengths, t.device)
        top = int(self.lengths.max())
        if top >= self.capacity:
            raise ValueError("a row is full: reserve room before the step")
        if t.device.type == "cpu" and t.cache_dtype == torch.float32 and kernels.available():
            # each row reads only its own positions (engine/weights/kernels/attention.cpp)
            masks = {w: BatchLengths(positions + 1, w) for w in set(t.spec.windows)}
        else:
            masks = {w: self._mask(positions, top + 1, w) for w in set(t.spec.windows)}
        with torch.inference_mode():
            x = t.embedding(staged(tokens, t.device)).to(t.act_dtype)
            cos, sin = t.rope.rows(positions, top)
            kept = {0: x} if 0 in layers else {}
            for i, w in enumerate(t.weights):
                x = self.layer(w, x, cos, sin, masks[t.spec.windows[i]], self.keys[i],
                               self.values[i], positions)
                if i + 1 in layers:
                    kept[i + 1] = x
            final = t.final_norm(x)
            if t.spec.layers in layers:
                kept[t.spec.layers] = final
            logits = t.logits(final).float()
        self.lengths += active.to(torch.long)
        return Step(logits, kept)

    @staticmethod
    def _mask(positions: torch.Tensor, width: int, window: int | None) -> torch.Tensor:
        """(B, width) additive mask: row r sees its slots up to positions[r] (the one this
        step writes), within `window` positions where the layer has a sliding window."""
        slots = torch.arange(width, device=positions.device)[None]
        allowed = slots <= positions[:, None]
        if window is not None:
            allowed &= slots > positions[:, None] - window
        mask = torch.zeros(allowed.shape, dtype=torch.float32, device=positions.device)
        return mask.masked_fill_(~allowed, torch.finfo(torch.float32).min)
