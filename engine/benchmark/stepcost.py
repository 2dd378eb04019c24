"""The cost curve of a decode step: seconds to verify n tokens at once, as a multiple of a
plain (one-token) step, on the loaded weights. Drafting pays only where a step of a few
tokens costs about what one costs; low-bit weight kernels are where this can break."""

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


def relative(costs: dict[int, float]) -> dict[int, float]:
    """Each step's cost in plain (n = 1) steps."""
    return {n: s / costs[1] for n, s in costs.items()}


def table(curves: dict[str, dict[int, float]]) -> list[str]:
    """Markdown rows: one per weight choice, the plain step in ms, then n-token steps in
    plain steps."""
    sizes = sorted({n for c in curves.values() for n in c})
    lines = ["| weights | plain step (ms) | " + " | ".join(f"n={n}" for n in sizes if n > 1)
             + " |", "|---|---|" + "---|" * (len(sizes) - 1)]
    for name, costs in curves.items():
        rel = relative(costs)
        lines.append(f"| {name} | {costs[1] * 1e3:.1f} | "
                     + " | ".join(f"{rel[n]:.2f}" for n in sizes if n > 1) + " |")
    return lines
