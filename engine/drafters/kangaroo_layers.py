"""Split execution of a Llama-style decoder: embed, run a range of layers, read the LM head.

Kangaroo runs the first `l` layers for each draft token and the remaining layers only at
verification, on the layer-`l` states saved while drafting. Hugging Face's decoder layers
are called one by one with the model's own rotary embedding and mask builders, so every
family listed in SUPPORTED behaves exactly as its full forward does.
"""

from __future__ import annotations

import torch
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from engine.errors import AcceleratorError

# model_type -> families whose decoder layers, rotary embedding, final norm and LM head
# follow the Llama layout (logits = lm_head(norm(h)), no logit soft-capping).
SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "gemma")


def check_supported(model) -> None:
    """Raise AcceleratorError unless Kangaroo can split this model's layers."""
    model_type = getattr(model.config, "model_type", "?")
    base = getattr(model, "model", None)
    parts = ("embed_tokens", "layers", "norm", "rotary_emb")
    if (
        model_type not in SUPPORTED
        or base is None
        or not all(hasattr(base, p) for p in parts)
        or getattr(model.config, "final_logit_softcapping", None)
    ):
        raise AcceleratorError(
            f"Kangaroo is not supported for this architecture ({model_type!r}); "
            f"supported: {', '.join(SUPPORTED)} (SmolLM2 is a llama)"
        )


def num_layers(model) -> int:
    return len(model.model.layers)


def embed(model, tokens: list[int]) -> torch.Tensor:
    """(1, n, H) input embeddings of `tokens` (Gemma's scaling lives in its embedding)."""
    ids = torch.tensor([tokens], device=model.model.embed_tokens.weight.device)
    return model.model.embed_tokens(ids)


def positions(start: int, n: int, device: torch.device) -> torch.Tensor:
    """(1, n) position ids start .. start + n - 1."""
    return torch.arange(start, start + n, device=device)[None]


def _is_sliding(config, layer: int) -> bool:
    types = getattr(config, "layer_types", None)
    if types:
        return types[layer] == "sliding_attention"
    return getattr(config, "sliding_window", None) is not None and config.model_type == "mistral"


def layer_masks(model, h: torch.Tensor, cache, pos: torch.Tensor,
                layers: range) -> dict[bool, object]:
    """Causal masks for the queries `h` (1, n, H) at `pos`, sized against the cache of the
    first layer of each kind (full / sliding) in `layers`: {is_sliding: mask or None}.

    Layers of one kind inside `layers` hold the same number of cached positions, even while
    the shallow and the deep layers differ in length mid-round.
    """
    masks: dict[bool, object] = {}
    for i in layers:
        sliding = _is_sliding(model.config, i)
        if sliding in masks:
            continue
        build = create_sliding_window_causal_mask if sliding else create_causal_mask
        masks[sliding] = build(config=model.config, inputs_embeds=h, attention_mask=None,
                               cache=cache, position_ids=pos, layer_idx=i)
    return masks


def run_layers(model, h: torch.Tensor, layers: range, cache, start: int) -> torch.Tensor:
    """Run decoder `layers` on h (1, n, H) at positions start.., appending to `cache`.

    Each layer in `layers` must already hold exactly `start` positions.
    """
    pos = positions(start, h.shape[1], h.device)
    rope = model.model.rotary_emb(h, pos)
    # One query attends to everything cached: no mask needed (SDPA's fast path).
    masks = layer_masks(model, h, cache, pos, layers) if h.shape[1] > 1 else {}
    for i in layers:
        h = model.model.layers[i](
            h,
            attention_mask=masks.get(_is_sliding(model.config, i)),
            position_ids=pos,
            cache=cache,
            use_cache=True,
            position_embeddings=rope,
        )
    return h


def exit_states(hidden_states: tuple[torch.Tensor, ...], exit_layer: int) -> torch.Tensor:
    """The layer-`exit_layer` output from a forward's output_hidden_states tuple.

    hidden_states[0] is the embedding and hidden_states[i] the output of layer i - 1, so the
    state after the first `exit_layer` layers is hidden_states[exit_layer] (1 <= l < L).
    """
    return hidden_states[exit_layer]
