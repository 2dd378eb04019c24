"""The datastore of the model's own outputs beside the other drafting sources.

- Medusa+datastore: Medusa+lookup's step (the heads' tree with a shorter match's
  continuation beside it, or a copy in progress alone) with the datastore's continuation
  tree grafted onto it as a trie, so one verification pass tries all three; a store node
  whose token a heads' or lookup node already holds under the same parent deepens that
  branch instead of repeating it.
- Auto's datastore choice (engine.drafters.auto): the store's tree joins Medusa's arm the
  same way, and with another arm (Kangaroo's adapter, or plain decoding) the store drafts
  alone where its tree is expected to beat that arm.

Both decide from the store's confidence (its tree's expected accepted tokens: the sum of
its nodes' path probabilities, from counts) against what verifying more tokens costs here
(StepCost, timed at load). Tokens stay point-mass proposals under the shared acceptance
rules: greedy replies equal plain greedy decoding and sampling stays lossless.
"""

from __future__ import annotations

from functools import partial

from engine.drafters.composite import Composite, Step
from engine.drafters.datastore import DatastoreDrafter, TreeJoin
from engine.drafters.hybrid import TreeWithChain, tree_or_copy
from engine.drafters.lookup import LookupDrafter, LookupParams
from engine.drafters.medusa import MedusaDrafter
from engine.drafters.payoff import alone_size, best_size
from engine.timing import StepCost

STORE = "datastore"  # the source name, and the kind of a step the store drafts alone
JOINED = "medusa+datastore"  # the kind of a Medusa step the store's tree joined


def joining_pays(gain: float, base: int, joined: int, speedup: float, cost: StepCost) -> bool:
    """Whether a step of `base` tokens expected to run at `speedup` x plain decoding gets
    faster when grown to `joined` tokens that add `gain` expected tokens."""
    return _joined_speed(gain, base, joined, speedup, cost) > speedup


def _joined_speed(gain: float, base: int, joined: int, speedup: float, cost: StepCost) -> float:
    return (speedup * cost(base) + gain) / cost(joined)


def join_store(c: Composite, state, step: Step, join: TreeJoin, speedup: float,
               cost: StepCost) -> Step:
    """`step` with the store's most probable nodes grafted on, as many as pay (kind
    JOINED), else as it is."""
    store: DatastoreDrafter = c.sources[STORE]
    base = step.draft.size
    offer, gain = store.offer(state, lambda probs: best_size(
        probs, lambda k, g: _joined_speed(g, base, base + k, speedup, cost)))
    if offer.size == 1:
        return step
    draft, mine = join(step.draft, offer)
    if not joining_pays(gain, base, draft.size, speedup, cost):
        return step
    store.mark(mine)
    return Step(JOINED, step.source, draft)


def tree_copy_or_store(c: Composite, state, merge: TreeWithChain, join: TreeJoin,
                       speedup: float, cost: StepCost) -> Step:
    """Medusa+datastore's choice: Medusa+lookup's step, the store's tree joined onto it
    unless it is a copy in progress."""
    step = tree_or_copy(c, state, merge)
    if step.source == "lookup":
        return step
    return join_store(c, state, step, join, speedup, cost)


def store_alone(c: Composite, state, speedup: float, cost: StepCost) -> Step | None:
    """The store's most probable nodes, as many as pay, as the whole step where they are
    expected to run faster than `speedup` x plain decoding (what the step would otherwise
    draft); else None."""
    store: DatastoreDrafter | None = c.sources.get(STORE)
    if store is None:
        return None
    offer, gain = store.offer(state, alone_size(cost))
    if offer.size == 1 or (1.0 + gain) / cost(offer.size) <= speedup:
        return None
    store.mark(list(range(1, offer.size)))
    return Step(STORE, STORE, offer)


def medusa_datastore(medusa: MedusaDrafter, store: DatastoreDrafter,
                     lookup: LookupParams | None = None, cost: StepCost | None = None,
                     speedup: float | None = None) -> Composite:
    """Medusa's tree, the lookup continuation and the datastore's tree in one step.
    speedup: Medusa's expected speedup here (its re-timed one, else 1: the store's nodes
    must pay for themselves)."""
    choose = partial(tree_copy_or_store, merge=TreeWithChain(medusa.tree), join=TreeJoin(),
                     speedup=speedup or medusa.retimed_speedup or 1.0,
                     cost=cost or StepCost())
    return Composite(JOINED, {"lookup": LookupDrafter(lookup or LookupParams()),
                              "medusa": medusa, STORE: store}, choose, lead="medusa")
