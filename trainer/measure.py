"""Timed greedy replies for calibration: plain decoding and each candidate drafter decode
the same held-out prompts, interleaved prompt by prompt (engine.decode.interleave), and each is
judged by its median per-prompt speed ratio to plain decoding."""

from __future__ import annotations

import statistics
import threading

from engine.config import SamplingParams
from engine.decode.drafter import Drafter
from engine.decode.generate import run
from engine.decode.interleave import interleaved
from engine.decode.stats import GenerationStats
from engine.progress import Progress, ProgressFn, ignore

PLAIN = "plain"  # the name plain decoding goes by among the measured drafters


def measure(lm, drafters: dict[str, Drafter], prompts: list[list[int]], params: SamplingParams,
            progress: ProgressFn = ignore, cancel: threading.Event | None = None) -> dict:
    """Replies to `prompts` with each drafter (PLAIN among them). name -> tokens/s, speedup
    (median per-prompt ratio to PLAIN), tokens/step, CTAR and the share of replies identical
    to plain decoding's."""
    names = list(drafters)
    rates = {name: [] for name in names}
    steps = {name: GenerationStats() for name in names}
    same = {name: [] for name in names}

    def reply(name: str, ids: list[int]):
        return run(lm, ids, params, drafters[name])

    for n, replies in interleaved(names, prompts, reply, cancel):
        for name, (_text, out, stats) in replies.items():
            rates[name].append(stats.tokens_per_s)
            steps[name].accepted += stats.accepted
            same[name].append(out == replies[PLAIN][1])
        progress(Progress("calibrate", n + 1, len(prompts), f"timed replies to {n + 1} prompts"))
    result = {}
    for name in names:
        ratios = [r / p for r, p in zip(rates[name], rates[PLAIN], strict=True) if p > 0]
        result[name] = {
            "tokens_per_s": round(statistics.median(rates[name]), 2) if rates[name] else 0.0,
            "speedup": round(statistics.median(ratios), 3) if ratios else 0.0,
            "mean_accepted": round(steps[name].mean_accepted, 3),
            "ctar": [round(c, 4) for c in steps[name].ctar()],
            "greedy_match_rate": round(sum(same[name]) / max(1, len(same[name])), 3),
        }
    return result
