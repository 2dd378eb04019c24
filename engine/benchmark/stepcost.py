"""The cost curve of a decode step: seconds to verify n tokens at once on the loaded
weights (the report shows each as a multiple of a plain, one-token step). Drafting pays only
where a step of a few tokens costs about what one costs; low-bit weight kernels are where
this can break."""

from __future__ import annotations

from engine.drafters.base import DecodeState, Draft, Drafter
from engine.drafters.payoff import round_seconds

SIZES = (1, 2, 4, 8, 16, 32)  # tokens per step (the pending token included)


class ChainDrafter(Drafter):
    """Proposes a fixed chain of `size - 1` tokens (repeats of the pending one) to time an
    n-token verification step; accepts nothing, so the cache stays as plain decoding's."""

    def __init__(self, size: int):
        self.size = size

    def propose(self, state: DecodeState) -> Draft:
        return Draft.chain(state.ids[-1], [state.ids[-1]] * (self.size - 1))


def step_costs(lm, sizes=SIZES, repeats: int = 3) -> dict[int, float]:
    """{n: median seconds of a step verifying n tokens} on `lm`, after a 192-token prompt;
    steps of different sizes alternate (round by round) so load on the machine hits all."""
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(repeats):
        for n in sizes:
            times[n].append(round_seconds(lm, ChainDrafter(n), repeats=1))
    return {n: sorted(t)[len(t) // 2] for n, t in times.items()}
