"""The cost curve of a decode step: seconds to verify n tokens at once on the loaded
weights (the report shows each as a multiple of a plain, one-token step). Drafting pays only
where a step of a few tokens costs about what one costs; low-bit weight kernels are where
this can break."""

from __future__ import annotations

from engine.drafters.payoff import FixedChain, round_seconds

SIZES = (1, 2, 4, 8, 16, 32)  # tokens per step (the pending token included)


def step_costs(lm, sizes=SIZES, repeats: int = 3) -> dict[int, float]:
    """{n: median seconds of a step verifying n tokens} on `lm`, after a 192-token prompt;
    steps of different sizes alternate (round by round) so load on the machine hits all.
    Each is timed with a chain of n - 1 drafts, all rejected, so the cache stays as plain
    decoding's."""
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(repeats):
        for n in sizes:
            times[n].append(round_seconds(lm, FixedChain(n - 1), repeats=1))
    return {n: sorted(t)[len(t) // 2] for n, t in times.items()}
