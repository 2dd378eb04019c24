"""Calibration on this machine: pick the Medusa tree that decodes fastest here.

1. Held-out per-head top-i accuracies -> the paper's greedy sparse tree for several node
   budgets, each with its expected tokens per step (independent-heads estimate).
2. Time one real step (heads + tree verification) per budget on a held-out context; the
   estimate tokens/step / step time ranks the budgets.
3. Decode held-out prompts with plain decoding and the best-ranked trees, interleaved prompt
   by prompt, and keep whichever was fastest measured. When plain decoding wins, the tree is
   empty: the accelerator then never makes decoding slower, and says so.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from engine.config import SamplingParams
from engine.drafters.base import Drafter
from engine.drafters.medusa import MedusaDrafter, MedusaHeads, tree_step_seconds
from engine.progress import Progress, ProgressFn, ignore
from engine.tree import build_tree, expected_tokens, greedy_tree, marginal_accuracies
from trainer.context import answer_room
from trainer.measure import PLAIN, measure


@dataclass(frozen=True)
class CalibrationConfig:
    """What calibration tries and how long it measures."""

    budgets: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)  # drafted nodes per tree tried
    finalists: int = 2  # best-estimated trees decoded for real against plain decoding
    prompts: int = 4  # held-out prompts decoded per finalist
    max_new_tokens: int = 64  # tokens per timed reply
    step_repeats: int = 5  # timed repetitions per tree size (the median is kept)


@dataclass
class TreeChoice:
    """The chosen tree and the figures behind the choice."""

    tree: list[list[int]]  # chosen choices; [] = no tree beat plain decoding here
    pays: bool  # a tree was measurably faster than plain decoding
    chosen: str = PLAIN  # key of the winner in `measured`
    # name -> {"tokens_per_s", "mean_accepted", "speedup", "nodes"}
    measured: dict = field(default_factory=dict)
    # per budget: nodes, expected tokens, step ms, estimated speedup, tree
    estimates: list[dict] = field(default_factory=list)


def candidate_trees(topk_acc: list[list[float]],
                    budgets: tuple[int, ...]) -> list[list[tuple[int, ...]]]:
    """The greedy sparse tree for each node budget (distinct trees only)."""
    marginal = marginal_accuracies(topk_acc)
    trees, seen = [], set()
    for b in budgets:
        choices = greedy_tree(marginal, b)
        if choices and tuple(choices) not in seen:
            seen.add(tuple(choices))
            trees.append(choices)
    return trees


def calibrate(lm, heads: MedusaHeads, topk_acc: list[list[float]], prompts: list[list[int]],
              config: CalibrationConfig, progress: ProgressFn = ignore,
              cancel: threading.Event | None = None,
              seconds: float | None = None) -> TreeChoice:
    """Choose the fastest tree measured on this machine (or none, when none pays), decoding
    as many prompts (up to config.prompts, at least one) as fit in `seconds`."""
    start = time.perf_counter()
    marginal = marginal_accuracies(topk_acc)
    trees = candidate_trees(topk_acc, config.budgets)
    context = max(prompts, key=len)
    plain_s = tree_step_seconds(lm, heads, [], context, config.step_repeats)
    estimates = []
    for i, choices in enumerate(trees):
        secs = tree_step_seconds(lm, heads, choices, context, config.step_repeats)
        expected = expected_tokens(choices, marginal)
        estimates.append({"nodes": len(choices), "expected_tokens": round(expected, 3),
                          "step_ms": round(secs * 1e3, 2),
                          "plain_step_ms": round(plain_s * 1e3, 2),
                          "estimated_speedup": round(expected * plain_s / secs, 3),
                          "tree": choices})
        progress(Progress("calibrate", i + 1, len(trees) + config.finalists,
                          f"timed a {len(choices)}-node tree"))
    finalists = [e["tree"] for e in sorted(estimates, key=lambda e: -e["estimated_speedup"])]
    finalists = finalists[: config.finalists]
    left = None if seconds is None else seconds - (time.perf_counter() - start)
    count = prompts_that_fit(left, plain_s, len(finalists) + 1, config)
    measured = measure_decoding(lm, heads, finalists, prompts[:count], config, progress, cancel)
    # Plain decoding's speedup is 1 by definition; a tree must beat it to be kept.
    winner = max(measured, key=lambda name: measured[name]["speedup"], default=PLAIN)
    tree = [list(c) for c in tree_names(finalists)[winner]]
    for e in estimates:
        e["tree"] = [list(c) for c in e["tree"]]
    return TreeChoice(tree, bool(tree), winner, measured, estimates)


def prompts_that_fit(seconds: float | None, plain_s: float, candidates: int,
                     config: CalibrationConfig) -> int:
    """Prompts each candidate (plain decoding included) can decode in `seconds`, at most
    config.prompts and at least one; a reply is priced at plain decoding's step time (trees
    are faster, prefills add a little: the two roughly cancel)."""
    if seconds is None:
        return config.prompts
    per_prompt = candidates * config.max_new_tokens * plain_s
    return max(1, min(config.prompts, int(seconds // max(per_prompt, 1e-9))))


def measure_decoding(lm, heads: MedusaHeads, trees, prompts: list[list[int]],
                     config: CalibrationConfig, progress: ProgressFn = ignore,
                     cancel: threading.Event | None = None) -> dict:
    """Greedy replies to `prompts` with plain decoding and with each tree (trainer.measure).
    Returns name (see tree_names) -> tokens/s, tokens/step, speedup, nodes, ..."""
    candidates = tree_names(trees)
    drafters: dict[str, Drafter] = {
        name: MedusaDrafter(lm, heads, build_tree(choices, heads.settings.num_heads))
        if choices else Drafter()
        for name, choices in candidates.items()
    }
    params = SamplingParams(max_new_tokens=answer_room(lm, config.max_new_tokens))
    measured = measure(lm, drafters, prompts, params, progress, cancel)
    return {name: {**figures, "nodes": len(candidates[name])}
            for name, figures in measured.items()}


def tree_names(trees) -> dict[str, list]:
    """Name -> tree choices of what calibration decodes: plain decoding ([]) and each tree."""
    return {PLAIN: [], **{f"tree-{i}": list(choices) for i, choices in enumerate(trees)}}
