"""The cost curve of a decode step for the speed report: engine.decode.timing's curve of the loaded
model (timed once per loaded target), in seconds per step size. Drafting pays only where a
step of a few tokens costs about what one costs; low-bit weight kernels are where this can
break."""

from __future__ import annotations

from engine.decode.timing import step_cost


def seconds_by_size(lm) -> dict[int, float]:
    """{n: seconds of a step verifying n tokens} on `lm` (the pending token included)."""
    cost = step_cost(lm)
    return {n: c * cost.plain_s for n, c in cost.points}
