"""Drafting sources composed into one drafter: an ordered set of sources and a per-step
choice among them.

A source is any Drafter. Every step the composite's `choose` picks how to draft and returns
a Step: what kind of step it is (counted per reply), the source that drafted it, and the
draft. `score` and `commit` go to that source when it verifies drafts itself
(`verifies`: Kangaroo runs only the layers above its early exit); otherwise the composite
runs the whole model once, keeping every layer's states when any source reads them, and
keeps the accepted path. Every other source then sees the kept tokens through `observe`
(Kangaroo's adapter reads their layer-l states at its next round, so no layer runs twice).

Verification is the shared loop's, so greedy replies stay exactly plain greedy decoding and
sampling stays lossless whatever the choice, as long as it depends only on the past.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.drafters.base import Draft, Drafter, forward_layers


@dataclass
class Step:
    """How one step drafts."""

    kind: str  # what the step counts as in the reply's mix (e.g. "copy", "kangaroo")
    source: str | None  # the source that drafted it (None: the composite itself)
    draft: Draft  # the candidate tokens


class Composite(Drafter):
    """Sources and a per-step choice among them (see module doc)."""

    drafts = True

    def __init__(self, name: str, sources: dict[str, Drafter],
                 choose: Callable[[Composite, object], Step], lead: str | None = None,
                 pick: str = "", explain: Callable[[Composite], str] | None = None):
        self.name = name
        self.sources = sources  # source name -> drafter, in the order they start
        self.choose = choose  # (composite, state) -> Step, from the past only
        self.lead = sources.get(lead) if lead else None  # the trained source it is judged by
        self.pick = pick  # what it chose among its sources at load, stored with each reply
        self.explain = explain  # (composite) -> the readout's line on how it drafts
        self.wants_hidden = any(s.wants_hidden for s in sources.values())
        self.kind = "off"  # this step's kind
        self.steps: Counter = Counter()  # steps per kind in the current reply
        self.last_reply: Counter = Counter()  # the same for the last finished reply
        self.kept: Counter = Counter()  # draft tokens accepted per kind in the current reply
        self._source: Drafter | None = None  # the source that drafted this step
        self._layers: tuple[torch.Tensor, ...] | None = None  # a whole-model round's states

    @property
    def pays(self) -> bool:
        return self.lead.pays if self.lead else True

    @property
    def notice(self) -> str:
        return self.lead.notice if self.lead else ""

    @property
    def retimed_speedup(self) -> float | None:
        return self.lead.retimed_speedup if self.lead else None

    def used(self) -> str:
        return f"{self.name}:{self.pick}" if self.pick else self.name

    def reason(self) -> str:
        return self.explain(self) if self.explain else ""

    def start(self, state, prefill) -> None:
        self.steps, self.kept = Counter(), Counter()
        for source in self.sources.values():
            source.start(state, prefill)

    def propose(self, state) -> Draft:
        step = self.choose(self, state)
        self.kind, self._source = step.kind, self.sources.get(step.source)
        return step.draft

    def score(self, state, draft: Draft) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self._source is not None and self._source.verifies:
            return self._source.score(state, draft)
        logits, self._layers = forward_layers(state, draft, self.wants_hidden)
        return logits, None if self._layers is None else self._layers[-1][0]

    def commit(self, state, draft: Draft, path: list[int]) -> None:
        own = self._source if self._source is not None and self._source.verifies else None
        if own is not None:
            own.commit(state, draft, path)
        else:
            state.target.keep_path(state.cache, state.cached, [0, *path])
        for source in self.sources.values():
            if source is not own:
                source.observe(state, self._layers, path)
        self._layers = None
        self.steps[self.kind] += 1
        self.kept[self.kind] += len(path)

    def finish(self, stats) -> None:
        """Keep the reply's mix for the readout, and put it in the reply's stats."""
        self.last_reply = self.steps
        if stats is not None:
            stats.step_kinds, stats.kind_accepted = dict(self.steps), dict(self.kept)
        for source in self.sources.values():
            source.finish(stats)
