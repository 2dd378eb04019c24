"""Goodness-of-fit helpers for the statistical tests (no scipy needed)."""

from __future__ import annotations

import torch


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson chi-square test of observed `counts` against expected `probs`.

    Cells with small expected counts are pooled into one (the usual validity rule).
    Returns the p-value: small means the samples did not come from `probs`.
    """
    n = counts.sum().item()
    expected = probs.double() * n
    big = expected >= min_expected
    obs = torch.cat([counts.double()[big], counts.double()[~big].sum().reshape(1)])
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    # Observations where nothing is expected are an outright failure.
    if counts.double()[probs == 0].sum() > 0:
        return 0.0
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = max(1, obs.numel() - 1)
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2.0))


def whole(target_probs, n: int) -> torch.Tensor:
    """The (n, V) probabilities an acceptance rule was given, as one tensor: a CPU step
    hands its rules rows made as they are read (engine.decode.verify.RowProbs)."""
    if isinstance(target_probs, torch.Tensor):
        return target_probs
    return torch.stack([target_probs[i] for i in range(n)])
