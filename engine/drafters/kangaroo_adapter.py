"""The Kangaroo adapter: one decoder layer of the model's own class, then the norm the
family applies before its LM head, turning the early exit's states into drafts over the
frozen LM head. Training initialises it from a copy of one of the model's layers; the drafter
loads it from a checkpoint."""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import DynamicCache

from engine.decode import split
from engine.weights import quant


def source_index(model, source: int) -> int:
    """The decoder layer the adapter copies: `source`, counted from the end when negative."""
    return source % split.num_layers(model)


class Adapter(nn.Module):
    """decoder layer (the model's class, built from its config) -> final norm.

    Being the model's own layer, it has the family's head layout, q/k norms, biases, extra
    norms (Gemma-2, OLMo-2), rotary-free layers (SmolLM3) and sliding window of the layer it
    copies; its output goes through the model's frozen LM head.
    """

    def __init__(self, model, source: int = -1):
        super().__init__()
        p = split.parts(model)
        index = source_index(model, source)
        self.source = index  # rebuilds the same kind of layer at load (KangarooSettings)
        self.sliding = split.is_sliding(model.config, index)
        self.layer = type(p.blocks[index])(model.config, layer_idx=index)
        # Index 0 of the adapter's own one-layer cache (the layer's kind was fixed above).
        for module in self.layer.modules():
            if hasattr(module, "layer_idx"):
                module.layer_idx = 0
        self.norm = copy.deepcopy(p.norm)

    @classmethod
    def from_model(cls, model, source: int = -1, dtype: torch.dtype = torch.float32) -> Adapter:
        """An adapter initialised from a copy of decoder layer `source` and the final norm,
        in `dtype` (quantized source weights are dequantized)."""
        adapter = cls(model, source)
        p = split.parts(model)
        with torch.no_grad():
            _copy_dense(p.blocks[source_index(model, source)], adapter.layer)
            _copy_dense(p.norm, adapter.norm)
        return adapter.to(device=p.embed_tokens.weight.device, dtype=dtype)

    def forward(self, h: torch.Tensor, rotary, mask, pos: torch.Tensor,
                cache: DynamicCache | None = None) -> torch.Tensor:
        """h: (B, S, H) layer-l states -> (B, S, H) final-normed states for the LM head."""
        return self.norm(split.call_layer(self.layer, h, rotary, mask, pos, cache))


def adapt(model, adapter: Adapter, x: torch.Tensor, start: int,
          cache: DynamicCache | None = None, pad: torch.Tensor | None = None) -> torch.Tensor:
    """The adapter over x (B, n, H) at positions start.. (appending to its own `cache`, or
    whole sequences from position 0 without one); pad: (B, n) 1 on real tokens, or None."""
    pos = split.positions(start, x.shape[1], x.device).expand(x.shape[0], -1)
    rotary = split.rope(model, x, pos)
    mask = None  # one query attends to everything cached (SDPA's fast path)
    if x.shape[1] > 1 or cache is None:
        mask = split.mask(model, x, cache, pos, adapter.sliding, 0, pad)
    return adapter(x, rotary, mask, pos, cache)


def sequence_states(model, adapter: Adapter, x: torch.Tensor,
                    pad: torch.Tensor | None = None) -> torch.Tensor:
    """Adapter over whole sequences x (B, S, H) from position 0, causally, without a cache
    (training and teacher-forced evaluation); pad: (B, S) 1 on real tokens, or None."""
    return adapt(model, adapter, x, 0, None, pad)


def _dense_weight(module: nn.Module) -> torch.Tensor:
    """A linear's weight as a plain tensor (bitsandbytes 4-/8-bit weights are dequantized)."""
    if type(module.weight).__name__ in ("Params4bit", "Int8Params"):
        from peft.utils.integrations import dequantize_module_weight

        return dequantize_module_weight(module)
    return module.weight


def _copy_dense(src: nn.Module, dst: nn.Module) -> None:
    """Copy src's parameters into dst (same structure), dequantizing on the way."""
    for name, module in dst.named_modules():
        source = src.get_submodule(name) if name else src
        for pname, param in module.named_parameters(recurse=False):
            value = _dense_weight(source) if pname == "weight" else getattr(source, pname)
            param.copy_(value.detach().to(param.device, param.dtype).reshape(param.shape))


def draft_head(model, vocab: torch.Tensor | None) -> torch.Tensor:
    """(Vd, H) rows of the frozen LM head the drafter scores: all, or the reduced vocabulary
    (a copy of those rows: one contiguous matmul per draft token)."""
    head = model.get_output_embeddings()
    if vocab is not None and isinstance(head, quant.LowBitLinear):  # only these rows expanded
        return head.rows(vocab.to(head.packed.device))
    weight = _dense_weight(head).detach()
    return weight if vocab is None else weight[vocab.to(weight.device)].clone()
