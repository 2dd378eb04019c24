"""Auto: copy while copying pays, otherwise the drafter calibration found fastest here.

Which drafter is fastest depends on the prompt as much as on the machine: a summary copies
its source (lookup wins), an answer in fresh words does not (Medusa's tree or Kangaroo's
adapter wins, or plain decoding where neither pays). Auto therefore takes, every step:

- copy: while the latest tokens match an earlier 3-gram, a copy is in progress: the lookup
  continuation alone (every method drafts the same here);
- otherwise its *arm*: the trained drafter with the best speedup calibration measured on
  this machine (re-timed at load in another dtype or on another device): Medusa's tree with
  a shorter match's short continuation beside it ("medusa+lookup"), a Kangaroo adapter round
  ("kangaroo"), or plain decoding ("off") when none pays.

This simple rule was measured against an adaptive Auto that re-timed every arm during
replies and counted the tokens arms that did not run would have kept: on the bundled
prompts (three passes) the adaptive one was not faster by more than the pass-to-pass
spread, so the rule is all there is (README, Speed).

Rounds that do not use the adapter run the whole model once with every layer's states kept:
Medusa's heads read the final state, and the Kangaroo adapter reads the layer-l states of
the kept tokens at its next round, so no layer runs twice for a token. Verification is the
shared loop's, so greedy replies stay exactly plain greedy decoding and sampling stays
lossless (the way a step drafts depends only on the past).
"""

from __future__ import annotations

from collections import Counter

import torch

from engine import kv_cache
from engine.drafters.base import Draft, Drafter, forward_layers
from engine.drafters.hybrid import TreeWithChain
from engine.drafters.kangaroo import KangarooDrafter
from engine.drafters.lookup import LookupParams, LookupSource
from engine.drafters.medusa import MedusaDrafter
from engine.drafters.registry import ACCEL_LABELS

COPY = "copy"  # rounds that draft a 3-gram match's continuation alone
# The trained arms, named for how they draft: Medusa's tree with the lookup continuation
# hung beside it, and a round of the Kangaroo adapter alone.
MEDUSA, KANGAROO = "medusa+lookup", "kangaroo"
ARM_OF = {"medusa": MEDUSA, "kangaroo": KANGAROO}  # trained accelerator -> its arm


def fastest_arm(speedups: dict[str, float]) -> str:
    """The arm with the best calibrated speedup over plain decoding; "off" when none beats
    it (speedups: arm -> measured speedup, for the trained drafters that pay)."""
    best = max(speedups, key=speedups.get, default="off")
    return best if speedups.get(best, 0.0) > 1.0 else "off"


class AutoDrafter(Drafter):
    """Copies while a 3-gram match holds; otherwise drafts with one arm (see module doc)."""

    name = "auto"

    def __init__(self, arm: str = "off", medusa: MedusaDrafter | None = None,
                 kangaroo: KangarooDrafter | None = None, lookup: LookupParams | None = None,
                 speedup: float | None = None):
        needs = {MEDUSA: medusa, KANGAROO: kangaroo}
        if arm != "off" and needs.get(arm) is None:
            raise ValueError(f"Auto's arm {arm!r} needs its trained drafter")
        self.arm = arm
        self.speedup = speedup  # the arm's calibrated speedup (None for off)
        self.source = LookupSource(lookup or LookupParams())
        self.medusa = medusa if arm == MEDUSA else None
        self.kangaroo = kangaroo if arm == KANGAROO else None
        self.merge = TreeWithChain(medusa.tree) if self.medusa is not None else None
        self.wants_hidden = arm != "off"
        self.steps: Counter = Counter()  # steps per way of drafting in the current reply
        self.last_reply: Counter = Counter()  # the same for the last finished reply
        self._round = "off"  # how this step drafts: COPY or the arm
        self._exits: torch.Tensor | None = None  # (1, n, H) layer-l states of a whole-model
        # round, which the adapter reads at its next round

    @property
    def current(self) -> str:
        """The arm it drafts with when not copying."""
        return self.arm

    def used(self) -> str:
        return f"auto:{self.arm}"

    # -- the decode loop's hooks ---------------------------------------------------------

    def start(self, state, prefill) -> None:
        self.source.reset()
        self.steps = Counter()
        if self.kangaroo is not None:
            self.kangaroo.start(state, prefill)

    def propose(self, state) -> Draft:
        chain, n = self.source.match(state.ids, state.room)
        root = state.ids[-1]
        copying = bool(chain) and self.source.copying(n)
        self._round = COPY if copying else self.arm
        if copying:
            return Draft.chain(root, chain)
        if self.arm == KANGAROO:
            return self.kangaroo.propose(state)
        if self.arm == MEDUSA:
            return self.merge(self.medusa.propose(state), chain)
        return Draft.chain(root, [])

    def score(self, state, draft: Draft) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self._round == KANGAROO:
            return self.kangaroo.score(state, draft)
        logits, hidden = forward_layers(state, draft, self.wants_hidden)
        if hidden is None:
            return logits, None
        if self.kangaroo is not None:
            self._exits = hidden[self.kangaroo.settings.exit_layer]
        return logits, hidden[-1][0]

    def commit(self, state, draft: Draft, path: list[int]) -> None:
        if self._round == KANGAROO:
            self.kangaroo.commit(state, draft, path)
        else:
            kv_cache.keep_path(state.cache, state.cached, [0, *path])
            if self._exits is not None:  # the adapter reads the kept tokens at its next round
                self.kangaroo.absorb(self._exits[:, [0, *path]])
                self._exits = None
                kv_cache.rollback(state.cache, 0)  # trims sliding-window layers
        self.steps[self._round] += 1

    def finish(self, stats) -> None:
        """Keep the reply's mix for the readout."""
        self.last_reply = self.steps

    def reason(self) -> str:
        """One line for the readout: how Auto drafts, and how the last reply did."""
        gain = f" ({self.speedup:.2f}x Off when calibrated)" if self.speedup else ""
        line = f"Auto copies from the conversation where it can, else drafts with " \
               f"{_label(self.arm)}{gain}"
        total = sum(self.last_reply.values())
        if total:
            mix = ", ".join(f"{_label(a)} {100 * n / total:.0f}%"
                            for a, n in self.last_reply.most_common())
            line += f"; the last reply: {mix} of the steps"
        return line


def _label(arm: str) -> str:
    return "copying" if arm == COPY else ACCEL_LABELS.get(arm, arm)
