"""Kangaroo calibration on this machine: the exit layer, eta and gamma that decode fastest,
chosen by a cost model so that a second run on the same data picks the same setting.

1. Plain greedy replies to held-out prompts: the reference tokens.
2. Per exit layer, the adapter reads those replies teacher-forced (one pass): at every
   position, whether its first choice is the model's next token and how sure it is. From
   these, for every (eta, gamma), the expected drafts and tokens of a round starting at any
   position (expected_round): no decoding, no timing noise.
3. Per-step costs from a few pieces, each timed several times interleaved with the others
   (fastest kept): the layer stack and the LM head over 1..k + 1 nodes and one adapter step.
   An exit layer's draft and verification costs follow from its share of the alike layers;
   a verification's cost is a straight line in its nodes.
4. Estimated speedup = tokens per round x plain step / expected round cost. Settings
   within `tolerance` of the best tie, and the one with the most tokens per round (which
   depends on the data only) wins. When none beats plain decoding, gamma is 0: Kangaroo then
   decodes plainly, and the metrics say it does not pay.
"""

from __future__ import annotations

import copy
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field

import torch
from transformers import DynamicCache

from engine.config import SamplingParams
from engine.decode import kv_cache, split, timing
from engine.decode.generate import run
from engine.drafters.kangaroo import Adapter, KangarooDrafter, KangarooSettings
from engine.drafters.kangaroo_adapter import adapt, sequence_states
from engine.progress import Progress, ProgressFn, ignore
from trainer.context import answer_room, fit_prompt


@dataclass(frozen=True)
class KangarooCalibration:
    """What calibration tries and how long it measures."""

    etas: tuple[float, ...] = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)  # thresholds tried
    gammas: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 8)  # draft lengths tried
    prompts: int = 6  # held-out prompts replied to (acceptance is measured on the replies)
    max_new_tokens: int = 96  # tokens per reply
    verify_sizes: tuple[int, ...] = (1, 2, 4, 8)  # drafted tokens per timed verification
    repeats: int = 9  # rounds of interleaved timings (fewer when the budget runs out)
    context: int = 128  # cached positions behind each timed step
    tolerance: float = 0.03  # estimates this close to the best tie (timing noise)
    seconds: float = 120.0  # kept back from training for all of the above


@dataclass(frozen=True)
class Costs:
    """Milliseconds per step on this machine."""

    plain: float  # one plain decoding step
    draft: dict[int, float]  # per exit layer: one draft token (shallow layers, adapter, head)
    verify: dict[int, tuple[float, float]]  # per exit layer: (base, per node) of the deep
    # layers verifying a round's nodes (the pending token and its drafts)

    def round_ms(self, exit_layer: int, drafts: float) -> float:
        """A round drafting `drafts` tokens: drafts + 1 shallow passes (the last draft's is
        counted as a full draft step, a slight overestimate) and the deep layers over
        drafts + 1 nodes. Linear in drafts, so it holds for expected drafts too."""
        base, per_node = self.verify[exit_layer]
        return (drafts + 1) * self.draft[exit_layer] + base + per_node * (drafts + 1)


@dataclass
class SettingsChoice:
    """The chosen setting and the figures behind it."""

    settings: KangarooSettings  # gamma 0 when nothing beat plain decoding
    pays_off: bool  # the chosen setting is estimated faster than plain decoding
    speedup: float  # estimated speedup of the chosen setting (1.0 = plain)
    ctar: list[float]  # CTAR(1..6) of the chosen exit layer on the held-out replies
    mean_accepted: float  # expected tokens per round of the chosen setting
    table: dict = field(default_factory=dict)  # costs and the best estimates


def teacher_forced(lm, drafter: KangarooDrafter, seq: list[int],
                   start: int) -> tuple[list[bool], list[float]]:
    """Per position t of seq predicting a reply token (t >= start - 1: the first `start` are
    the prompt's, the last of them the pending token): does the draft's first choice equal
    seq[t + 1], and its top-1 probability. One full forward plus one adapter pass."""
    model = lm.model
    with torch.inference_mode():
        ids = torch.tensor([seq], device=lm.device)
        hidden = model(input_ids=ids, output_hidden_states=True, use_cache=False,
                       logits_to_keep=1).hidden_states  # one pass: no cache to build
        x = split.exit_states(hidden, drafter.settings.exit_layer)
        _logits, guess, conf = drafter.guesses(sequence_states(model, drafter.adapter, x)[0])
    match = (guess[:-1] == ids[0, 1:]).tolist()
    return match[start - 1:], conf[:-1].tolist()[start - 1:]


def one_round(match: list[bool], conf: list[float], t: int, eta: float,
              gamma: int) -> tuple[int, int]:
    """(drafted, accepted) of a round whose first draft predicts position t: drafting goes
    on while the last draft's top-1 probability > eta, up to gamma drafts (or the end)."""
    k = accepted = 0
    wrong = False
    while k < gamma and t + k < len(match):
        wrong = wrong or not match[t + k]
        accepted += not wrong
        k += 1
        if conf[t + k - 1] <= eta:
            break
    return k, accepted


def expected_round(traces: list[tuple[list[bool], list[float]]], eta: float,
                   gamma: int) -> tuple[float, float]:
    """(expected drafts, expected tokens) of a round starting at any traced position: the
    tokens are the accepted drafts plus the verifier's own next token."""
    drafted = tokens = n = 0
    for match, conf in traces:
        for t in range(len(match)):
            k, a = one_round(match, conf, t, eta, gamma)
            drafted, tokens, n = drafted + k, tokens + a + 1, n + 1
    return drafted / max(1, n), tokens / max(1, n)


def ctar(traces: list[tuple[list[bool], list[float]]], widths: int = 6) -> list[float]:
    """CTAR(w) for w = 1..widths: the share of positions whose next w drafts are all right."""
    out = []
    for w in range(1, widths + 1):
        hits = [all(m[t:t + w]) for m, _c in traces for t in range(len(m) - w + 1)]
        out.append(round(sum(hits) / max(1, len(hits)), 4))
    return out


def estimates(traces: dict[int, list], costs: Costs, config: KangarooCalibration) -> list[dict]:
    """Estimated speedup of every (exit layer, eta, gamma); schedules that draft identically
    (e.g. any eta at gamma 1) appear once, with the smallest eta and gamma."""
    out = []
    for exit_layer, tr in sorted(traces.items()):
        seen = set()
        for gamma in config.gammas:
            for eta in config.etas:
                drafts, tokens = expected_round(tr, eta, gamma)
                if (drafts, tokens) in seen:
                    continue
                seen.add((drafts, tokens))
                speedup = tokens * costs.plain / costs.round_ms(exit_layer, drafts)
                out.append({"exit_layer": exit_layer, "eta": eta, "gamma": gamma,
                            "tokens_per_round": round(tokens, 4),
                            "drafts_per_round": round(drafts, 4),
                            "estimated_speedup": round(speedup, 4)})
    return out


def choose(table: list[dict], tolerance: float) -> dict:
    """The best estimate, where those within `tolerance` of it tie and the most tokens per
    round (then the smallest exit layer, gamma, eta) wins: timing noise cannot flip it."""
    best = max(e["estimated_speedup"] for e in table)
    ties = [e for e in table if e["estimated_speedup"] >= best * (1 - tolerance)]
    return min(ties, key=lambda e: (-e["tokens_per_round"], e["exit_layer"], e["gamma"], e["eta"]))


def calibrate(lm, adapters: dict[int, Adapter], vocab: torch.Tensor | None,
              prompts: list[list[int]], config: KangarooCalibration, progress: ProgressFn = ignore,
              cancel: threading.Event | None = None, costs: Costs | None = None
              ) -> SettingsChoice:
    """Choose the (exit layer, eta, gamma) the cost model finds fastest here, or none when
    none beats plain decoding. costs: timed here unless given."""
    deadline = time.perf_counter() + config.seconds
    # Prompt + reply fit the context, so the teacher-forced pass over them does too.
    params = SamplingParams(max_new_tokens=answer_room(lm, config.max_new_tokens))
    prompts = [fit_prompt(lm, p, params.max_new_tokens) for p in prompts[: config.prompts]]
    seqs = []
    for p in prompts:  # half the budget at most for replies (one at least)
        seqs.append(p + run(lm, p, params)[1])
        if time.perf_counter() > deadline - config.seconds / 2:
            break
    drafters = {e: KangarooDrafter(lm, a, KangarooSettings(e, 0.0, 1, a.source), vocab)
                for e, a in sorted(adapters.items())}
    traces = {}
    for n, (e, drafter) in enumerate(drafters.items()):
        traces[e] = [teacher_forced(lm, drafter, s, len(p))
                     for p, s in zip(prompts, seqs, strict=False)]
        progress(Progress("calibrate", n + 1, len(drafters), f"exit layer {e}: acceptance"))
    if costs is None:
        costs = time_costs(lm, drafters, max(seqs, key=len), config, deadline, cancel)
    table = estimates(traces, costs, config)
    best = choose(table, config.tolerance)
    pays = best["estimated_speedup"] > 1.0
    source = adapters[best["exit_layer"]].source
    settings = KangarooSettings(best["exit_layer"], best["eta"], best["gamma"] if pays else 0,
                                source)
    table.sort(key=lambda e: -e["estimated_speedup"])
    figures = {"costs_ms": asdict(costs), "estimates": table[:12]}
    return SettingsChoice(settings, pays, best["estimated_speedup"],
                             ctar(traces[best["exit_layer"]]), best["tokens_per_round"], figures)


def time_costs(lm, drafters: dict[int, KangarooDrafter], seq: list[int],
               config: KangarooCalibration, deadline: float,
               cancel: threading.Event | None = None) -> Costs:
    """Per-step costs from a few timed pieces: the whole layer stack over m nodes, the norm
    + LM head over m nodes, and one adapter step + draft head. The decoder layers are alike,
    so an exit layer's shallow and deep parts cost l/L and (L - l)/L of the stack: exits are
    compared by structure, not by separate noisy timings.

    Every piece is timed once per round (interleaved, each round starting one piece later),
    rounds repeated until `config.repeats` or the deadline; the fastest timing is kept, since
    other work on a shared machine only ever adds time (medians of a few timings swung
    several-fold between step kinds on a busy machine)."""
    model, total = lm.model, split.num_layers(lm.model)
    nodes = sorted({1, *(k + 1 for k in config.verify_sizes)})
    # n cached positions and the timed nodes after them stay inside the context window.
    n = max(1, min(len(seq) - 1, config.context, lm.context_len - nodes[-1]))
    drafter = next(iter(drafters.values()))  # adapters and draft heads are alike in cost
    with torch.inference_mode():
        cache = kv_cache.new_cache(model)
        hidden = model(input_ids=torch.tensor([seq[:n]], device=lm.device), cache=cache,
                       use_cache=True, output_hidden_states=True).hidden_states
        adapter_cache = DynamicCache()
        adapt(model, drafter.adapter, hidden[drafter.settings.exit_layer], 0, adapter_cache)
    tokens = (seq[n:] + [seq[n]] * nodes[-1])[:nodes[-1]]
    x = {m: split.embed(model, tokens[:m], n) for m in nodes}  # (1, m, H) input embeddings
    # The pieces, each op(cache, adapter_cache): one adapter step on its cache and the draft
    # head (the shallow layers are timed with the stack), every decoder layer over m nodes
    # after the n cached positions, and the final norm and the full LM head over m states.
    ops = {"adapter": lambda _c, a: drafter.guesses(adapt(model, drafter.adapter, x[1], n, a)[0])}
    for m in nodes:  # h=x[m]: each op keeps its own nodes
        ops[("layers", m)] = lambda c, _a, h=x[m]: split.run_layers(model, h, range(total), c, n)
        ops[("head", m)] = lambda _c, _a, h=x[m]: split.logits(model, split.parts(model).norm(h))
    samples = {name: [] for name in ops}
    names = list(ops)
    for r in range(config.repeats):
        if r and (time.perf_counter() > deadline or (cancel is not None and cancel.is_set())):
            break
        for name in names[r % len(names):] + names[:r % len(names)]:
            samples[name].append(_timed(ops[name], (cache, adapter_cache)))
    ms = {name: 1e3 * min(s) for name, s in samples.items()}
    stack = {m: ms[("layers", m)] for m in nodes}
    head = {m: ms[("head", m)] for m in nodes}
    draft = {e: round(e / total * stack[1] + ms["adapter"], 4) for e in drafters}
    verify = {e: _line([(m, (total - e) / total * stack[m] + head[m]) for m in nodes[1:]])
              for e in drafters}
    return Costs(round(stack[1] + head[1], 4), draft, verify)


def _timed(op, caches) -> float:
    """Seconds of one op on a copy of the prefilled caches (the copy is not timed)."""
    with torch.inference_mode():
        cache, adapter_caches = copy.deepcopy(caches)
        return timing.seconds(None, op, cache, adapter_caches)


def _line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares (intercept, slope) through (x, y) points; slope >= 0."""
    xs, ys = zip(*points, strict=True)
    slope = max(0.0, statistics.linear_regression(xs, ys).slope) if len(set(xs)) > 1 else 0.0
    return round(statistics.fmean(ys) - slope * statistics.fmean(xs), 4), round(slope, 4)
