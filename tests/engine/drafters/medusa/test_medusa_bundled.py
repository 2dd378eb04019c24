"""Medusa on the bundled SmolLM2-135M: the tree and random heads the bundled-model tests
share, and the memory the heads add (exact replies: test_bundled_drafters.py)."""

from __future__ import annotations

import torch

from engine.decode.tree import build_tree, greedy_tree
from engine.drafters.medusa import MedusaDrafter, MedusaHeads, MedusaSettings

# Accuracies shaped like trained heads': a 16-node tree, bushy near the root.
TREE = greedy_tree([[0.3, 0.1, 0.05, 0.03], [0.15, 0.06, 0.03], [0.08, 0.03], [0.04]], 16)


def _random_heads(hidden: int) -> MedusaHeads:
    heads = MedusaHeads(hidden, MedusaSettings(4))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # small residual changes: guesses near the model's own next token
        heads.weight.copy_(torch.randn(heads.weight.shape, generator=gen) * 0.5 / hidden**0.5)
        rank = heads.token_up.shape[-1]  # and on the pending token
        heads.token_up.copy_(torch.randn(heads.token_up.shape, generator=gen) * 0.5 / rank**0.5)
    return heads


def test_heads_add_at_most_five_percent_of_model_memory(bundled_lm):
    """The heads plus the LM-head rows of an 8192-token draft vocabulary the drafter keeps."""
    lm = bundled_lm
    heads = MedusaHeads(int(lm.model.config.hidden_size), MedusaSettings(4), torch.arange(8192))
    drafter = MedusaDrafter(lm, heads, build_tree(TREE, 4))
    model_bytes = sum(p.numel() * p.element_size() for p in lm.model.parameters())
    added = sum(t.numel() * t.element_size() for t in drafter.heads.state_dict().values())
    added += drafter._projection.numel() * drafter._projection.element_size()
    assert added <= 0.05 * model_bytes
