"""Pure loss and metric functions for drafter training (no modules, no state)."""

from __future__ import annotations

import torch


def soft_cross_entropy(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Mean over rows of -sum_v p_teacher(v) log p_student(v) (KL up to the teacher's entropy).

    Both (N, C) over the same C columns: the whole vocabulary, or a candidate subset (then
    both distributions are renormalised over the subset). Computed in float32.
    """
    teacher = teacher_logits.float().softmax(-1)
    return -(teacher * student_logits.float().log_softmax(-1)).sum(-1).mean()


def sparse_soft_cross_entropy(student_logits: torch.Tensor, teacher_cols: torch.Tensor,
                              teacher_logits: torch.Tensor) -> torch.Tensor:
    """Per row, -sum_j p_teacher(j) log p_student(col_j): soft cross-entropy (KL up to the
    teacher's entropy) against a teacher known only on its top-k tokens.

    student_logits: (..., C) over the scored columns; teacher_cols: (..., k) long indices
    into those C columns; teacher_logits: (..., k). The teacher is renormalised over its
    top-k, the student over the C columns. Returns (...,) float32 losses.
    """
    teacher = teacher_logits.float().softmax(-1)
    logp = student_logits.float().log_softmax(-1).gather(-1, teacher_cols)
    return -(teacher * logp).sum(-1)


def head_weights(num_heads: int, decay: float = 0.8) -> list[float]:
    """Medusa's loss weights lambda_k = decay^k for heads k = 1..K (later heads matter less)."""
    return [decay**k for k in range(1, num_heads + 1)]


def candidate_columns(teacher_top: torch.Tensor, vocab_size: int, extra: int,
                      generator: torch.Generator | None = None) -> torch.Tensor:
    """Vocabulary columns a sampled-softmax step scores: every teacher top-k token in the
    batch plus `extra` random others (negatives the student must keep low).

    teacher_top: (..., k) long ids. Returns (C,) sorted unique long ids.
    """
    rand = torch.randint(0, vocab_size, (extra,), generator=generator)
    return torch.unique(torch.cat([teacher_top.reshape(-1), rand]))


def rank_hits(guesses: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """(N, R) ranked guesses, (N,) target ids -> (N, R) bool: hits[n, i] = the rank-i guess is
    the target.

    Row sums over the first i columns give top-i accuracy; columns alone give the per-rank
    (marginal) accuracies the sparse tree is built from.
    """
    return guesses == target.unsqueeze(-1)
