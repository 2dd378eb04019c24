"""How the decode loop runs the model: one interface, two implementations.

The lean step (engine/lean/) runs the Llama family from its own compact layer function with
a preallocated cache, eagerly or compiled; every other model runs through transformers
(`TransformersTarget`, below). Drafters, the decode loop and timing talk only to this
interface, so both behave the same to them:

- `forward(cache, tokens, start, ...)` runs tokens after `start` cached positions and
  appends them to the cache: a chain, or a tree (`depths` and `tree_mask`) verified in one
  pass. It returns logits and, when asked, every layer's states.
- `keep_path(cache, start, keep)` keeps the accepted nodes' entries after a step;
  `rollback(cache, n)` forgets the last n positions.
- Split execution (Kangaroo's early exit): `embed`, `run_layers` over a range of layers,
  `norm` and `logits`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.decode import kv_cache, split


@dataclass
class Forward:
    """What one forward pass returns."""

    logits: torch.Tensor  # (n, V), or (1, V) for the last token only
    # every layer's (1, n, H) states when asked (embeddings first, the final normed states
    # last, as transformers' output_hidden_states); None otherwise
    states: tuple[torch.Tensor, ...] | None = None


class Target:
    """The interface (see the module doc); `name` says which implementation runs."""

    name = "target"

    def new_cache(self):
        raise NotImplementedError

    def compile(self, mode: str = "watch", on_ready: Callable[[], None] | None = None,
                report: Callable | None = None) -> None:
        """Load the compiled step where the implementation compiles (nothing to do here);
        `mode` says what to do where it is not built yet (engine.lean.compiled.MODES),
        `on_ready` hears when it is ready, `report` how a build goes."""

    def check_draftable(self, cache) -> None:
        """Raise AcceleratorError when drafted tokens could not be dropped from `cache`."""

    def padded_sizes(self) -> tuple[int, ...]:
        """The step sizes a step of fewer tokens runs at, padded (empty: none; every step
        runs at its own size)."""
        return ()

    def forward(self, cache, tokens: Sequence[int], start: int,
                depths: Sequence[int] | None = None, tree_mask: torch.Tensor | None = None,
                states: bool = False, last_only: bool = False) -> Forward:
        raise NotImplementedError

    def keep_path(self, cache, start: int, keep: Sequence[int],
                  layers: range | None = None) -> None:
        raise NotImplementedError

    def release(self, cache) -> None:
        """A reply is done with `cache`: its memory may serve the next reply (nothing to do
        here)."""

    def rollback(self, cache, n: int) -> None:
        raise NotImplementedError

    def embed(self, tokens: Sequence[int], start: int) -> torch.Tensor:
        raise NotImplementedError

    def run_layers(self, h: torch.Tensor, layers: range, cache, start: int) -> torch.Tensor:
        raise NotImplementedError

    def norm(self, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def logits(self, h: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError


class TransformersTarget(Target):
    """The model's own transformers forward, with a DynamicCache (engine/decode/kv_cache.py)."""

    name = "transformers"

    def __init__(self, model):
        self.model = model
        self.device = next(model.parameters()).device

    def new_cache(self):
        return kv_cache.new_cache(self.model)

    def check_draftable(self, cache) -> None:
        kv_cache.check_draftable(cache)

    def forward(self, cache, tokens, start, depths=None, tree_mask=None, states=False,
                last_only=False) -> Forward:
        # Trees take a 4-D additive mask (each node sees the cache and its ancestors) and
        # explicit positions (cache length + depth); chains need neither.
        ids = torch.tensor([list(tokens)], device=self.device)
        kwargs = {}
        if tree_mask is not None:
            positions = torch.tensor([list(depths)], device=self.device) + start
            mask = kv_cache.tree_attention_mask(
                cache, start, tree_mask, depths,
                getattr(self.model.config, "layer_types", None),
                next(self.model.parameters()).dtype, self.device)
            kwargs = {"position_ids": positions, "attention_mask": mask}
        out = self.model(input_ids=ids, cache=cache, use_cache=True,
                         logits_to_keep=1 if last_only else len(tokens),
                         output_hidden_states=states, **kwargs)
        return Forward(out.logits[0], out.hidden_states if states else None)

    def keep_path(self, cache, start, keep, layers=None) -> None:
        kv_cache.keep_path(cache, start, keep, layers)

    def rollback(self, cache, n: int) -> None:
        kv_cache.rollback(cache, n)

    def embed(self, tokens, start) -> torch.Tensor:
        return split.embed(self.model, list(tokens), start)

    def run_layers(self, h, layers, cache, start) -> torch.Tensor:
        return split.run_layers(self.model, h, layers, cache, start)

    def norm(self, h) -> torch.Tensor:
        return split.parts(self.model).norm(h)

    def logits(self, h, weight=None) -> torch.Tensor:
        return split.logits(self.model, h, weight)
