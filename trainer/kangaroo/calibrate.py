"""Kangaroo calibration on this machine: the exit layer, eta and gamma that decode fastest.

1. Plain greedy replies to held-out prompts: the reference tokens.
2. Per exit layer, the adapter reads those replies teacher-forced (one pass): at every
   position, whether its first choice is the model's next token and how sure it is. Walking
   the replies with the drafting rule gives, for every (eta, gamma), the steps and drafts
   greedy decoding would take (drafts after a wrong one are rejected whatever they are; their
   confidence is taken from the teacher-forced pass).
3. Two timed decodes per exit layer (eta 0, gamma 1 and 4) fit a step's cost a + b * drafts,
   and plain decoding's cost per step is timed beside them. The estimated speedup of a setting
   is plain time / (steps * a + drafts * b).
4. The best estimates are decoded for real against plain decoding, interleaved prompt by
   prompt, and the fastest measured is kept. When plain decoding wins, gamma is 0: Kangaroo
   then decodes plainly, and the metrics say it does not pay.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from engine.config import SamplingParams
from engine.drafters import kangaroo_layers as layers
from engine.drafters.base import Drafter
from engine.drafters.kangaroo import Adapter, KangarooDrafter, KangarooSettings
from engine.drafters.kangaroo_adapter import sequence_states
from engine.generate import run
from engine.interleave import interleaved
from engine.progress import Progress, ProgressFn, ignore
from trainer.context import answer_room, fit_prompt
from trainer.measure import PLAIN, measure


@dataclass(frozen=True)
class KangarooCalibration:
    """What calibration tries and how long it measures."""

    etas: tuple[float, ...] = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)  # thresholds simulated
    gammas: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 8)  # draft lengths simulated
    fit_gammas: tuple[int, int] = (1, 4)  # gammas timed (eta 0) to fit a step's cost
    prompts: int = 6  # held-out prompts decoded
    fit_prompts: int = 2  # of which timed for the cost fit
    max_new_tokens: int = 96  # tokens per reply
    finalists: int = 3  # best estimates decoded for real against plain decoding
    seconds: float = 180.0  # kept back from training for all of the above (150 s measured
    # for three exit layers on a 2-core CPU)


@dataclass
class CalibrationResult:
    """The chosen setting and the figures behind it."""

    settings: KangarooSettings  # gamma 0 when nothing beat plain decoding
    pays: bool  # a setting was measured faster than plain decoding
    speedup: float  # measured median speedup of the chosen setting (1.0 = plain)
    ctar: list[float]  # CTAR(1..6) of the chosen setting's measured replies
    mean_accepted: float  # tokens per step of the chosen setting's measured replies
    table: dict = field(default_factory=dict)  # costs, estimates and measurements


def teacher_forced(lm, drafter: KangarooDrafter, seq: list[int]) -> tuple[list[bool], list[float]]:
    """For each position t of seq: does the draft's first choice equal seq[t + 1], and its
    top-1 probability. One full forward plus one adapter pass."""
    model = lm.model
    with torch.inference_mode():
        ids = torch.tensor([seq], device=lm.device)
        hidden = model(input_ids=ids, output_hidden_states=True, use_cache=False,
                       logits_to_keep=1).hidden_states  # one pass: no cache to build
        x = layers.exit_states(hidden, drafter.settings.exit_layer)
        _logits, guess, conf = drafter.guesses(sequence_states(model, drafter.adapter, x)[0])
    match = (guess[:-1] == ids[0, 1:]).tolist()
    return match, conf[:-1].tolist()


def simulate(match: list[bool], conf: list[float], start: int, eta: float,
             gamma: int) -> tuple[int, int]:
    """(steps, drafted tokens) greedy decoding takes from the pending token at `start` to
    the end of the sequence, drafting until top-1 <= eta or gamma drafts."""
    steps = drafted = 0
    t, end = start, len(match)
    while t < end:
        k = accepted = 0
        wrong = False
        while k < gamma and t + k < end:
            wrong = wrong or not match[t + k]
            accepted += not wrong
            k += 1
            if conf[t + k - 1] <= eta:
                break
        steps += 1
        drafted += k
        t += accepted + 1
    return steps, drafted


def calibrate(lm, adapters: dict[int, Adapter], ffn: bool, vocab: torch.Tensor | None,
              prompts: list[list[int]], config: KangarooCalibration, progress: ProgressFn = ignore,
              cancel: threading.Event | None = None) -> CalibrationResult:
    """Choose the fastest (exit layer, eta, gamma) measured here, or none when none pays."""
    # Prompt + reply fit the context, so the teacher-forced pass over them does too.
    params = SamplingParams(max_new_tokens=answer_room(lm, config.max_new_tokens))
    prompts = [fit_prompt(lm, p, params.max_new_tokens) for p in prompts[: config.prompts]]
    refs = [run(lm, p, params)[1] for p in prompts]  # also warms the model up
    makers = {e: _maker(lm, adapter, ffn, vocab, e) for e, adapter in sorted(adapters.items())}
    costs = fit_costs(lm, prompts[: config.fit_prompts], params, makers, config.fit_gammas)
    estimates = []
    for n, (exit_layer, make) in enumerate(makers.items()):
        drafter = make(0.0, 1)
        traces = [teacher_forced(lm, drafter, p + r) for p, r in zip(prompts, refs, strict=True)]
        starts = [len(p) for p in prompts]
        estimates += _estimates(exit_layer, traces, starts, costs[exit_layer], config)
        progress(Progress("calibrate", n + 1, len(makers), f"exit layer {exit_layer} simulated"))
    estimates.sort(key=lambda e: -e["estimated_speedup"])
    finalists = estimates[: config.finalists]
    drafters: dict[str, Drafter] = {PLAIN: Drafter()}
    drafters.update({_name(e): makers[e["exit_layer"]](e["eta"], e["gamma"]) for e in finalists})
    measured = measure(lm, drafters, prompts, params, progress, cancel)
    best = max(finalists, key=lambda e: measured[_name(e)]["speedup"])
    figures = measured[_name(best)]
    pays = figures["speedup"] > 1.0
    settings = KangarooSettings(best["exit_layer"], best["eta"], best["gamma"] if pays else 0, ffn)
    table = {"costs_ms": costs, "estimates": estimates[:12], "measured": measured}
    return CalibrationResult(settings, pays, figures["speedup"], figures["ctar"],
                             figures["mean_accepted"], table)


def _maker(lm, adapter: Adapter, ffn: bool, vocab, exit_layer: int):
    """(eta, gamma) -> a drafter; all share one converted copy of the adapter."""
    base = KangarooDrafter(lm, adapter, KangarooSettings(exit_layer, 0.0, 1, ffn), vocab)
    return base.with_schedule


def fit_costs(lm, prompts, params: SamplingParams, makers: dict,
              gammas: tuple[int, int]) -> dict:
    """Milliseconds per decode step, per exit layer: plain decoding, and Kangaroo's
    base + per_draft * drafts (from eta-0 runs at two gammas). Interleaved per prompt."""
    drafters: dict = {PLAIN: Drafter()}
    for e, make in makers.items():
        drafters.update({(e, g): make(0.0, g) for g in gammas})
    secs = dict.fromkeys(drafters, 0.0)
    steps = dict.fromkeys(drafters, 0)
    drafted = dict.fromkeys(drafters, 0)

    def reply(name, ids: list[int]):
        return run(lm, ids, params, drafters[name])[2]

    for _n, replies in interleaved(list(drafters), prompts, reply):
        for name, stats in replies.items():
            secs[name] += stats.elapsed_s - stats.ttft_s
            steps[name] += stats.steps
            drafted[name] += sum(stats.drafted)
    ms = {name: 1e3 * secs[name] / max(1, steps[name]) for name in drafters}
    drafts = {name: drafted[name] / max(1, steps[name]) for name in drafters}
    out = {}
    g1, g2 = gammas
    for e in makers:
        slope = (ms[e, g2] - ms[e, g1]) / max(1e-9, drafts[e, g2] - drafts[e, g1])
        base = ms[e, g1] - slope * drafts[e, g1]
        out[e] = {"plain": round(ms[PLAIN], 3), "base": round(base, 3),
                  "per_draft": round(slope, 3)}
    return out


def _estimates(exit_layer: int, traces, starts: list[int], cost: dict,
               config: KangarooCalibration) -> list[dict]:
    """Estimated speedup of every (eta, gamma) for one exit layer; settings that draft
    identically (e.g. any eta at gamma 1) appear once, with the smallest eta and gamma."""
    out, seen = [], set()
    plain_steps = sum(len(m) - start for (m, _c), start in zip(traces, starts, strict=True))
    for gamma in config.gammas:
        for eta in config.etas:
            runs = [simulate(m, c, start, eta, gamma)
                    for (m, c), start in zip(traces, starts, strict=True)]
            steps, drafted = sum(r[0] for r in runs), sum(r[1] for r in runs)
            if (steps, drafted) in seen:
                continue
            seen.add((steps, drafted))
            ms = steps * cost["base"] + drafted * cost["per_draft"]
            out.append({"exit_layer": exit_layer, "eta": eta, "gamma": gamma,
                        "tokens_per_step": round(plain_steps / max(1, steps), 3),
                        "drafts_per_step": round(drafted / max(1, steps), 3),
                        "estimated_speedup": round(plain_steps * cost["plain"] / max(1e-9, ms), 3)})
    return out


def _name(e: dict) -> str:
    return f"l{e['exit_layer']}-eta{e['eta']}-g{e['gamma']}"
