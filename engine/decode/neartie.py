"""Is a greedy mismatch a near-tie that reduced precision may flip, or a real defect?

Batched verification runs the same model on differently shaped matmuls than one-token
decoding, so in bf16 (or 4-bit with bf16 compute) two candidates whose logits differ by
less than the rounding at that magnitude can swap places. Anything wider is a genuine
mismatch. This module measures it: one plain forward over the prompt and the two runs'
common prefix, then the logit gap between the two runs' choices at the first difference.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Tolerance in units of the dtype's spacing at the top logit (eps * |top|). Measured on the
# bundled model in bf16 on a CPU: between a 16-token batched step, one-token steps and a
# full-prompt forward over the same tokens, a single logit moved by up to 3.7 spacings; the
# gap between two logits can move by both their errors, so twice that, rounded up. A real
# defect (a wrong draft accepted) is off by whole logits, far outside it.
ROUNDING_SPACINGS = 8.0


@dataclass(frozen=True)
class Divergence:
    """Where two greedy replies first differ, and how close the plain model's call was."""

    position: int  # index in the reply of the first differing token (0 = first reply token)
    expected: int | None  # the reference run's token there (None: it had ended)
    got: int | None  # the other run's token there (None: it had ended)
    gap: float  # plain model's logit of its choice minus the other candidate's (>= 0)
    tolerance: float  # the dtype's rounding at that logit's magnitude, ROUNDING_SPACINGS wide

    @property
    def near_tie(self) -> bool:
        return self.gap <= self.tolerance

    def verdict(self, dtype: str) -> str:
        """One line for people; token numbers count from 1."""
        where, rounding = f"token {self.position + 1}", f"{dtype} rounding {self.tolerance:.3g}"
        if self.near_tie:
            return f"near-tie (gap {self.gap:.3g}, within {rounding}) at {where}"
        return f"MISMATCH at {where} (gap {self.gap:.3g}, {rounding})"

    def to_json(self) -> dict:
        return {"position": self.position, "expected": self.expected, "got": self.got,
                "gap": round(self.gap, 6), "tolerance": round(self.tolerance, 6),
                "near_tie": self.near_tie}


def first_difference(reference: Sequence[int], other: Sequence[int]) -> int | None:
    """Index of the first token where the replies differ (one ending early counts);
    None when they are identical."""
    for i, (a, b) in enumerate(zip(reference, other, strict=False)):
        if a != b:
            return i
    return None if len(reference) == len(other) else min(len(reference), len(other))


def tolerance(top_logit: float, dtype: torch.dtype) -> float:
    """How far rounding in `dtype` can move a logit of this magnitude."""
    return ROUNDING_SPACINGS * torch.finfo(dtype).eps * max(abs(top_logit), 1.0)


def judge(logits: torch.Tensor, position: int, expected: int | None, got: int | None,
          dtype: torch.dtype) -> Divergence:
    """The verdict from the plain model's (V,) logits at the first differing position.

    The gap is between the two runs' tokens when both are known; when one run ended there
    (its token was an end-of-reply the ids leave out) it is the plain top-2 gap."""
    logits = logits.float()
    top2 = torch.topk(logits, 2)
    top = float(top2.values[0])
    if expected is not None and got is not None:
        gap = abs(float(logits[expected]) - float(logits[got]))
    else:
        gap = top - float(top2.values[1])
    return Divergence(position, expected, got, gap, tolerance(top, dtype))


def measure(lm, prompt_ids: Sequence[int], reference: Sequence[int],
            other: Sequence[int]) -> Divergence | None:
    """Compare two greedy replies to the same prompt; None when identical. Runs the plain
    model once over prompt + the common prefix (its last position predicts the first
    differing token)."""
    n = first_difference(reference, other)
    if n is None:
        return None
    ids = torch.tensor([[*prompt_ids, *reference[:n]]], device=lm.device)
    with torch.inference_mode():
        logits = lm.model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[0, -1]
    expected = reference[n] if n < len(reference) else None
    got = other[n] if n < len(other) else None
    return judge(logits, n, expected, got, lm.model.dtype)
