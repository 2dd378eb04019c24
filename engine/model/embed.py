"""Text embeddings from the chat model itself: the mean of its last hidden states (after
its final norm) over the text's tokens, normalised to length 1. They are the chat model's
own representation, not a model trained for retrieval."""

from __future__ import annotations

import torch


def embed(lm, inputs: list[list[int]]) -> torch.Tensor:
    """(len(inputs), H) float32 unit vectors, one per token list (each run alone: no
    padding, so no input changes another's vector)."""
    base = lm.model.base_model  # the decoder without its LM head (no (n, V) logits)
    rows = []
    with torch.inference_mode():
        for ids in inputs:
            hidden = base(input_ids=torch.tensor([ids], device=lm.device)).last_hidden_state
            rows.append(torch.nn.functional.normalize(hidden[0].float().mean(0), dim=0))
    return torch.stack(rows).cpu()
