"""Auto: every ready source composed by the one rule (engine.drafters.composite).

Which source is fastest depends on the prompt as much as on the machine: a summary copies
its source (lookup's copy in progress wins), an answer in fresh words does not (a trained
drafter wins, or plain decoding where none pays), and a reply like earlier ones repeats
them (the datastore wins, or joins a trained drafter's tree). Every step each source offers
a draft with its expected kept tokens, from the past only, and the composite takes what is
expected to run fastest under the step costs timed here (a sampled reply's own).

An adaptive Auto that re-timed every source during replies and counted the tokens sources
that did not run would have kept was measured against this rule: on the bundled prompts
(three passes) it was not faster by more than the pass-to-pass spread, so the rule is all
there is (docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from engine.config import SamplingParams
from engine.decode.drafter import Drafter
from engine.decode.timing import StepCost
from engine.drafters.composite import Composite

COPY = "copy"  # the kind of a step that copies a 3-gram match's continuation alone
# A trained source joins Auto only when estimated at least this much faster than plain
# decoding alone: its work (the heads, the adapter's layers) runs on every Auto step, while
# its drafts win only the steps the model-free sources do not. Measured on int8w (2-core
# AMD EPYC Zen 4, 7 prompts, 2026-12-07): Medusa estimated above 1x at load (alone it ran
# 1.01-1.04x Off that day) made Auto 13% slower than the datastore alone (132.1 against
# 151.4 tok/s); without it Auto ran level with the datastore (151.0, 151.5).
JOIN_MARGIN = 1.1


def fastest(sources: dict[str, Drafter]) -> str:
    """The trained source with the best estimated speedup over plain decoding here; "off"
    when none beats it."""
    speeds = {n: d.speedup for n, d in sources.items() if d.speedup is not None}
    best = max(speeds, key=speeds.get, default="off")
    return best if speeds.get(best, 0.0) > 1.0 else "off"


def auto(sources: dict[str, Drafter], cost: StepCost | None = None,
         labels: dict[str, str] | None = None,
         sampled: Callable[[SamplingParams], StepCost] | None = None) -> Composite:
    """Auto over `sources` (name -> ready drafter, in the order offers are joined): those
    estimated to pay too little here are left out (joining). `cost` prices greedy
    replies' steps, `sampled` sampled ones' (Composite)."""
    paying = joining(sources)
    return Composite("auto", paying, cost, pick=fastest(paying),
                     explain=partial(_reason, labels=labels or {}), sampled=sampled)


def joining(sources: dict[str, Drafter]) -> dict[str, Drafter]:
    """The sources Auto drafts from: the model-free ones (no estimate) and the trained ones
    that pay here by at least JOIN_MARGIN."""
    return {n: d for n, d in sources.items()
            if d.pays_off and (d.speedup is None or d.speedup >= JOIN_MARGIN)}


def label(kind: str, labels: dict[str, str]) -> str:
    """What people read for a step kind ("medusa+lookup" -> "Medusa+lookup")."""
    first, *rest = kind.split("+")
    name = {COPY: "copying", **labels}.get(first, first)
    return "+".join([name, *(labels.get(r, r).lower() for r in rest)])


def _reason(c: Composite, stats, labels: dict[str, str]) -> str:
    """One line for the readout: how Auto drafts, and how the reply `stats` did."""
    trained = c.sources.get(c.pick)
    gain = f" (estimated {trained.speedup:.2f}x Off here)" if trained is not None else ""
    store = ", from the datastore where it is confident" if "datastore" in c.sources else ""
    arm = label(c.pick, labels) if trained is not None else "plain decoding"
    line = (f"Auto copies from the conversation where it can{store}, else drafts with "
            f"{arm}{gain}")
    mix = dict(getattr(stats, "step_kinds", None) or {})
    total = sum(mix.values())
    if total:
        ranked = sorted(mix.items(), key=lambda kv: -kv[1])
        line += "; this reply: " + ", ".join(
            f"{label(k, labels)} {100 * n / total:.0f}%" for k, n in ranked) + " of the steps"
    return line
