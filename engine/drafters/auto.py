"""Auto: each reply uses the acceleration that decodes fastest for this model here.

Estimates (tokens per second of decoding, the prompt's prefill excluded) start from
calibration: a plain step timed when Auto is built, times the speedup each accelerator
measured when it was trained. Real replies then replace them with a running mean per
method, kept per model, device and dtype in the data folder. A method whose first estimate
comes close to the best is measured before the estimates are trusted, and the runner-up is
measured again now and then, so Auto switches when the live figures say another method
pays more. Off is always a candidate: Auto never settles on a method slower than it.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from engine import kv_cache
from engine.drafters.base import Drafter
from engine.drafters.registry import ACCEL_LABELS

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class AutoPolicy:
    """How estimates are updated and when a method other than the best is tried."""

    smoothing: float = 0.3  # weight of the newest reply in a method's running mean
    explore_within: float = 0.85  # unmeasured methods estimated at >= this share of the best
    # are measured before the estimates are trusted
    min_replies: int = 2  # replies that replace a method's calibration estimate
    revisit_every: int = 25  # every n-th reply measures the runner-up again
    min_tokens: int = 16  # shorter replies say too little about speed to be recorded


@dataclass
class Figure:
    """What Auto believes about one method."""

    tok_s: float  # decoding tokens per second
    replies: int = 0  # real replies measured; 0 = the calibration estimate


class AutoDrafter(Drafter):
    """Delegates each reply to the candidate with the best estimate."""

    name = "auto"

    def __init__(self, candidates: dict[str, Drafter], figures: dict[str, Figure],
                 path: Path | None = None, policy: AutoPolicy | None = None):
        if "off" not in candidates or set(figures) != set(candidates):
            raise ValueError("Auto needs Off among its candidates and a figure for each")
        self.candidates = candidates
        self.figures = figures
        self.path = path  # where measured figures persist; None = this process only
        self.policy = policy or AutoPolicy()
        self.replies = 0
        self.current = self._choose()

    @property
    def wants_hidden(self) -> bool:  # read by prefill, before start()
        return self.candidates[self.current].wants_hidden

    @property
    def drafter(self) -> Drafter:
        return self.candidates[self.current]

    def start(self, state) -> None:
        self.drafter.start(state)

    def propose(self, state):
        return self.drafter.propose(state)

    def score(self, state, draft):
        return self.drafter.score(state, draft)

    def commit(self, state, draft, path) -> None:
        self.drafter.commit(state, draft, path)

    def finish(self, stats) -> None:
        """Record the reply's decoding speed for the method it used; choose the next one."""
        self.drafter.finish(stats)
        decode_s = stats.elapsed_s - stats.ttft_s
        if stats.tokens > self.policy.min_tokens and decode_s > 0:
            self.record(self.current, (stats.tokens - 1) / decode_s)
        self.replies += 1
        self.current = self._choose()

    def record(self, method: str, tok_s: float) -> None:
        fig = self.figures[method]
        fig.tok_s = tok_s if fig.replies == 0 else (
            (1 - self.policy.smoothing) * fig.tok_s + self.policy.smoothing * tok_s)
        fig.replies += 1
        self._save()

    def reason(self) -> str:
        """One line for the readout: the method in use and why."""
        fig, off = self.figures[self.current], self.figures["off"].tok_s
        label = ACCEL_LABELS.get(self.current, self.current)
        if self.current == "off":
            tried = any(f.replies for m, f in self.figures.items() if m != "off")
            return ("Off: no accelerator was measured faster than plain decoding here" if tried
                    else "Off: measuring plain decoding first")
        how = (f"measured on this machine over {fig.replies} replies" if fig.replies
               else "estimated from calibration")
        return f"{label}: {fig.tok_s / off:.2f}x Off, {how}"

    def _choose(self) -> str:
        ranked = sorted(self.figures, key=lambda m: self.figures[m].tok_s, reverse=True)
        best = self.figures[ranked[0]].tok_s
        p = self.policy
        for method in ranked:  # measure close contenders before trusting their estimates
            fig = self.figures[method]
            if fig.replies < p.min_replies and fig.tok_s >= p.explore_within * best:
                return method
        if len(ranked) > 1 and self.replies % p.revisit_every == p.revisit_every - 1:
            return ranked[1]
        return ranked[0]

    def _save(self) -> None:
        if self.path is None:
            return
        measured = {m: asdict(f) for m, f in self.figures.items() if f.replies}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(measured, indent=1))
            os.replace(tmp, self.path)
        except OSError as exc:  # a full disk costs the memory of past speeds, not the reply
            log.warning("could not save Auto's speed figures to %s: %s", self.path, exc)


def load_figures(path: Path | None, priors: dict[str, float]) -> dict[str, Figure]:
    """Calibration estimates (tok/s per method), replaced by measured figures saved at
    `path` for the same methods; an unreadable file is ignored with a warning."""
    figures = {m: Figure(tok_s) for m, tok_s in priors.items()}
    if path is None or not path.exists():
        return figures
    try:
        saved = json.loads(path.read_text())
        for method, fig in saved.items():
            if method in figures:
                figures[method] = Figure(float(fig["tok_s"]), int(fig["replies"]))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("ignoring Auto's unreadable speed figures in %s: %s", path, exc)
        return {m: Figure(tok_s) for m, tok_s in priors.items()}
    return figures


def plain_step_seconds(lm, context: int = 128, repeats: int = 5) -> float:
    """Median time of one plain decode step after a `context`-token prompt."""
    vocab = int(lm.model.config.vocab_size)
    ids = [(7 * i) % vocab for i in range(1, context + 2)]
    cache = kv_cache.new_cache(lm.model)
    times = []
    with torch.inference_mode():
        lm.model(input_ids=torch.tensor([ids[:-1]], device=lm.device), cache=cache,
                 use_cache=True, logits_to_keep=1)
        step = torch.tensor([ids[-1:]], device=lm.device)
        for _ in range(repeats + 1):  # the first one warms up
            begin = time.perf_counter()
            lm.model(input_ids=step, cache=cache, use_cache=True, logits_to_keep=1)
            times.append(time.perf_counter() - begin)
            kv_cache.drop_last(cache, 1)
    return statistics.median(times[1:])
