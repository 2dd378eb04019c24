"""Run the method table over the prompts: warm-up, then methods interleaved prompt by prompt
in a rotating order (engine.decode.interleave, as calibration times). With several passes, a
prompt's speed is the median over the passes, and each pass starts with a fresh method table
(Auto learns as it goes and must not meet a prompt it has already decoded).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from bench.memory import MemoryProbe
from bench.methods import Contender, Outcome
from bench.prompts import BenchPrompt
from engine.decode.interleave import interleaved
from engine.progress import Eta, Progress, ProgressFn, ignore


@dataclass
class Measurement:
    """One method on one prompt, as measured."""

    method: str  # method name
    prompt_index: int  # position in the run's prompt list
    category: str  # the prompt's category
    prompt_tokens: int  # prompt length fed to every method
    ids: list[int]  # generated token ids
    wall_s: float  # wall time of the whole call (prefill included)
    ttft_s: float  # time to the first generated token
    accepted: list[int] | None  # per step after prefill: drafts accepted; None = unknown
    peak_mem_mb: float  # peak memory during the call (see MemoryProbe.describe)
    peak_mem_delta_mb: float  # that peak minus the memory in use when the call began
    used: dict[str, int] | None = None  # Auto: its steps of each kind (None for the others)
    passes: list[float] | None = None  # tokens/s of each pass when there were several

    @property
    def tokens_per_s(self) -> float:
        return len(self.ids) / self.wall_s if self.wall_s > 0 else 0.0

    def to_json(self) -> dict:
        return {
            "method": self.method, "prompt": self.prompt_index, "category": self.category,
            "prompt_tokens": self.prompt_tokens, "tokens": len(self.ids),
            "wall_s": round(self.wall_s, 5), "ttft_s": round(self.ttft_s, 5),
            "tokens_per_s": round(self.tokens_per_s, 4),
            "steps": None if self.accepted is None else len(self.accepted),
            "peak_mem_mb": round(self.peak_mem_mb, 2), "token_ids": self.ids,
            **({"used": self.used} if self.used else {}),
            **({"passes_tokens_per_s": [round(t, 4) for t in self.passes]}
               if self.passes else {}),
        }


def measure(method: Contender, prompt_ids: list[int],
            probe: MemoryProbe) -> tuple[Outcome, float, float, float]:
    """(outcome, wall seconds, peak MB, peak delta MB) of one call."""
    if method.held_out is not None:
        method.held_out.hold_out(prompt_ids)
    probe.start()
    start = time.perf_counter()
    outcome = method.generate(prompt_ids)
    wall = time.perf_counter() - start
    peak, delta = probe.peak()
    return outcome, wall, peak, delta


def run_bench(
    methods: dict[str, Contender],
    prompts: list[BenchPrompt],
    prompt_ids: list[list[int]],
    probe: MemoryProbe,
    progress: ProgressFn = ignore,
    passes: int = 1,
    fresh: Callable[[], dict[str, Contender]] | None = None,
) -> list[Measurement]:
    """Warm every method up on the first prompt, then run all of them on each prompt in
    turn, rotating their order; `passes` times over, each pass after the first with
    `fresh()`'s method table. Returns one Measurement per (prompt, method)."""
    per_pass = len(prompts) * len(methods)
    eta = Eta(passes * per_pass)
    runs = []
    for n in range(passes):
        table = methods if n == 0 or fresh is None else fresh()
        runs.append(_one_pass(table, prompts, prompt_ids, probe, progress, eta, n * per_pass))
    progress(Progress("done", eta.total, eta.total, "done"))
    return runs[0] if passes == 1 else [_merge(ms) for ms in zip(*runs, strict=True)]


def _one_pass(methods: dict[str, Contender], prompts: list[BenchPrompt],
              prompt_ids: list[list[int]], probe: MemoryProbe, progress: ProgressFn,
              eta: Eta, done: int) -> list[Measurement]:
    names = list(methods)
    for i, name in enumerate(names):
        progress(Progress("warmup", i, len(names), f"warm-up: {name}"))
        methods[name].generate(prompt_ids[0])
    finished = done

    def one(name: str, item: tuple[int, BenchPrompt, list[int]]) -> Measurement:
        nonlocal finished
        p, prompt, ids = item
        outcome, wall, peak, delta = measure(methods[name], ids, probe)
        m = Measurement(name, p, prompt.category, len(ids), outcome.ids, wall,
                        outcome.ttft_s, outcome.accepted, peak, delta, outcome.used)
        finished += 1
        progress(Progress(
            "bench", finished, eta.total,
            f"prompt {p + 1}/{len(prompts)} ({prompt.category}) {name} "
            f"{m.tokens_per_s:.1f} tok/s",
            eta.left(finished),
        ))
        return m

    items = [(p, prompt, ids)
             for p, (prompt, ids) in enumerate(zip(prompts, prompt_ids, strict=True))]
    # Each prompt's measurements in the order they ran.
    return [m for _p, ran in interleaved(names, items, one) for m in ran.values()]


def _merge(passes: tuple[Measurement, ...]) -> Measurement:
    """One prompt and method over several passes: tokens/s and time to first token are the
    medians over the passes, peak memory the highest; the tokens, acceptance and Auto's mix
    are the first pass's (greedy decoding repeats them, except where Auto's mix changed)."""
    first = passes[0]
    speeds = [m.tokens_per_s for m in passes]
    speed = statistics.median(speeds)
    return replace(first, wall_s=len(first.ids) / speed if speed > 0 else first.wall_s,
                   ttft_s=statistics.median(m.ttft_s for m in passes),
                   peak_mem_mb=max(m.peak_mem_mb for m in passes),
                   peak_mem_delta_mb=max(m.peak_mem_delta_mb for m in passes), passes=speeds)
