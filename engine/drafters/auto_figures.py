"""Auto's figures: the kinds of step and their arms, what Auto believes about each arm
(tokens a round yields, seconds it takes), the estimates calibration gives to start from,
and the file that keeps measured figures per model, device and dtype."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from engine.drafters.lookup import LookupParams

log = logging.getLogger(__name__)

NO_MATCH = "no match"  # the latest token occurred nowhere before
COPY = "copy"  # rounds that draft a 3-gram match's continuation alone


def match_kind(n: int) -> str:
    """The kind of step whose latest n tokens (and no more) match earlier ones."""
    return f"{n}-token match"


MATCH = match_kind(1)
# The trained arms, named for how they draft: Medusa's tree with the lookup continuation
# hung beside it, and a round of the Kangaroo adapter alone.
MEDUSA, KANGAROO = "medusa+lookup", "kangaroo"
ARM_OF = {"medusa": MEDUSA, "kangaroo": KANGAROO}  # trained accelerator -> its arm


@dataclass(frozen=True)
class AutoPolicy:
    """How fast the figures follow new rounds and how often arms are re-measured."""

    smoothing: float = 0.15  # weight of the newest sample in a reply's running means
    long_smoothing: float = 0.02  # ... in the means over all replies
    cost_smoothing: float = 0.02  # ... in an arm's seconds (at pace 1), once it has 3 timings
    pace_smoothing: float = 0.3  # how fast the pace follows the latest round
    explore_every: int = 64  # an arm unused for this many steps (of its kind) runs once
    first_rounds: int = 3  # ... or for 8 steps, until it was timed this often
    shadow_every: int = 3  # Medusa's tree is proposed for counting on every n-th other step
    adapter_every: int = 12  # ... and the adapter's guesses every n-th step
    switch_margin: float = 0.10  # a reply's best arm replaces the long-run best only when
    # its estimate is ahead by more than this share
    # False: the simple rule Auto is measured against: copy while a 3-gram match holds,
    # otherwise always the arm calibration estimated fastest (Off when none pays); no
    # counting for arms that did not run, no re-timing
    adaptive: bool = True


@dataclass
class Figure:
    """What Auto believes about one arm on one kind of step."""

    tokens: float  # tokens a round yields (or would have): over all replies so far
    seconds: float  # a round's seconds at pace 1 (see Pace)
    rounds: int = 0  # rounds timed; 0 = the calibration estimate
    samples: int = 0  # rounds whose tokens were counted
    # The same in the current reply (starts from `tokens`): how well a drafter guesses
    # depends on the text at hand, which changes more between replies than within one.
    recent: float | None = None

    @property
    def tok_s(self) -> float:
        return (self.tokens if self.recent is None else self.recent) / self.seconds

    @property
    def long_tok_s(self) -> float:
        """Tokens per second over all replies."""
        return self.tokens / self.seconds

    def new_reply(self) -> None:
        self.recent = self.tokens

    # Running means: plain means of the first samples (one odd early round must not linger
    # while an arm is rarely run), then weighting the newest sample by `weight`.
    def add_tokens(self, tokens: int, policy: AutoPolicy) -> None:
        self.samples += 1
        self.tokens += max(1 / self.samples, policy.long_smoothing) * (tokens - self.tokens)
        self.recent = self.tokens if self.recent is None else (
            self.recent + policy.smoothing * (tokens - self.recent))

    def add_seconds(self, seconds: float, policy: AutoPolicy) -> None:
        self.rounds += 1
        weight = 1 / self.rounds if self.rounds <= policy.first_rounds else policy.cost_smoothing
        self.seconds += weight * (seconds - self.seconds)

    def to_json(self) -> dict:
        return {"tokens": self.tokens, "seconds": self.seconds, "rounds": self.rounds,
                "samples": self.samples}


Figures = dict[str, dict[str, Figure]]  # step kind -> arm -> figure


@dataclass
class Pace:
    """How fast the machine runs just now, as one factor on every arm's seconds.

    Other programs' load, clocks and the length of the context slow every arm alike and
    change within a reply, while each arm is timed only when it runs: an arm timed just now
    must not be compared with another timed minutes ago at another pace. So a round's time
    is split into the arm's cost (slow to change) and the pace (fast), and arms are compared
    on their costs alone."""

    factor: float = 1.0  # seconds now / seconds at pace 1

    def time(self, fig: Figure, seconds: float, policy: AutoPolicy) -> None:
        """Record one timed round of the arm `fig` describes."""
        if fig.rounds >= policy.first_rounds:  # its cost is known: the gap is the pace's
            gap = seconds / (fig.seconds * self.factor)
            self.factor *= gap ** policy.pace_smoothing
        fig.add_seconds(seconds / self.factor, policy)


def arms_for(medusa: bool, kangaroo: bool, lookup: LookupParams) -> dict[str, tuple[str, ...]]:
    """The arms of each kind of step, given which trained drafters are available. Steps
    are told apart by the length of their lookup match (a 2-token match predicts better
    than a 1-token one), up to the length that counts as a copy."""
    trained = ((MEDUSA,) if medusa else ()) + ((KANGAROO,) if kangaroo else ())
    matched = {match_kind(n): ("lookup", "off", *trained)
               for n in range(lookup.min_ngram, lookup.max_ngram)}
    return {NO_MATCH: ("off", *trained), **matched}


def priors(step_s: float, speedups: dict[str, float],
           lookup: LookupParams | None = None) -> Figures:
    """Calibration estimates: an arm with speedup s yields s tokens per plain step time."""
    arms = arms_for(MEDUSA in speedups, KANGAROO in speedups, lookup or LookupParams())
    return {k: {a: Figure(speedups.get(a, 1.0), step_s) for a in names}
            for k, names in arms.items()}


def load_figures(path: Path | None, prior: Figures) -> Figures:
    """`prior`, with the figures measured earlier and saved at `path` for the same arms; an
    unreadable file is ignored with a warning."""
    figures = {k: {a: Figure(f.tokens, f.seconds) for a, f in arms.items()}
               for k, arms in prior.items()}
    if path is None or not path.exists():
        return figures
    try:
        saved = json.loads(path.read_text())
        for kind, arms in saved.items():
            for arm, fig in arms.items():
                if arm in figures.get(kind, {}):
                    new = Figure(float(fig["tokens"]), float(fig["seconds"]),
                                 int(fig["rounds"]), int(fig["samples"]))
                    if new.tokens <= 0 or new.seconds <= 0:
                        raise ValueError(f"non-positive figure for {arm}")
                    figures[kind][arm] = new
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("ignoring Auto's unreadable speed figures in %s: %s", path, exc)
        return load_figures(None, prior)
    return figures


def save_figures(path: Path, figures: Figures) -> None:
    """Write the measured figures (calibration estimates are not saved); a failure, e.g. a
    full disk, costs the memory of past speeds, never the reply."""
    measured = {k: {a: f.to_json() for a, f in arms.items() if f.rounds or f.samples}
                for k, arms in figures.items()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(measured, indent=1))
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("could not save Auto's speed figures to %s: %s", path, exc)
