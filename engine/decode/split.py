"""Split execution of a decoder-only model: embed, run a range of layers, read the LM head.

Kangaroo runs the first `l` layers for each draft token and the remaining layers only at
verification, on the layer-`l` states saved while drafting. Hugging Face's decoder layers
are called one by one with the model's own rotary embedding and mask builders, so a family
behaves exactly as its full forward does. Two layouts are known: Llama's (model.model with
embed_tokens / layers / norm / rotary_emb: Llama, Mistral, Qwen2/3, Gemma 1/2, Phi-3,
OLMo-2, SmolLM3 ...) and GPT-2's (model.transformer with wte + learned positions / h / ln_f).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from engine.errors import AcceleratorError


@dataclass(frozen=True)
class Parts:
    """The pieces of a decoder that split execution calls."""

    embed_tokens: nn.Module
    blocks: nn.ModuleList
    norm: nn.Module  # applied before the LM head
    rotary: nn.Module | None  # rotary embedding (None: positions live in the embeddings)
    positions: nn.Module | None  # learned absolute positions added to the embeddings (GPT-2)


def parts(model) -> Parts:
    """The model's split points; AcceleratorError when its layout is not one of the two."""
    base = getattr(model, "model", None)
    if base is not None and all(hasattr(base, p) for p in ("embed_tokens", "layers", "norm",
                                                           "rotary_emb")):
        return Parts(base.embed_tokens, base.layers, base.norm, base.rotary_emb, None)
    base = getattr(model, "transformer", None)
    if base is not None and all(hasattr(base, p) for p in ("wte", "wpe", "h", "ln_f")):
        return Parts(base.wte, base.h, base.ln_f, None, base.wpe)
    model_type = getattr(model.config, "model_type", "?")
    raise AcceleratorError(
        f"Kangaroo is not supported for this architecture ({model_type!r}): its decoder does "
        "not expose embeddings, layers and a final norm that can run one layer at a time"
    )


def check_supported(model) -> None:
    """Raise AcceleratorError unless Kangaroo can split this model's layers."""
    if getattr(model.config, "is_encoder_decoder", False):
        raise AcceleratorError("Kangaroo is not supported for this architecture "
                               "(encoder-decoder models have no single layer stack to split)")
    parts(model)


def num_layers(model) -> int:
    return len(parts(model).blocks)


def positions(start: int, n: int, device: torch.device) -> torch.Tensor:
    """(1, n) position ids start .. start + n - 1."""
    return torch.arange(start, start + n, device=device)[None]


def embed(model, tokens: list[int], start: int) -> torch.Tensor:
    """(1, n, H) input embeddings of `tokens` at positions start.. (Gemma's scaling lives in
    its embedding; GPT-2 adds its learned positions here)."""
    p = parts(model)
    ids = torch.tensor([tokens], device=p.embed_tokens.weight.device)
    h = p.embed_tokens(ids)
    if p.positions is not None:
        h = h + p.positions(positions(start, len(tokens), ids.device))
    return h


def rope(model, h: torch.Tensor, pos: torch.Tensor):
    """The rotary (cos, sin) for positions `pos`, or None where positions are embedded."""
    rotary = parts(model).rotary
    return None if rotary is None else rotary(h, pos)


def logits(model, h: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """LM-head logits of final-normed states h (or over `weight`'s rows), soft-capped where
    the family caps them (Gemma-2), so probabilities match the full forward's."""
    out = model.get_output_embeddings()(h) if weight is None else nn.functional.linear(h, weight)
    cap = getattr(model.config, "final_logit_softcapping", None)
    return out if not cap else torch.tanh(out / cap) * cap


def is_sliding(config, layer: int) -> bool:
    """Whether decoder layer `layer` attends within a sliding window."""
    types = getattr(config, "layer_types", None)
    if types:
        return types[layer] == "sliding_attention"
    # Families without layer_types (Mistral, Phi-3) slide every layer when a window is set.
    return getattr(config, "sliding_window", None) is not None and config.model_type != "gpt2"


def mask(model, h: torch.Tensor, cache, pos: torch.Tensor, sliding: bool, cache_layer: int,
         pad: torch.Tensor | None = None):
    """The family's own causal mask for queries h (B, n, H) at `pos`, sized against layer
    `cache_layer` of `cache` (None: no cache); pad (B, n) 1 on real tokens, or None."""
    build = create_sliding_window_causal_mask if sliding else create_causal_mask
    return build(config=model.config, inputs_embeds=h, attention_mask=pad, cache=cache,
                 position_ids=pos, layer_idx=cache_layer)


def call_layer(layer: nn.Module, h: torch.Tensor, rotary, attention_mask, pos, cache):
    """One decoder layer with the keywords its family takes (GPT-2 takes no rotary)."""
    kwargs = {} if rotary is None else {"position_embeddings": rotary}
    out = layer(h, attention_mask=attention_mask, position_ids=pos, cache=cache,
                use_cache=cache is not None, **kwargs)
    return out[0] if isinstance(out, tuple) else out


def run_layers(model, h: torch.Tensor, layers: range, cache, start: int) -> torch.Tensor:
    """Run decoder `layers` on h (1, n, H) at positions start.., appending to `cache`.

    Each layer in `layers` must already hold exactly `start` positions; layers of one kind
    (full / sliding) share a mask, built against the first of that kind in `layers`.
    """
    p = parts(model)
    pos = positions(start, h.shape[1], h.device)
    rotary = rope(model, h, pos)
    masks: dict[bool, object] = {}
    for i in layers:
        sliding = is_sliding(model.config, i)
        # One query attends to everything cached: no mask needed (SDPA's fast path).
        if sliding not in masks:
            masks[sliding] = (mask(model, h, cache, pos, sliding, i) if h.shape[1] > 1
                              else None)
        h = call_layer(p.blocks[i], h, rotary, masks[sliding], pos, cache)
    return h


def exit_states(hidden_states: tuple[torch.Tensor, ...], exit_layer: int) -> torch.Tensor:
    """The layer-`exit_layer` output from a forward's output_hidden_states tuple.

    hidden_states[0] is the embedding and hidden_states[i] the output of layer i - 1, so the
    state after the first `exit_layer` layers is hidden_states[exit_layer] (1 <= l < L).
    """
    return hidden_states[exit_layer]
