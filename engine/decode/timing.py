"""Timing work on the model's device, and the one measure of what a decode step costs here.

CUDA kernels run asynchronously, so a call on a CUDA device is timed by events recorded on
its stream around it (the device idle before); elsewhere by the wall clock. A step's cost
is timed once per loaded target (`step_cost`) and cached on the loaded model; a target
whose compiled step becomes ready runs under another name and is timed again. Greedy and
sampled steps have a curve each: a sampled step also turns every verified row into float32
probabilities (top-p finds each row's nucleus) and reads the acceptance rule's draws
back, so its drafts cost more plain steps. The greedy curve is timed at load, a sampled one
on the first reply with its settings. Auto, the datastore's sizing, lookup's chain length,
Medusa's cut, calibration's plain step and the speed report all read these curves."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.config import SamplingParams
from engine.decode.sampling import greedy_ids, make_generator
from engine.decode.verify import accept_pointmass, probabilities

SIZES = (1, 2, 4, 8, 16, 32)  # tokens per timed step (the pending token included)
ROUNDS = 3  # rounds of every size in turn, after a warm-up one; the median of each is kept
ALTERNATE = 4  # steps of up to this many tokens are timed in turn (see step_seconds)


def sync(device: torch.device | None = None) -> None:
    """Wait for the device's queued kernels (`device` None: the current CUDA one, if any):
    CUDA and Apple's GPU run them asynchronously; nothing to wait for elsewhere."""
    if on_cuda(device):
        torch.cuda.synchronize(device)
    elif device is not None and device.type == "mps":
        torch.mps.synchronize()


def on_cuda(device: torch.device | None) -> bool:
    """Whether work on `device` (None: the current one) runs on a CUDA device."""
    return torch.cuda.is_available() if device is None else device.type == "cuda"


def seconds(device: torch.device | None, fn: Callable, *args) -> float:
    """Seconds of fn(*args) on `device`, its queued kernels included: by CUDA events on a
    CUDA device, else by the wall clock."""
    sync(device)  # nothing queued before hides the call's own host work
    if on_cuda(device):
        return event_seconds(device, fn, *args)
    start = time.perf_counter()
    fn(*args)
    sync(device)
    return time.perf_counter() - start


def event_seconds(device: torch.device | None, fn: Callable, *args) -> float:
    """Seconds of fn(*args) between two CUDA events recorded on the current stream of
    `device`: the device's own clock, with no host sync between them but the call's own."""
    stream = torch.cuda.current_stream(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    fn(*args)
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / 1e3  # milliseconds


class StepTimer:
    """Decode steps of a loaded model verifying n tokens, timed as often as asked at one
    position: the prompt is prefilled once, and each step writes the same cache rows and is
    rolled back, so repeated timings cost a step each and the cache never grows. Greedy
    steps unless `params` samples: then each step also does a sampled step's verification
    work (see _sampled)."""

    def __init__(self, lm, prompt_len: int = 192, room: int = 1,
                 params: SamplingParams | None = None):
        n = max(2, min(prompt_len, lm.context_len - room))
        ids = [(7 * i) % int(lm.model.config.vocab_size) for i in range(1, n + 1)]
        self.lm, self.ids, self.position = lm, ids, n - 1
        self.params = None if params is None or params.greedy else params
        # the acceptance rule's draws, on the model's device as a reply's are
        self.generator = None if self.params is None else make_generator(0, lm.device)
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
        if self.params is None:
            greedy_ids(out.logits).tolist()  # a step reads its tokens back to the host
        else:
            self._sampled(out.logits, tail)
        self.lm.target.rollback(self.cache, tokens)

    def _sampled(self, logits: torch.Tensor, tail: list[int]) -> None:
        """A sampled step's verification of (n, V) logits over the chain `tail`: float32
        probabilities under the reply's settings, then the lossless rule for point-mass
        drafts, both as a reply makes them here (verify.probabilities: on a CPU the rows the
        rule reaches, tried in turn; elsewhere every row and every trial at once). The
        stand-in drafts repeat the pending token, which the model seldom keeps: the work of
        a step whose drafts were refused (n = 1: a plain sampled step)."""
        probs = probabilities(logits.float(), self.params)
        chain = [[i + 1] for i in range(len(tail) - 1)] + [[]]
        accept_pointmass(chain, tail, probs, self.generator)


def step_seconds(lm, sizes: tuple[int, ...] = SIZES, rounds: int = ROUNDS,
                 params: SamplingParams | None = None) -> dict[int, float]:
    """{n: median seconds of a step verifying n tokens} on `lm` (sampled under `params`
    where they sample, else greedy), after a prompt of up to 192
    made-up tokens. Steps of up to ALTERNATE tokens alternate round by round, so load on
    the machine hits all; larger ones are timed after them, smallest first: a large step
    leaves a CPU slower for the next few steps (measured on a 2-core Xeon: a plain step
    4.5 ms among small ones, 7.7 just after a 32-token step and 6.8 two steps later), which
    would make plain steps look dearer, and drafts cheaper, than decoding finds them. Sizes
    past the model's window are left out."""
    fit = tuple(n for n in sizes if n < lm.context_len // 2) or sizes[:1]
    timer = StepTimer(lm, room=max(fit), params=params)
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


def step_cost(lm, params: SamplingParams | None = None) -> StepCost:
    """The step-cost curve of `lm` as it runs now for replies with `params` (None or greedy:
    the greedy curve), timed on first use and cached on the loaded model per target step (a
    compiled step that becomes ready is timed afresh) and per kind of step (curve_key)."""
    key = curve_key(lm.target.name, params)
    if key not in lm.step_costs:
        sampled = None if params is None or params.greedy else params
        lm.step_costs[key] = StepCost.measured(step_seconds(lm, params=sampled),
                                               lm.target.padded_sizes())
    return lm.step_costs[key]


def curve_key(target: str, params: SamplingParams | None) -> str | tuple:
    """Which cached curve prices a step of `target` for replies with `params`: greedy's
    under the target's name; a sampled one also by the filters that change its work (a
    top-k pass, a top-p sort per row), not by the temperature, which costs one division."""
    if params is None or params.greedy:
        return target
    return target, "sampled", params.top_k > 0, params.top_p < 1.0


def reply_cost(params: SamplingParams, greedy: StepCost,
               sampled: Callable[[SamplingParams], StepCost] | None) -> StepCost:
    """The curve a reply with `params` is priced by: `greedy` (timed at load) unless it
    samples and `sampled` (params -> curve, e.g. sampled_cost) is given."""
    return greedy if params.greedy or sampled is None else sampled(params)


def sampled_cost(lm) -> Callable[[SamplingParams], StepCost]:
    """params -> the curve a reply of `lm` with those settings is priced by (step_cost):
    what a drafter built at load keeps, so a sampled curve is timed only once a reply
    samples."""
    return lambda params: step_cost(lm, params)


def plain_step_seconds(lm) -> float:
    """Seconds of one plain decode step of `lm` (what every speedup is a multiple of)."""
    return step_cost(lm).plain_s
