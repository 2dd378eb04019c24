"""Drafting sources composed into one drafter by one rule.

Every step each source's session offers, from the past only, a draft and each node's chance
of being kept (engine.decode.drafter.DraftOffer): from counts (lookup, the datastore), or from a
trained source's calibration corrected by what this reply kept, with the source's own work
timed here. The step takes the offer with the most expected tokens per unit of the step's
measured cost, cut to its most likely nodes where that pays, plain decoding when none
beats it; then every other offer that may join is grafted on (one tree,
engine.decode.tree.join_trees) where the added tokens pay for the longer verification, a node two
sources both offer counted once.

A step drafted by one source that verifies its own drafts (Kangaroo: only the layers above
its early exit) goes to that session; otherwise the composite runs the whole model once,
keeping every layer's states when any source reads them, and every session observes what
was kept (Kangaroo's adapter reads the kept tokens' layer-l states at its next round, so no
layer runs twice). Verification is the shared loop's, so greedy replies stay exactly plain
greedy decoding and sampling stays lossless whatever the choice, as it depends only on the
past.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.config import SamplingParams
from engine.decode.drafter import Draft, Drafter, DraftOffer, Session, forward_layers
from engine.decode.timing import StepCost, reply_cost
from engine.decode.tree import TreeShape, join_trees, shape_of


def best_size(chances: list[float], value: Callable[[int, float], float]) -> int:
    """How many of the most likely nodes to draft: the k >= 1 that maximizes value(k, their
    summed chances); 0 without nodes."""
    best_k, best, gain = 0, float("-inf"), 0.0
    for k, p in enumerate(sorted(chances, reverse=True), 1):
        gain += p
        if (v := value(k, gain)) > best:
            best_k, best = k, v
    return best_k


def price(offer: DraftOffer, k: int, cost: StepCost) -> float:
    """Plain steps of a step drafting `offer`'s k most likely nodes alone: its own round
    where it verifies itself, else verifying k + 1 tokens plus its own work."""
    return offer.round_cost if offer.round_cost is not None else cost(k + 1) + offer.overhead


def alone(offer: DraftOffer, cost: StepCost) -> tuple[int, float]:
    """(nodes, expected tokens per plain step of cost) of `offer` drafted as the whole
    step, cut to the nodes that pay (a source with its own round drafts all of it)."""
    if offer.round_cost is not None:
        k = offer.size
    else:
        k = best_size(list(offer.chances), lambda k, g: (1.0 + g) / price(offer, k, cost))
    return k, (1.0 + sum(sorted(offer.chances, reverse=True)[:k])) / price(offer, k, cost)


def pick(offers: list[DraftOffer | None], cost: StepCost) -> tuple[int, int] | None:
    """(index, nodes) of the offer that drafts the step alone, or None where none beats
    plain decoding (one token per plain step)."""
    best, best_value = None, 1.0
    for i, offer in enumerate(offers):
        if offer is None or offer.size == 0:
            continue
        k, value = alone(offer, cost)
        if k > 0 and value > best_value:
            best, best_value = (i, k), value
    return best


def join_size(offer: DraftOffer, tokens: float, base: int, overhead: float, cost: StepCost) -> int:
    """How many of `offer`'s nodes to graft onto a `base`-node draft expected to keep
    `tokens` tokens whose sources' own work costs `overhead`: the count that maximizes
    tokens per step cost; 0 where that join cannot pay even at best (every node's chance
    added, the verification no longer than the draft's own), so the offer is never built
    for nothing (a trained source's build runs its heads)."""
    spent = overhead + offer.overhead

    def joined(k: int, gain: float) -> float:
        return (tokens + gain) / (cost(base + k) + spent)

    k = best_size(list(offer.chances), joined)
    best = (tokens + sum(sorted(offer.chances, reverse=True)[:k])) / (cost(base) + spent)
    return k if k and best > tokens / (cost(base) + overhead) else 0


def node_chances(draft: Draft, offer: DraftOffer, k: int) -> list[float]:
    """Each node's chance of being kept in `draft`, `offer`'s draft of its k most likely
    nodes (the root's 1.0): as the source says, else its chances in node order."""
    if draft.chances is not None:
        return list(draft.chances)
    return [1.0, *sorted(offer.chances, reverse=True)[:k]]


def added_tokens(chances: list[float], extra: list[float], where: list[int]) -> float:
    """Expected tokens a grafted draft adds: a node it merged into an existing one is the
    same event, counted once (at the likelier estimate). Updates `chances` (the joined
    draft's, new nodes appended as zeros first) in place."""
    added = 0.0
    for node, into in enumerate(where, start=1):
        while into >= len(chances):
            chances.append(0.0)
        gain = max(0.0, extra[node] - chances[into])
        chances[into] += gain
        added += gain
    return added


class TreeJoin:
    """Grafts one draft onto another as one tree (engine.decode.tree.join_trees); the structures
    are kept per shape, so a repeated shape costs no new mask. It keeps what a join takes
    (an average over the latest ones), so a join must pay for itself too."""

    MAX_SHAPES = 512  # shapes kept before the cache starts over
    AVERAGE = 0.1  # weight of the latest join in the running average of its seconds

    def __init__(self) -> None:
        self._shapes: dict[tuple[int, ...], TreeShape] = {}
        self.seconds = 0.0  # what a join takes here, on average

    def __call__(self, a: Draft, b: Draft) -> tuple[Draft, list[int]]:
        """(the joined draft, the joined nodes of b's non-root nodes)."""
        if b.size == 1:
            return a, []
        start = time.perf_counter()
        tokens, parents, where = join_trees(a.tokens, a.children, b.tokens, b.children)
        key = tuple(parents)
        shape = self._shapes.get(key)
        if shape is None:
            if len(self._shapes) >= self.MAX_SHAPES:
                self._shapes.clear()
            shape = self._shapes[key] = shape_of(parents)
        took = time.perf_counter() - start
        self.seconds += self.AVERAGE * (took - self.seconds) if self.seconds else took
        return Draft(tokens, shape.children, shape.depths, shape.mask), where[1:]

    def steps(self, cost: StepCost) -> float:
        """A join's time in plain steps (0 where the plain step was not measured)."""
        return self.seconds / cost.plain_s if cost.plain_s > 0 else 0.0


@dataclass
class ComposedStep:
    """One step of a composite: its draft and where its nodes came from."""

    kind: str  # what the step counts as: the kinds of the offers in it, joined by "+"
    draft: Draft
    nodes_by_source: dict[int, list[int]]  # source index -> the draft's nodes it offered
    verifier: int | None = None  # the source whose session verifies the step (None: whole model)


def plan(offers: list[DraftOffer | None], root: int, cost: StepCost, join: TreeJoin,
         verifies: list[bool]) -> ComposedStep:
    """This step's draft under the composite's rule (see the module doc)."""
    chosen = pick(offers, cost)
    if chosen is None:
        return ComposedStep("off", Draft.chain(root, []), {})
    first, k = chosen
    base = offers[first]
    draft = base.build(k)
    step = ComposedStep(base.kind, draft, {first: list(range(1, draft.size))},
                        first if verifies[first] else None)
    if not base.joins:
        return step
    chances = node_chances(draft, base, k)
    tokens, overhead = sum(chances), base.overhead
    for i, offer in enumerate(offers):
        if i == first or offer is None or not offer.joins or offer.size == 0:
            continue
        k = join_size(offer, tokens, step.draft.size, overhead, cost)
        if k == 0:
            continue
        extra = offer.build(k)
        joined, where = join(step.draft, extra)
        grown = list(chances)
        added = added_tokens(grown, node_chances(extra, offer, k), where)
        spent = overhead + offer.overhead + join.steps(cost)
        if (tokens + added) / (cost(joined.size) + spent) > \
                tokens / (cost(step.draft.size) + overhead):
            joined.chances, chances = grown, grown
            step.draft, step.kind = joined, f"{step.kind}+{offer.kind}"
            step.nodes_by_source[i] = where
            tokens, overhead = tokens + added, spent
    return step


class Composite(Drafter):
    """Sources and the rule that composes their offers (see module doc)."""

    drafts = True

    def __init__(self, name: str, sources: dict[str, Drafter], cost: StepCost | None = None,
                 lead: str | None = None, pick: str = "",
                 explain: Callable[[Composite, object], str] | None = None,
                 sampled: Callable[[SamplingParams], StepCost] | None = None):
        self.name = name
        # what verifying n tokens costs here, in plain steps: greedy replies' curve, and
        # params -> a sampled reply's (engine.decode.timing.sampled_cost; None: `cost` for all)
        self.cost = cost or StepCost()
        self.sampled = sampled
        self.lead = sources.get(lead) if lead else None  # the trained source it is judged by
        if self.lead is not None and not self.lead.pays_off:
            # It decodes plainly here (its notice says so): in the mix it would only make
            # every step keep each layer's states for it.
            sources = {n: s for n, s in sources.items() if s is not self.lead}
        self.sources = sources  # source name -> drafter, in the order offers are joined
        self.pick = pick  # what it chose among its sources at load, stored with each reply
        self.explain = explain  # (composite, reply stats or None) -> the readout's line
        self.wants_hidden = any(s.wants_hidden for s in sources.values())
        self.join = TreeJoin()  # shapes only: shared by every reply

    @property
    def pays_off(self) -> bool:
        return self.lead.pays_off if self.lead else True

    @property
    def notice(self) -> str:
        return self.lead.notice if self.lead else ""

    @property
    def retimed_speedup(self) -> float | None:
        return self.lead.retimed_speedup if self.lead else None

    @property
    def speedup(self) -> float | None:
        return self.lead.speedup if self.lead else None

    def used(self) -> str:
        return f"{self.name}:{self.pick}" if self.pick else self.name

    def reason(self, stats=None) -> str:
        return self.explain(self, stats) if self.explain else ""

    def start(self, state, prefill) -> CompositeSession:
        return CompositeSession(self, [s.start(state, prefill) for s in self.sources.values()],
                                [s.verifies for s in self.sources.values()],
                                reply_cost(state.params, self.cost, self.sampled))


class CompositeSession(Session):
    """One reply of a composite: its sources' sessions and the reply's mix of steps."""

    def __init__(self, composite: Composite, sessions: list[Session], verifies: list[bool],
                 cost: StepCost):
        self.composite = composite
        self.sessions = sessions
        self.verifies = verifies
        self.cost = cost  # the curve this reply's steps are priced by (timing.reply_cost)
        self.wants_hidden = composite.wants_hidden
        self.steps: Counter = Counter()  # steps per kind in this reply
        self.kept: Counter = Counter()  # draft tokens accepted per kind in this reply
        self._plan: ComposedStep | None = None
        self._layers: tuple[torch.Tensor, ...] | None = None  # a whole-model round's states
        self.planning_s = 0.0  # seconds spent choosing this reply's steps (drafts included)

    def propose(self, state) -> Draft:
        start = time.perf_counter()
        offers = [s.offer(state) for s in self.sessions]
        self._plan = plan(offers, state.ids[-1], self.cost, self.composite.join, self.verifies)
        self.planning_s += time.perf_counter() - start
        return self._plan.draft

    def score(self, state, draft: Draft) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self._plan.verifier is not None:
            return self.sessions[self._plan.verifier].score(state, draft)
        logits, self._layers = forward_layers(state, draft, self.wants_hidden)
        return logits, None if self._layers is None else self._layers[-1][0]

    def commit(self, state, draft: Draft, path: list[int]) -> None:
        step, verifier = self._plan, self._plan.verifier
        if verifier is not None:
            self.sessions[verifier].commit(state, draft, path)
        else:
            state.target.keep_path(state.cache, state.cached, [0, *path])
        for i, session in enumerate(self.sessions):  # layers: None where a session verified
            session.observe(state, self._layers, path, step.nodes_by_source.get(i, []))
        self._layers = None
        self.steps[step.kind] += 1
        self.kept[step.kind] += len(path)

    def finish(self, stats) -> None:
        """Put the reply's mix in its stats."""
        if stats is not None:
            stats.step_kinds, stats.kind_accepted = dict(self.steps), dict(self.kept)
            stats.planning_s = self.planning_s
        for session in self.sessions:
            session.finish(stats)
