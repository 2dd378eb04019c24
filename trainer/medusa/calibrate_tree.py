"""Calibration: how likely each node of the heads' candidate tree is to be kept, measured on
held-out answers, and what the heads then do on this machine.

1. Held-out per-head top-i accuracies -> the paper's greedy sparse tree (Medusa §2.3.3) of
   up to `nodes` candidates.
2. Each candidate's chance of being kept, counted on held-out positions: the share where
   every head along its path guessed the model's own greedy token at its rank. Counted, not
   multiplied from per-head accuracies, so heads that fail together are priced as they do.
   At decode time each step cuts this tree to the nodes that pay under the step costs and
   the drafted step's overhead timed there (engine.drafters.medusa).
3. Held-out prompts decoded plainly and with the heads, interleaved prompt by prompt: the
   speed the heads reach here, for the metrics and the verdict.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from engine.config import SamplingParams
from engine.decode.drafter import Drafter
from engine.decode.timing import plain_step_seconds
from engine.decode.tree import build_tree, greedy_tree, marginal_accuracies
from engine.drafters.medusa import MedusaDrafter, MedusaHeads
from engine.progress import Progress, ProgressFn, ignore
from trainer.context import answer_room
from trainer.losses import rank_hits
from trainer.measure import PLAIN, measure

CHUNK = 512  # held-out positions per heads' pass


@dataclass(frozen=True)
class CalibrationConfig:
    """What calibration counts and how long it measures."""

    nodes: int = 48  # candidate nodes of the tree (each step keeps the ones that pay)
    positions: int = 8192  # held-out positions the nodes' chances are counted on
    prompts: int = 4  # held-out prompts decoded plainly and with the heads
    max_new_tokens: int = 64  # tokens per timed reply


@dataclass
class TreeChoice:
    """The candidate tree and the figures measured with it."""

    candidates: list[list]  # [[choice, chance], ...] most likely first
    pays_off: bool  # decoding with the heads was measured faster than plain decoding here
    chosen: str = PLAIN  # the faster of the two in `measured`
    # name -> {"tokens_per_s", "mean_accepted", "speedup", ...}
    measured: dict = field(default_factory=dict)


def ranked_hits(lm, heads: MedusaHeads, inputs, teacher, pos: torch.Tensor, depth: int,
                ranks: int, chunk: int) -> Iterator[tuple[slice, torch.Tensor]]:
    """Per chunk of `pos`: its slice, and (B, depth, ranks) bool: the rank-r guess of head j
    (from the heads' vocabulary, as the drafter guesses) is the model's greedy token after
    position t + j + 1. Rows past a conversation's end are the callers' to mask out."""
    projection = heads.project(lm.model.get_output_embeddings().weight.detach())
    last = teacher.ids.shape[0] - 1
    for start in range(0, pos.numel(), chunk):
        p = pos[start:start + chunk]
        with torch.inference_mode():
            states, pending = inputs.at(p, lm.device)
            logits = heads.logits(states, pending, projection, depth).float()  # (B, d, V')
            guesses = heads.tokens(logits.topk(ranks, dim=-1).indices).cpu()  # (B, d, R)
        targets = torch.stack([teacher.ids[(p + j + 1).clamp(max=last), 0]
                               for j in range(depth)], dim=1)  # (B, d)
        yield slice(start, start + chunk), rank_hits(guesses, targets)


def node_chances(lm, heads: MedusaHeads, inputs, teacher, pos: torch.Tensor,
                 valid: torch.Tensor, choices: list[tuple[int, ...]]) -> list[float]:
    """Per candidate node, the share of held-out positions (those where its depth is still
    inside the conversation) at which every head along its path guessed the model's greedy
    token at that rank: its chance of being kept by greedy decoding."""
    if not choices:
        return []
    ranks = max(max(c) for c in choices) + 1
    depth = max(len(c) for c in choices)
    hits, counts = torch.zeros(len(choices)), torch.zeros(len(choices))
    for at, right in ranked_hits(lm, heads, inputs, teacher, pos, depth, ranks, CHUNK):
        v = valid[at]
        for n, choice in enumerate(choices):
            inside = v[:, len(choice) - 1]
            hits[n] += int((inside & right[:, range(len(choice)), list(choice)].all(-1)).sum())
            counts[n] += int(inside.sum())
    return [round(float(h / max(c, 1.0)), 5) for h, c in zip(hits, counts, strict=True)]


def candidates(lm, heads: MedusaHeads, topk_acc: list[list[float]], inputs, teacher,
               pos: torch.Tensor, valid: torch.Tensor, config: CalibrationConfig) -> list[list]:
    """[[choice, chance], ...]: the greedy tree's nodes with their counted chances, most
    likely first (a node never likelier than its parent, and after it on ties)."""
    choices = greedy_tree(marginal_accuracies(topk_acc), config.nodes)
    pick = torch.randperm(pos.numel(), generator=torch.Generator().manual_seed(0))
    pick = pick[:config.positions]
    chances = node_chances(lm, heads, inputs, teacher, pos[pick], valid[pick], choices)
    ranked = sorted(zip(choices, chances, strict=True), key=lambda cp: -cp[1])
    return [[list(c), p] for c, p in ranked if p > 0.0]


def calibrate(lm, heads: MedusaHeads, topk_acc: list[list[float]], inputs, teacher,
              pos: torch.Tensor, valid: torch.Tensor, prompts: list[list[int]],
              config: CalibrationConfig, progress: ProgressFn = ignore,
              cancel: threading.Event | None = None, seconds: float | None = None
              ) -> TreeChoice:
    """The candidate tree with its chances, and the heads' speed decoding held-out prompts
    against plain decoding here (as many prompts as fit in `seconds`, at least one)."""
    progress(Progress("calibrate", 0, 0, "counting which tree nodes the heads get right"))
    found = candidates(lm, heads, topk_acc, inputs, teacher, pos, valid, config)
    if not found:
        return TreeChoice([], False)
    drafter = drafter_of(lm, heads, found)
    params = SamplingParams(max_new_tokens=answer_room(lm, config.max_new_tokens))
    drafters: dict[str, Drafter] = {PLAIN: Drafter(), "medusa": drafter}
    count = prompts_that_fit(seconds, plain_step_seconds(lm), len(drafters), config)
    measured = measure(lm, drafters, prompts[:count], params, progress, cancel)
    pays = measured.get("medusa", {}).get("speedup", 0.0) > 1.0
    return TreeChoice(found, pays, "medusa" if pays else PLAIN, measured)


def prompts_that_fit(seconds: float | None, plain_s: float, candidates: int,
                     config: CalibrationConfig) -> int:
    """Prompts each candidate (plain decoding included) can decode in `seconds`, at most
    config.prompts and at least one; a reply is priced at plain decoding's step time (drafts
    are faster, prefills add a little: the two roughly cancel)."""
    if seconds is None:
        return config.prompts
    per_prompt = candidates * config.max_new_tokens * plain_s
    return max(1, min(config.prompts, int(seconds // max(per_prompt, 1e-9))))


def drafter_of(lm, heads: MedusaHeads, found: list[list]) -> MedusaDrafter:
    """The drafter over `found` candidates, as a checkpoint of them loads."""
    choices = [tuple(c) for c, _p in found]
    tree = build_tree(choices, heads.settings.num_heads)
    chance = {tuple(c): p for c, p in found}
    return MedusaDrafter(lm, heads, tree, [chance[c] for c in tree.choices[1:]])
