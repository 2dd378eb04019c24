"""Timing work on the model's device, and the one measure of what a decode step costs here.

CUDA kernels run asynchronously, so the clock is read only once the device has finished what
was queued before and during the timed call. A step's cost is timed once per loaded target
(`step_cost`) and cached on the loaded model; a target whose compiled step becomes ready
runs under another name and is timed again. Auto, the datastore's sizing, lookup's chain
length, calibration's plain step and the speed report all read this one curve."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.sampling import greedy_ids

SIZES = (1, 2, 4, 8, 16, 32)  # tokens per timed step (the pending token included)
ROUNDS = 3  # rounds of every size in turn, after a warm-up one; the median of each is kept
ALTERNATE = 4  # steps of up to this many tokens are timed in turn (see step_seconds)


def sync(device: torch.device | None = None) -> None:
    """Wait for the CUDA device's queued kernels (`device` None: the current one, if any);
    nothing to wait for elsewhere."""
    if device is None and torch.cuda.is_available():
        torch.cuda.synchronize()
    elif device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds(device: torch.device | None, fn: Callable, *args) -> float:
    """Wall seconds of fn(*args) on `device`, its queued kernels included."""
    sync(device)
    start = time.perf_counter()
    fn(*args)
    sync(device)
    return time.perf_counter() - start


class StepTimer:
    """Decode steps of a loaded model verifying n tokens, timed as often as asked at one
    position: the prompt is prefilled once, and each step writes the same cache rows and is
    rolled back, so repeated timings cost a step each and the cache never grows."""

    def __init__(self, lm, prompt_len: int = 192, room: int = 1):
        n = max(2, min(prompt_len, lm.context_len - room))
        ids = [(7 * i) % int(lm.model.config.vocab_size) for i in range(1, n + 1)]
        self.lm, self.ids, self.position = lm, ids, n - 1
        self.cache = lm.target.new_cache()
        with torch.inference_mode():
            lm.target.forward(self.cache, ids[:-1], 0, last_only=True)
            self._step(1)  # warm

    def seconds(self, tokens: int = 1, repeats: int = 3) -> float:
        """The fastest of `repeats` steps of `tokens` (the least disturbed by other work)."""
        with torch.inference_mode():
            return min(seconds(self.lm.device, self._step, tokens) for _ in range(repeats))

    def once(self, tokens: int) -> float:
        """Seconds of one step of `tokens` (step_seconds takes medians across rounds)."""
        with torch.inference_mode():
            return seconds(self.lm.device, self._step, tokens)

    def _step(self, tokens: int) -> None:
        # The pending token and tokens - 1 stand-in drafts, all read back and dropped: the
        # work and the host sync of a verification step whose drafts were all rejected.
        tail = self.ids[-1:] * tokens
        out = self.lm.target.forward(self.cache, tail, self.position)
        greedy_ids(out.logits).tolist()  # a step reads its tokens back to the host
        self.lm.target.rollback(self.cache, tokens)


def step_seconds(lm, sizes: tuple[int, ...] = SIZES, rounds: int = ROUNDS) -> dict[int, float]:
    """{n: median seconds of a step verifying n tokens} on `lm`, after a prompt of up to 192
    made-up tokens. Steps of up to ALTERNATE tokens alternate round by round, so load on
    the machine hits all; larger ones are timed after them, smallest first: a large step
    leaves a CPU slower for the next few steps (measured on a 2-core Xeon: a plain step
    4.5 ms among small ones, 7.7 just after a 32-token step and 6.8 two steps later), which
    would make plain steps look dearer, and drafts cheaper, than decoding finds them. Sizes
    past the model's window are left out."""
    fit = tuple(n for n in sizes if n < lm.context_len // 2) or sizes[:1]
    timer = StepTimer(lm, room=max(fit))
    for n in sorted(fit, reverse=True):
        timer.once(n)  # warm every size (a compiled step loads its kernels on first use)
    times: dict[int, list[float]] = {n: [] for n in fit}
    small = [n for n in fit if n <= ALTERNATE]
    for _ in range(rounds):
        for n in small:
            times[n].append(timer.once(n))
    for n in sorted(set(fit) - set(small)):
        timer.once(n)
        times[n] = [timer.once(n) for _ in range(rounds)]
    return {n: statistics.median(t) for n, t in times.items()}


@dataclass(frozen=True)
class StepCost:
    """What a verification step costs here, in plain steps, by the tokens it verifies:
    interpolated between measured points, extended past the last one along the last segment.
    Measured as a curve because it is not a line on low-bit weights: the kernel's cost grows
    steeply with rows until the bf16 copies take over (int4: 2 tokens 1.2, 8 tokens 1.8, 16
    tokens 2.3)."""

    points: tuple[tuple[int, float], ...] = ((1, 1.0), (16, 1.3))  # a bf16 CPU's
    plain_s: float = 0.0  # seconds of one plain step where measured (0: assumed)
    # sizes a step runs at, padded (a compiled step: 3 tokens cost what 4 do, 5 what 8 do;
    # interpolating between them would price 5-7-token drafts at a third less than they cost)
    pads: tuple[int, ...] = ()

    @classmethod
    def linear(cls, per_token: float) -> StepCost:
        """Each token past the first adds `per_token` plain steps."""
        return cls(((1, 1.0), (2, 1.0 + per_token)))

    @classmethod
    def measured(cls, step_s: dict[int, float], pads: tuple[int, ...] = ()) -> StepCost:
        """From step_seconds' figures: each size as a multiple of the one-token step."""
        plain, points, top = step_s[min(step_s)], [], 1.0
        for n, s in sorted(step_s.items()):  # more tokens never cost less: timing noise
            top = max(top, s / plain)
            points.append((n, top))
        return cls(tuple(points), plain, pads)

    def __call__(self, tokens: int) -> float:
        tokens = next((p for p in sorted(self.pads) if p >= tokens), tokens)
        points = self.points if self.points[0][0] == 1 else ((1, 1.0), *self.points)
        for (n0, c0), (n1, c1) in zip(points, points[1:], strict=False):
            if tokens <= n1 or (n1, c1) == points[-1]:
                return max(1.0, c0 + (c1 - c0) * (tokens - n0) / (n1 - n0))
        return points[-1][1]  # a single measured point: every size costs the same


def step_cost(lm) -> StepCost:
    """The step-cost curve of `lm` as it runs now, timed on first use and cached on the
    loaded model per target step (a compiled step that becomes ready is timed afresh)."""
    key = lm.target.name
    if key not in lm.step_costs:
        lm.step_costs[key] = StepCost.measured(step_seconds(lm), lm.target.padded_sizes())
    return lm.step_costs[key]


def plain_step_seconds(lm) -> float:
    """Seconds of one plain decode step of `lm` (what every speedup is a multiple of)."""
    return step_cost(lm).plain_s
