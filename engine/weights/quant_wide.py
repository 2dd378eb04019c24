"""When a low-bit model's bf16 copies (`--wide-copies`) pay: the step size from which
multiplying by them beats the low-bit kernel on this machine, measured once per load on the
model's own layers."""

from __future__ import annotations

import statistics

import torch

from engine.decode import timing

ROWS = (1, 2, 4, 8, 16, 32)  # step sizes (tokens) the costs are measured at


def crossover(low_bit: dict[int, float], wide: dict[int, float]) -> int:
    """Fewest rows from which the bf16 copies are at least as fast as the low-bit kernel at
    every measured size from there on (0: never). Inputs: seconds per step of n rows."""
    sizes = sorted(set(low_bit) & set(wide))
    for i, n in enumerate(sizes):
        if all(wide[m] <= low_bit[m] for m in sizes[i:]):
            return n
    return 0


def layer_costs(layers: list, rows=ROWS, repeats: int = 5) -> tuple[dict, dict]:
    """Median seconds of all `layers`' (engine.weights.quant.LowBitLinear) matmuls for a step of n
    rows, through the kernel and through the bf16 copies: {n: seconds} each."""
    device = layers[0].packed.device
    low, wide = {}, {}
    with torch.inference_mode():
        for n in rows:
            xs = {m.in_features: torch.randn(n, m.in_features, dtype=torch.bfloat16,
                                             device=device) for m in layers}
            low[n] = _median_seconds(
                lambda xs=xs: [m.low_bit(xs[m.in_features]) for m in layers], repeats, device)
            wide[n] = _median_seconds(
                lambda xs=xs: [xs[m.in_features] @ m.wide.t() for m in layers
                               if m.wide is not None], repeats, device)
    return low, wide


def measured_wide_rows(layers: list) -> int:
    """`crossover` of a model's low-bit layers measured here (a few hundred ms once per
    load); 0 where they keep no bf16 copies."""
    if any(m.wide is None for m in layers):
        return 0
    return crossover(*layer_costs(layers, repeats=3))


def _median_seconds(fn, repeats: int, device: torch.device) -> float:
    fn()  # warm-up
    return statistics.median(timing.seconds(device, fn) for _ in range(repeats))
