"""Draft vocabularies: the tokens a drafter may propose, chosen from the model's own
self-distilled answers. Scoring only those rows of the LM head makes drafting several times
cheaper on small models, whose LM head is a large share of the weights; verification still
reads the full distribution, so decoding stays lossless."""

from __future__ import annotations

import torch

from trainer.features import Features


def draft_vocabulary(feats: Features, size: int, keep: tuple[int, ...], vocab_size: int,
                     extra: torch.Tensor | None = None) -> torch.Tensor | None:
    """(V',) sorted ids of at most `size` tokens: the most frequent among the answers' tokens
    (and `extra` tokens, e.g. the model's own guesses at answer positions), always with
    `keep` (e.g. EOS: the end of a reply must stay draftable); tokens never seen are left
    out. None when `size` is 0 or covers the whole vocabulary."""
    if size <= 0 or size >= vocab_size:
        return None
    seen = feats.ids[feats.mask]
    if extra is not None:
        seen = torch.cat([seen, extra])
    counts = torch.bincount(seen, minlength=vocab_size).float()
    counts[list(keep)] = float("inf")
    top = counts.topk(size).indices
    return torch.sort(top[counts[top] > 0]).values


def coverage(feats: Features, vocab: torch.Tensor | None) -> float:
    """Share of the answer tokens in `feats` inside the draft vocabulary."""
    if vocab is None:
        return 1.0
    answer = feats.ids[feats.mask]
    inside = torch.isin(answer, vocab.to(answer.device)).float().mean()
    return round(float(inside), 4) if answer.numel() else 0.0
