"""Auto: copy while copying pays, otherwise the drafter calibration found fastest here.

Which drafter is fastest depends on the prompt as much as on the machine: a summary copies
its source (lookup wins), an answer in fresh words does not (Medusa's tree or Kangaroo's
adapter wins, or plain decoding where neither pays). Auto therefore takes, every step:

- copy: while the latest tokens match an earlier 3-gram, a copy is in progress: the lookup
  continuation alone (every method drafts the same here);
- otherwise its *arm*: the trained drafter with the best speedup calibration measured on
  this machine (re-timed at load in another dtype or on another device): Medusa's tree with
  a shorter match's short continuation beside it ("medusa+lookup"), a Kangaroo adapter round
  ("kangaroo"), or plain decoding ("off") when none pays;
- with the datastore of the model's own outputs (engine.drafters.withstore): its
  continuation tree joins Medusa's arm in the same step where the added tokens pay
  ("medusa+datastore"), and with the other arms drafts alone ("datastore") where its
  expected tokens per step cost beat the arm's calibrated speedup. Confidence comes from the
  store's counts, costs from steps timed at load.

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

from functools import partial

from engine.drafters.base import Draft, Drafter
from engine.drafters.composite import Composite, Step
from engine.drafters.hybrid import TreeWithChain, lookup_match, tree_or_copy
from engine.drafters.lookup import LookupDrafter, LookupParams
from engine.drafters.withstore import (
    STORE,
    TreeJoin,
    store_alone,
    tree_copy_or_store,
)
from engine.timing import StepCost, step_cost

COPY = "copy"  # rounds that draft a 3-gram match's continuation alone
# The trained arms, named for how they draft: Medusa's tree with the lookup continuation
# hung beside it, and a round of the Kangaroo adapter alone; keyed by the source they need.
MEDUSA, KANGAROO = "medusa+lookup", "kangaroo"
ARMS = {"medusa": MEDUSA, "kangaroo": KANGAROO}
SOURCE_OF = {arm: source for source, arm in ARMS.items()}  # arm -> the source it needs


def fastest_arm(speedups: dict[str, float]) -> str:
    """The arm with the best calibrated speedup over plain decoding; "off" when none beats
    it (speedups: arm -> measured speedup, for the trained drafters that pay)."""
    best = max(speedups, key=speedups.get, default="off")
    return best if speedups.get(best, 0.0) > 1.0 else "off"


def copy_or_alone(c: Composite, state, source: str | None, speedup: float = 1.0,
                  cost: StepCost | None = None) -> Step:
    """Copy while a 3-gram match holds; else the datastore's tree where it beats `source`
    (expected to run at `speedup` x plain decoding); else `source`'s draft alone (None:
    plain decoding)."""
    chain, n = lookup_match(c, state)
    if chain and c.sources["lookup"].source.copying(n):
        return Step(COPY, "lookup", Draft.chain(state.ids[-1], chain))
    if (step := store_alone(c, state, speedup, cost or StepCost())) is not None:
        return step
    if source is None:
        return Step("off", None, Draft.chain(state.ids[-1], []))
    return Step(ARMS[source], source, c.sources[source].propose(state))


def choice(arm: str, sources: dict[str, Drafter], speedup: float, cost: StepCost):
    """Auto's per-step choice for `arm` over `sources` (see the module doc); speedup: the
    arm's calibrated one."""
    if arm == MEDUSA:
        merge = TreeWithChain(sources["medusa"].tree)
        if STORE in sources:
            return partial(tree_copy_or_store, merge=merge, join=TreeJoin(), speedup=speedup,
                           cost=cost)
        return partial(tree_or_copy, merge=merge)
    return partial(copy_or_alone, source=SOURCE_OF.get(arm), speedup=speedup, cost=cost)


def auto(arm: str = "off", trained: dict[str, Drafter] | None = None,
         lookup: LookupParams | None = None, speedup: float | None = None,
         labels: dict[str, str] | None = None, store: Drafter | None = None,
         cost: StepCost | None = None) -> Composite:
    """Auto drafting with `arm` where it does not copy (see module doc). trained: source
    name -> trained drafter, the arm's among them; speedup: the arm's calibrated one;
    labels: method -> what people read."""
    source = SOURCE_OF.get(arm)
    if arm != "off" and (trained or {}).get(source) is None:
        raise ValueError(f"Auto's arm {arm!r} needs its trained drafter")
    sources = {"lookup": LookupDrafter(lookup or LookupParams())}
    if source is not None:
        sources[source] = trained[source]
    if store is not None:
        sources[STORE] = store
    return Composite("auto", sources, choice(arm, sources, speedup or 1.0, cost or StepCost()),
                     pick=arm, explain=partial(_reason, arm=arm, speedup=speedup,
                                               labels=labels or {}))


def over(lm, parts: dict[str, Drafter], labels: dict[str, str]) -> Composite:
    """Auto over the drafters of `lm` (source name -> drafter): the trained ones that pay
    here and the datastore. Copying where a 3-gram match holds, else the trained one with
    the best calibrated speedup, with or beside the datastore's tree."""
    from engine.accelerators import describe, measured_speedup
    from engine.drafters.lookup import fitted

    store = parts.get(STORE)
    paying = {s: d for s, d in parts.items() if s != STORE and d.pays}
    speedups = {ARMS[s]: d.retimed_speedup or measured_speedup(
        (describe(lm, s) or {}).get("metrics", {})) or 1.0 for s, d in paying.items()}
    arm = fastest_arm(speedups)
    cost = store.cost or step_cost(lm) if store is not None else None
    return auto(arm, paying, fitted(lm), speedups.get(arm), labels, store, cost)


def _reason(c: Composite, arm: str, speedup: float | None, labels: dict[str, str]) -> str:
    """One line for the readout: how Auto drafts, and how the last reply did."""
    label = {COPY: "copying", **labels}.get
    gain = f" ({speedup:.2f}x Off when calibrated)" if speedup else ""
    store = ", from the datastore where it is confident" if STORE in c.sources else ""
    line = (f"Auto copies from the conversation where it can{store}, else drafts with "
            f"{label(arm, arm)}{gain}")
    total = sum(c.last_reply.values())
    if total:
        mix = ", ".join(f"{label(a, a)} {100 * n / total:.0f}%"
                        for a, n in c.last_reply.most_common())
        line += f"; the last reply: {mix} of the steps"
    return line
